//! Completion tracking and samples: markers around launches ("segments").
//!
//! A segment brackets consecutive launches on one stream between a start and an end marker,
//! so the limiter knows when its queued work has run (the queue rules and the demand it
//! publishes). A *sample* is a segment of one launch, measuring its identity's cost
//! ([`crate::costs`]). Only a *timed* segment's span is read: every sample, and ordinary
//! segments as the span ration allows ([`crate::costs::CostTable::take_span`]), which teach
//! the bracket's drain and bound what their launches were charged. The others are bracketed
//! by completion-only markers, which cost the GPU no measurable time, where a timing marker
//! costs it about 2 µs ([`crate::MarkerKind`]).
//!
//! The next segment on a stream chains onto the previous one's end marker (a timed segment
//! only onto a timed one) while the GPU has not reached it. A sample of an identity launched
//! before opens behind a gate ([`crate::GpuTimer::gate`]), released once its launch and end
//! marker are queued: it is *clean* unless the timer had to open the gate early (then it is
//! no sample). An identity's first launch is not gated (the driver may wait for the GPU inside
//! that launch call, loading the kernel): its sample is clean when its start marker was still
//! pending once the launch call had returned (the kernel was queued behind it), else its span
//! holds part of the call.

use super::{Limiter, TicketKind};
use crate::costs::{Charge, LaunchId};
use crate::share::NodeBoard;
use crate::traits::{Clock, ContainerView, GpuTimer, MarkerKind, Nanos};

pub(super) struct Segment<S, M> {
    stream: S,
    /// Owned by this segment; when chained, it was the previous segment's end.
    start: M,
    /// `start` is the end marker of the previous segment on the stream.
    chained: bool,
    /// Its markers are timed: its span is read when it settles.
    timed: bool,
    end: Option<M>,
    /// False once ownership of `end` passed to the following segment (chaining).
    end_owned: bool,
    launches: u32,
    /// What its launches were charged, ns of GPU time.
    pub(super) charged: f64,
    /// Their sample figures (cost plus a bracket's drain each), ns.
    sampled: f64,
    /// Its start marker was still pending when its end was recorded: every launch was
    /// queued before the GPU reached it, so no host gap falls inside its span.
    back_to_back: bool,
    /// Of that, what launches of unknown identity were charged (the mean cost).
    unknown_charged: f64,
    unknown: u32,
    /// The identity this segment samples, if it is a sample.
    sample: Option<LaunchId>,
    /// A sample's start marker was pending after its launch call returned.
    clean: bool,
    /// A sample's bracket waits behind a gate, opened once its end marker is queued.
    gated: bool,
}

/// The segments of one limiter: at most one open, the closed ones not yet complete.
pub(super) struct Segments<S, M> {
    pub(super) open: Option<Segment<S, M>>,
    pub(super) closed: std::collections::VecDeque<Segment<S, M>>,
    /// What the segments in flight (open and closed) were charged: kept as they change, so
    /// the launch path's queue rule does not walk them (tens in flight beside a deep
    /// neighbour, each a few cache lines).
    charged: f64,
}

impl<S, M> Default for Segments<S, M> {
    fn default() -> Self {
        Self {
            open: None,
            closed: Default::default(),
            charged: 0.0,
        }
    }
}

impl<S, M> Segments<S, M> {
    /// Charged GPU time of our launches not yet known complete.
    pub(super) fn queued(&self) -> f64 {
        #[cfg(test)]
        {
            // Every model test checks the running total against the segments themselves.
            let walked: f64 = self
                .closed
                .iter()
                .chain(&self.open)
                .map(|s| s.charged)
                .sum();
            assert!(
                (self.charged.max(0.0) - walked).abs() <= 1e-6 * walked.max(1.0),
                "running total {} against {walked}",
                self.charged
            );
        }
        self.charged.max(0.0)
    }

    /// A segment left the flight (settled or dropped): its charge is no longer queued.
    fn left(&mut self, seg: &Segment<S, M>) {
        self.charged = match self.is_idle() {
            // Exactly nothing in flight: no rounding carried on.
            true => 0.0,
            false => self.charged - seg.charged,
        };
    }

    /// What the oldest segment not known complete was charged (the work probably running
    /// now), or 0.
    pub(super) fn oldest_charged(&self) -> f64 {
        self.closed
            .front()
            .or(self.open.as_ref())
            .map_or(0.0, |s| s.charged)
    }

    /// Samples in flight.
    pub(super) fn samples(&self) -> usize {
        self.closed
            .iter()
            .chain(self.open.iter())
            .filter(|s| s.sample.is_some())
            .count()
    }

    pub(super) fn is_idle(&self) -> bool {
        self.open.is_none() && self.closed.is_empty()
    }
}

impl<C: Clock, T: GpuTimer, V: ContainerView, B: NodeBoard> Limiter<C, T, V, B> {
    /// Whether the segments in flight are at their bound (`max_outstanding`, which bounds
    /// the markers in flight). Launches never wait for bookkeeping: the open segment then
    /// grows past its size (coarser completion tracking), and a launch on another stream
    /// goes untracked (charged its cost all the same).
    pub(super) fn seg_bound_reached(&self) -> bool {
        self.seg.closed.len() >= self.cfg.max_outstanding
    }

    /// Makes sure a segment on `stream` brackets the coming launch: a fresh one of its own
    /// for a sample (`known`: its identity was launched before).
    pub(super) fn prepare(
        &mut self,
        stream: T::Stream,
        kind: TicketKind,
        id: LaunchId,
        known: bool,
        now: Nanos,
    ) {
        let sample = (kind == TicketKind::Sample).then_some(id);
        if let Some(open) = &self.seg.open
            && (open.stream != stream || sample.is_some())
        {
            if self.seg_bound_reached() {
                // The open segment stays; this launch goes untracked (see above).
                return;
            }
            self.close_open();
        }
        if self.seg.open.is_none() && self.seg_bound_reached() {
            return;
        }
        if self.seg.open.is_some() {
            return;
        }
        // Chain onto the previous segment's end marker: no marker of its own. A sample does
        // so only while the GPU has not reached that marker (the new work then queues right
        // behind it, so no idle time falls in between); otherwise its span would hold the
        // host's gap. An ordinary segment chains whatever the marker's state: what its span
        // is used for is decided at its close (`back_to_back`: its start still pending then,
        // so it was pending all along), and a span with a gap in it is used only to bound
        // unknown launches by the mean. A marker costs a real workload far more than its
        // driver call (the sample ration in `costs`), so none is recorded or asked for here.
        let timed = sample.is_some() || self.costs.take_span(now);
        // A sample opens behind a gate of its own when the timer can hold the stream: its
        // start marker then runs only once the launch and the end marker are queued. Not at
        // an identity's first launch: the driver may load its kernel then and wait for the
        // GPU inside the launch call, which would wait for the gate (the hook's timer opens
        // a gate held too long, and such a sample is not used).
        let gated = sample.is_some() && known && self.timer.gate(stream).is_ok();
        self.stats.gated_samples += u64::from(gated);
        let mut start = None;
        if !gated
            && let Some(prev) = self.seg.closed.back_mut()
            && prev.stream == stream
            && prev.end_owned
            && let Some(end) = prev.end
            // A span starts at a timed marker.
            && (prev.timed || !timed)
        {
            let pending = match sample {
                Some(_) => {
                    self.stats.queries += 1;
                    matches!(self.timer.is_complete(end), Ok(false))
                }
                None => true,
            };
            if pending {
                prev.end_owned = false;
                start = Some(end);
            }
        }
        let chained = start.is_some();
        let start = match start {
            Some(s) => s,
            None => match self.timer.record(stream, marker_kind(timed)) {
                Ok(m) => {
                    self.count_marker(timed);
                    m
                }
                Err(_) => {
                    // Unmeasured: the launch is charged its estimate only.
                    self.stats.timer_errors += 1;
                    if gated {
                        self.timer.open_gates();
                    }
                    return;
                }
            },
        };
        self.seg.open = Some(Segment {
            stream,
            start,
            chained,
            timed,
            end: None,
            end_owned: true,
            launches: 0,
            charged: 0.0,
            sampled: 0.0,
            back_to_back: false,
            unknown_charged: 0.0,
            unknown: 0,
            sample,
            clean: false,
            gated,
        });
    }

    /// Adds a launch charged `charge` (`known`: its identity's cost) to the open segment on
    /// `stream`, closing it when it holds enough work (a sample at once).
    pub(super) fn add_launch(&mut self, stream: T::Stream, charge: Charge, known: bool) {
        let Some(open) = self.seg.open.as_mut().filter(|o| o.stream == stream) else {
            return;
        };
        let charged = charge.cost;
        open.launches += 1;
        open.charged += charged;
        self.seg.charged += charged;
        open.sampled += charge.sampled;
        if !known {
            open.unknown += 1;
            open.unknown_charged += charged;
        }
        if open.gated {
            // Decided when the gate opens (`close_open`).
        } else if open.sample.is_some() {
            // Called once the launch call returned: see the module's docs.
            self.stats.queries += 1;
            open.clean = matches!(self.timer.is_complete(open.start), Ok(false));
        }
        let full = open.charged >= self.cfg.segment_work as f64
            || open.launches >= self.cfg.segment_launches;
        if open.sample.is_some() || (full && !self.seg_bound_reached()) {
            self.close_open();
        }
    }

    pub(super) fn close_open(&mut self) {
        let Some(mut seg) = self.seg.open.take() else {
            return;
        };
        if seg.launches == 0 {
            self.seg.left(&seg);
            self.drop_start(&seg);
            if seg.gated {
                self.timer.open_gates();
            }
            return;
        }
        let end = self.timer.record(seg.stream, marker_kind(seg.timed));
        if seg.gated {
            // After the end marker: the bracket holds the launch and its end, nothing of the
            // host's time between them. Clean if the gate held until now; a gate the timer
            // had to open early may have let the start marker run before the launch was
            // queued: then its span is no sample (it settles as an ordinary segment).
            seg.clean = self.timer.open_gates();
            if !seg.clean {
                self.stats.forced_gates += 1;
                seg.sample = None;
            }
        }
        match end {
            Ok(end) => {
                self.count_marker(seg.timed);
                if seg.timed && seg.sample.is_none() && seg.unknown == 0 && seg.launches >= 2 {
                    self.stats.queries += 1;
                    seg.back_to_back = matches!(self.timer.is_complete(seg.start), Ok(false));
                }
                seg.end = Some(end);
                self.seg.closed.push_back(seg);
            }
            Err(_) => {
                self.stats.timer_errors += 1;
                self.seg.left(&seg);
                self.drop_start(&seg);
            }
        }
    }

    fn count_marker(&mut self, timed: bool) {
        self.stats.markers += 1;
        if timed {
            self.stats.timed_markers += 1;
        }
    }

    /// Lets go of the start marker of a segment that was dropped unmeasured.
    fn drop_start(&mut self, seg: &Segment<T::Stream, T::Marker>) {
        if seg.chained {
            // The previous segment still waits on this marker as its end: hand it back.
            if let Some(prev) = self
                .seg
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

    /// Settles every closed segment whose end marker the GPU has reached. A stream runs its
    /// work in order, so once one of its segments is pending the later ones on it are too:
    /// one query per stream with work in flight, not one per segment.
    pub(super) fn poll(&mut self, now: Nanos) {
        self.last_poll = now;
        // The streams found pending (no allocation on the launch path: past eight, later
        // segments of further streams are asked about each).
        let mut pending: [Option<T::Stream>; 8] = [None; 8];
        let mut i = 0;
        while i < self.seg.closed.len() {
            let stream = self.seg.closed[i].stream;
            if pending.contains(&Some(stream)) {
                i += 1;
                continue;
            }
            let end = self.seg.closed[i]
                .end
                .expect("closed segments have an end marker");
            self.stats.queries += 1;
            match self.timer.is_complete(end) {
                Ok(false) => {
                    if let Some(free) = pending.iter_mut().find(|p| p.is_none()) {
                        *free = Some(stream);
                    }
                    i += 1;
                }
                Ok(true) => {
                    let seg = self.seg.closed.remove(i).expect("index in range");
                    self.settle(seg, true);
                }
                Err(_) => {
                    self.stats.timer_errors += 1;
                    let seg = self.seg.closed.remove(i).expect("index in range");
                    self.settle(seg, false);
                }
            }
        }
        if self.seg.is_idle() {
            // Everything submitted is done: the estimate of when queued work ends (which
            // only grows between completions) starts again from now.
            self.horizon = self.horizon.min(now as f64);
        }
    }

    /// A complete segment: a sample teaches its identity's cost; a segment with launches of
    /// unknown identity charges them what its span leaves after the known ones, but at most
    /// the mean cost each (a span also holds host gaps and other contexts' slices; the
    /// identity's own sample corrects it soon). The difference to what was charged goes to
    /// the pacer.
    fn settle(&mut self, seg: Segment<T::Stream, T::Marker>, complete: bool) {
        self.seg.left(&seg);
        let end = seg.end.expect("closed segments have an end marker");
        let span = (complete && seg.timed)
            .then(|| self.timer.elapsed(seg.start, end))
            .and_then(|r| r.map_err(|_| self.stats.timer_errors += 1).ok())
            .map(|ns| ns as f64);
        let mut actual = seg.charged;
        if let Some(span) = span {
            if let Some(id) = seg.sample {
                self.stats.samples += 1;
                self.costs.sample(id, span, seg.clean);
                actual = self.costs.cost(id).unwrap_or(span);
            } else if seg.back_to_back {
                self.costs.back_to_back(seg.sampled, span, seg.launches);
                actual = self.costs.within_span(actual, span);
            } else if seg.unknown > 0 {
                let known = seg.charged - seg.unknown_charged;
                let bound = self
                    .costs
                    .mean()
                    .map_or(f64::INFINITY, |m| m * f64::from(seg.unknown));
                actual = known + (span - known).clamp(0.0, bound);
            }
        }
        if seg.timed {
            // Its end marker drained the work ahead of it: GPU time of ours the launches'
            // costs leave out (see `costs`). A completion-only marker drains nothing.
            actual += self.costs.drain();
        }
        self.charge_correction(actual - seg.charged);
        self.usage.bin_busy += actual;
        self.stats.busy_ns += actual;
        self.stats.segments += 1;
        // Settled segments are complete, so a chained predecessor was settled before: the
        // start marker is this segment's alone.
        self.timer.release(seg.start);
        if seg.end_owned {
            self.timer.release(end);
        }
    }
}

fn marker_kind(timed: bool) -> MarkerKind {
    match timed {
        true => MarkerKind::Timed,
        false => MarkerKind::Completion,
    }
}
