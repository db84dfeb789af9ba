//! The limiter's measurement: markers of the GPU timer around launches ("segments"),
//! chained where the GPU has not reached the previous one's end, settled into measured GPU
//! time once complete; the launch cost learned from them.

use super::{Limiter, Segment};
use crate::traits::{Clock, ContainerView, GpuTimer, Nanos};

impl<C: Clock, T: GpuTimer, V: ContainerView> Limiter<C, T, V> {
    /// Estimated GPU time of our launches not yet known complete.
    pub(super) fn queued_estimate(&self) -> f64 {
        self.closed
            .iter()
            .chain(self.open.iter())
            .map(|s| s.est)
            .sum()
    }

    /// GPU time still queued, at `fit` ns a launch: the launches of the segments not yet
    /// complete (a segment partly run counts whole).
    pub(super) fn queued_fit(&self, fit: f64) -> f64 {
        self.closed
            .iter()
            .chain(self.open.iter())
            .map(|s| f64::from(s.launches) * fit)
            .sum()
    }

    /// Makes sure an open segment on `stream` brackets the coming launch.
    pub(super) fn prepare(&mut self, now: Nanos, stream: T::Stream) {
        if let Some(open) = &self.open {
            if open.stream != stream || now.saturating_sub(open.last_launch) >= self.cfg.idle_gap {
                self.close_open(now);
            }
        }
        if self.open.is_some() {
            return;
        }
        // Chain onto the previous segment's end marker when the GPU has not reached it
        // yet: the new work queues right behind, so no idle time falls in between.
        let mut start = None;
        if let Some(prev) = self.closed.back_mut() {
            if prev.stream == stream && prev.end_owned {
                if let Some(end) = prev.end {
                    self.stats.queries += 1;
                    if let Ok(false) = self.timer.is_complete(end) {
                        prev.end_owned = false;
                        start = Some((end, true));
                    }
                }
            }
        }
        let chained = start.is_some();
        let (start, start_owned) = match start {
            Some(s) => s,
            None => match self.timer.record(stream) {
                Ok(m) => {
                    self.stats.markers += 1;
                    (m, true)
                }
                Err(_) => {
                    // Unmeasured: the launch is charged its estimate only.
                    self.stats.timer_errors += 1;
                    return;
                }
            },
        };
        self.open = Some(Segment {
            stream,
            start,
            start_owned,
            chained,
            end: None,
            end_owned: true,
            launches: 0,
            est: 0.0,
            last_launch: now,
            ended_idle: false,
        });
    }

    pub(super) fn close_open(&mut self, now: Nanos) {
        let Some(mut seg) = self.open.take() else {
            return;
        };
        if seg.launches == 0 {
            self.drop_start(&seg);
            return;
        }
        match self.timer.record(seg.stream) {
            Ok(end) => {
                self.stats.markers += 1;
                seg.end = Some(end);
                // Recorded after the host was idle for a gap: the span to this marker
                // includes the idle spell. Whether the GPU still had work cannot be told by
                // asking the marker now (a marker recorded on an idle stream need not be
                // complete at once), so the span is bounded by the learned cost when settled:
                // on the H200 a 30% tenant's 3 s pause was charged as 3.2 s of GPU time.
                seg.ended_idle = now.saturating_sub(seg.last_launch) >= self.cfg.idle_gap;
                self.closed.push_back(seg);
            }
            Err(_) => {
                self.stats.timer_errors += 1;
                self.drop_start(&seg);
            }
        }
    }

    /// Lets go of the start marker of a segment that was dropped unmeasured.
    fn drop_start(&mut self, seg: &Segment<T::Stream, T::Marker>) {
        if !seg.start_owned {
            return;
        }
        if seg.chained {
            // The previous segment still waits on this marker as its end: hand it back.
            if let Some(prev) = self
                .closed
                .iter_mut()
                .rev()
                .find(|p| !p.end_owned && p.end == Some(seg.start))
            {
                prev.end_owned = true;
                return;
            }
        }
        self.timer.release(seg.start);
    }

    /// Settles every closed segment whose end marker the GPU has reached.
    pub(super) fn poll(&mut self, now: Nanos) {
        self.last_poll = now;
        let mut i = 0;
        while i < self.closed.len() {
            let end = self.closed[i]
                .end
                .expect("closed segments have an end marker");
            self.stats.queries += 1;
            match self.timer.is_complete(end) {
                Ok(false) => i += 1,
                Ok(true) => {
                    let seg = self.closed.remove(i).expect("index in range");
                    self.settle(seg, true);
                }
                Err(_) => {
                    self.stats.timer_errors += 1;
                    let seg = self.closed.remove(i).expect("index in range");
                    self.settle(seg, false);
                }
            }
        }
        if self.closed.is_empty() && self.open.is_none() {
            // Everything submitted is done: the estimate of when queued work ends (which
            // only grows between measurements) starts again from now.
            self.horizon = self.horizon.min(now as f64);
        }
    }

    fn settle(&mut self, seg: Segment<T::Stream, T::Marker>, complete: bool) {
        let end = seg.end.expect("closed segments have an end marker");
        let span = if complete {
            match self.timer.elapsed(seg.start, end) {
                Ok(ns) => Some(ns as f64),
                Err(_) => {
                    self.stats.timer_errors += 1;
                    None
                }
            }
        } else {
            None
        };
        // A measurement replaces the estimate; without one the estimate stands.
        let measured = match span {
            None => seg.est,
            Some(span) if seg.ended_idle => {
                // The span runs to when the marker was recorded, after an idle gap; the
                // work itself is taken to have lasted what the learned cost says at most.
                match self.cost {
                    Some(c) => span.min(c * f64::from(seg.launches)),
                    None => span,
                }
            }
            Some(span) => {
                let per = span / f64::from(seg.launches);
                self.cost = Some(match self.cost {
                    Some(c) if per <= 2.0 * c => 0.75 * c + 0.25 * per,
                    _ => per,
                });
                self.learn_launch(per);
                span
            }
        };
        self.raw_busy += measured;
        self.own_busy += measured;
        let measured = measured * self.correction;
        self.vt += (measured - seg.est) / self.limit;
        self.bin_busy += measured;
        self.stats.busy_ns += measured;
        self.stats.segments += 1;
        // Settled segments are complete, so a chained predecessor was settled before: the
        // start marker is this segment's alone.
        if seg.start_owned {
            self.timer.release(seg.start);
        }
        if seg.end_owned {
            self.timer.release(end);
        }
    }

    /// Learns the launch length for the turn layout from a segment's cost per launch `per`:
    /// as the pacer's cost, except that a value over twice the estimate is believed only
    /// when the next segment says so too. Such a value is a longer kernel, or work that
    /// waited behind another context's (the events count the wait as ours); one outlier
    /// would stretch the cycle every container lays out (the simulated four tenants: a
    /// 250 us kernel published as 2.3 ms), and make its own window hold a fraction of what
    /// it can. The pacer keeps adopting it at once: there it only holds this container back.
    fn learn_launch(&mut self, per: f64) {
        self.turn_cost = Some(match self.turn_cost {
            Some(c) if per <= 2.0 * c => {
                self.turn_jump = false;
                0.75 * c + 0.25 * per
            }
            Some(c) if !self.turn_jump => {
                self.turn_jump = true;
                c
            }
            _ => {
                self.turn_jump = false;
                per
            }
        });
    }
}
