//! The power share: a limited tenant's share of the GPU's power budget.
//!
//! **Why.** The limit is a share of the GPU. For most work a share of *time* is a share of
//! throughput, but not for work that runs power-capped on the whole GPU: a tensor-core
//! matmul loop draws ~690 W of the H200's 700 W at 1455–1530 MHz when unlimited, while
//! held to 50% of the time it idles half the time, runs at 1980 MHz and so does ~60% of
//! its unlimited work (docs/sm-limit.md). Time is the wrong unit there; power is the
//! binding resource.
//!
//! **What is measured.** Once per publish period the device's energy counter, enforced
//! power limit and utilization ([`PowerSample`]), and this process's measured GPU time.
//! Over the last [`LimiterConfig::power_window`](crate::LimiterConfig::power_window):
//! average power `P` and busy fraction `d` (ours plus our container's peers', or the
//! device's own utilization if higher). The device's idle power `P₀` comes from a span of
//! at least `power_idle_span` in which nothing ran (typically from just before this
//! process created its context to its first launch). Then `e = (P − P₀) / d` is the power
//! the work draws per busy second above idle, and `P₀ + e` what the GPU would draw running
//! it all the time.
//!
//! **The rule.** If `P₀ + e` stays under the power limit `P_max`, the work would not be
//! power-capped unlimited, and the time share stands (scale 1). Otherwise the unlimited GPU
//! would run it with a dynamic power budget of `B = P_max − P₀`, and the limit's time share
//! is scaled by `(B / e)^k`:
//! - `k = 0` keeps the time share: right if throughput per busy second did not depend on the
//!   clock. It overshoots, since a capped GPU runs slower.
//! - `k = 1` gives the same share of the power budget: right if every unit of work took the
//!   same energy at any clock. It undershoots, since energy per operation rises with clock
//!   and voltage (H200 matmul: ~10% more per operation at 1980 than at ~1450 MHz).
//! - The default `k = ½` assumes throughput per busy second grows as the square root of the
//!   power per busy second (for instance clock ∝ throughput, power ∝ clock²). The H200
//!   matmul measured sits close to it (about 0.6, from the runs in docs/benchmarks.md).
//!
//! The scale is smoothed, never below [`MIN_SCALE`], and stays 1 until an idle power is
//! known or while the device reports no power: then only time is limited, as before.

use std::collections::VecDeque;

use crate::traits::{Nanos, PowerSample};

/// Lowest scale: however the estimates go wrong, the limit is never cut below a quarter.
pub const MIN_SCALE: f64 = 0.25;
/// Below this busy fraction the power per busy second is too noisy to use.
const MIN_BUSY: f64 = 0.05;
/// Weight of each new target in the smoothed scale (one sample per publish period).
const SMOOTHING: f64 = 0.3;

/// What [`PowerShare`] concluded from the samples so far (for logs and tests).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PowerState {
    /// Average device power over the last window, watts.
    pub watts: f64,
    /// Device busy fraction over the same window (ours, our container's, or NVML's).
    pub busy: f64,
    /// The device's idle power, watts, once measured.
    pub idle_watts: Option<f64>,
    /// Power above idle per busy second, watts (`(watts − idle) / busy`), once known.
    pub busy_watts: Option<f64>,
    /// The enforced power limit, watts.
    pub limit_watts: f64,
    /// The factor applied to the SM limit (1 = time only).
    pub scale: f64,
}

#[derive(Debug, Clone, Copy)]
struct Point {
    sample: PowerSample,
    /// Our measured GPU time so far, ns.
    own_busy: f64,
    /// The container's other processes' busy fraction at the time.
    peers_busy: f64,
    /// Device watts and busy fraction over the window ending at the previous point.
    before: Option<(f64, f64)>,
}

/// Tracks device power against this process's busy time and derives the scale of the limit.
#[derive(Debug, Clone)]
pub struct PowerShare {
    exponent: f64,
    window: Nanos,
    idle_span: Nanos,
    points: VecDeque<Point>,
    /// First point of the current idle run (see `push`).
    idle_since: Option<Point>,
    idle_watts: Option<f64>,
    scale: f64,
    /// Watts and busy fraction of the latest window.
    last_window: Option<(f64, f64)>,
}

impl PowerShare {
    /// A tracker with exponent `k` (0..=1), averaging over `window`, and measuring idle
    /// power over idle spans of at least `idle_span`.
    pub fn new(exponent: f64, window: Nanos, idle_span: Nanos) -> Self {
        Self {
            exponent: exponent.clamp(0.0, 1.0),
            window: window.max(1),
            idle_span: idle_span.max(1),
            points: VecDeque::new(),
            idle_since: None,
            idle_watts: None,
            scale: 1.0,
            last_window: None,
        }
    }

    /// The factor to apply to the limit (1 = time only).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The device's idle power in watts, once measured.
    pub fn idle_watts(&self) -> Option<f64> {
        self.idle_watts
    }

    /// Takes a sample from before any work of ours (the view's baseline).
    pub fn seed(&mut self, sample: PowerSample) {
        if self.points.is_empty() {
            self.push(Point {
                sample,
                own_busy: 0.0,
                peers_busy: 0.0,
                before: None,
            });
        }
    }

    /// Takes a sample with our measured GPU time so far (`own_busy`, ns) and the container
    /// peers' busy fraction; returns the updated state once the window holds enough.
    pub fn update(
        &mut self,
        sample: PowerSample,
        own_busy: f64,
        peers_busy: f64,
    ) -> Option<PowerState> {
        if let Some(last) = self.points.back()
            && (sample.at <= last.sample.at || sample.energy_mj < last.sample.energy_mj)
        {
            // Time must advance and the counter must not go back (a driver reload resets
            // it): start over rather than compute nonsense.
            if sample.energy_mj < last.sample.energy_mj {
                self.points.clear();
                self.idle_since = None;
            } else {
                return None;
            }
        }
        self.push(Point {
            sample,
            own_busy,
            peers_busy,
            before: None,
        });
        self.evaluate()
    }

    fn push(&mut self, mut p: Point) {
        p.before = self.last_window;
        // The reader's own measurement, when it has one, is the latest word.
        if let Some(mw) = p.sample.idle_mw {
            self.idle_watts = Some(mw as f64 / 1000.0);
        }
        // An idle run: its first point, then points with no peer busy and the device
        // reporting no kernel time. Samples are taken only while we launch, so a pause of
        // ours is a gap between two points, and the queued tail of our work may still have
        // run after the first point: that is accounted in `idle_between`.
        if let Some(start) = self.idle_since
            && p.peers_busy <= 0.0
            && p.sample.device_busy.is_none_or(|d| d <= 0.0)
        {
            if let Some(idle) = self.idle_between(&start, &p) {
                self.idle_watts = Some(idle);
            }
        } else {
            self.idle_since = (p.peers_busy <= 0.0).then_some(p);
        }
        self.points.push_back(p);
        // Keep one point at least a window old.
        while self.points.len() > 2 && p.sample.at - self.points[1].sample.at >= self.window {
            self.points.pop_front();
        }
    }

    /// The idle power from `start` to `end` of an idle run: the GPU time of ours measured in
    /// between (the tail of work queued before `start`) ran at the power and duty of the
    /// window before `start`; the rest of the span was idle. `None` when what is left is
    /// shorter than the idle span, or the tail cannot be accounted.
    fn idle_between(&self, start: &Point, end: &Point) -> Option<f64> {
        let span = end.sample.at.saturating_sub(start.sample.at) as f64;
        let joules = end.sample.energy_mj.saturating_sub(start.sample.energy_mj) as f64 / 1000.0;
        let tail_busy = (end.own_busy - start.own_busy).max(0.0);
        let (tail_ns, tail_joules) = if tail_busy <= 0.01 * span {
            (0.0, 0.0)
        } else {
            let (watts, busy) = start.before?;
            if busy < MIN_BUSY {
                return None;
            }
            let wall = (tail_busy / busy).min(span);
            (wall, watts * wall / 1e9)
        };
        let idle_ns = span - tail_ns;
        (idle_ns >= self.idle_span as f64)
            .then(|| ((joules - tail_joules) * 1e9 / idle_ns).max(0.0))
    }

    fn evaluate(&mut self) -> Option<PowerState> {
        let (first, last) = (self.points.front()?, self.points.back()?);
        let span = last.sample.at.saturating_sub(first.sample.at);
        if span < self.window / 2 {
            return None;
        }
        let p = watts(&first.sample, &last.sample);
        let own = ((last.own_busy - first.own_busy) / span as f64).clamp(0.0, 1.0);
        let n = self.points.len() as f64;
        let peers = self.points.iter().map(|q| q.peers_busy).sum::<f64>() / n;
        let device = self
            .points
            .iter()
            .skip(1)
            .filter_map(|q| q.sample.device_busy)
            .fold((0.0, 0u32), |(s, c), d| (s + d.clamp(0.0, 1.0), c + 1));
        let device = if device.1 > 0 {
            device.0 / f64::from(device.1)
        } else {
            0.0
        };
        let busy = (own + peers).max(device).min(1.0);
        self.last_window = Some((p, busy));
        let limit = last.sample.limit_mw as f64 / 1000.0;
        let mut state = PowerState {
            watts: p,
            busy,
            idle_watts: self.idle_watts,
            busy_watts: None,
            limit_watts: limit,
            scale: self.scale,
        };
        let Some(idle) = self.idle_watts else {
            return Some(state);
        };
        if busy < MIN_BUSY || limit <= idle {
            return Some(state);
        }
        let e = (p - idle) / busy;
        state.busy_watts = Some(e);
        let target = if e > 0.0 && idle + e > limit {
            ((limit - idle) / e)
                .powf(self.exponent)
                .clamp(MIN_SCALE, 1.0)
        } else {
            1.0
        };
        self.scale += SMOOTHING * (target - self.scale);
        if (self.scale - 1.0).abs() < 0.005 {
            self.scale = 1.0;
        }
        state.scale = self.scale;
        Some(state)
    }
}

/// Average watts between two samples (mJ per ms).
fn watts(a: &PowerSample, b: &PowerSample) -> f64 {
    let ns = b.at.saturating_sub(a.at).max(1) as f64;
    b.energy_mj.saturating_sub(a.energy_mj) as f64 * 1e6 / ns
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn sample(at_ms: u64, energy_j: f64, busy: Option<f64>) -> PowerSample {
        PowerSample {
            at: at_ms * MS,
            energy_mj: (energy_j * 1000.0) as u64,
            limit_mw: 700_000,
            device_busy: busy,
            idle_mw: None,
        }
    }

    /// Feeds a steady state: `watts` at busy fraction `d`, every 100 ms for `secs`, after
    /// `idle_ms` of idle at `idle_w`. Returns the final state.
    fn steady(
        idle_w: f64,
        idle_ms: u64,
        watts: f64,
        d: f64,
        secs: u64,
        k: f64,
    ) -> (PowerShare, PowerState) {
        let mut ps = PowerShare::new(k, 1000 * MS, 200 * MS);
        let mut e = 1000.0;
        ps.seed(sample(0, e, Some(0.0)));
        e += idle_w * idle_ms as f64 / 1000.0;
        // The first sample comes at the first launch: nothing has run yet.
        let mut last = ps.update(sample(idle_ms, e, Some(0.0)), 0.0, 0.0);
        let mut t = idle_ms + 100;
        e += watts * 0.1;
        let mut busy_ns = d * 100.0 * MS as f64;
        for _ in 0..secs * 10 {
            let st = ps.update(sample(t, e, Some(d)), busy_ns, 0.0);
            last = st.or(last);
            t += 100;
            e += watts * 0.1;
            busy_ns += d * 100.0 * MS as f64;
        }
        (ps, last.expect("a state"))
    }

    #[test]
    fn idle_power_comes_from_the_span_before_the_first_launch() {
        let (ps, st) = steady(125.0, 400, 400.0, 0.4, 3, 0.5);
        assert!((ps.idle_watts().unwrap() - 125.0).abs() < 1.0, "{st:?}");
        // Too short a span measures nothing: time only.
        let (ps, st) = steady(125.0, 150, 600.0, 0.5, 3, 0.5);
        assert_eq!(ps.idle_watts(), None);
        assert_eq!(st.scale, 1.0);
    }

    #[test]
    fn work_that_would_not_be_capped_keeps_the_time_share() {
        // A compute loop: 125 W idle, +350 W per busy second: 475 W flat out < 700 W.
        let (_, st) = steady(125.0, 500, 125.0 + 0.5 * 350.0, 0.5, 5, 0.5);
        assert!((st.busy_watts.unwrap() - 350.0).abs() < 5.0, "{st:?}");
        assert_eq!(st.scale, 1.0);
    }

    #[test]
    fn capped_work_is_scaled_by_the_power_budget_to_the_exponent() {
        // The H200 matmul: +800 W per busy second at full clock; budget 575 W.
        for (k, want) in [
            (0.5, (575.0f64 / 800.0).sqrt()),
            (1.0, 575.0 / 800.0),
            (0.0, 1.0),
        ] {
            let (_, st) = steady(125.0, 500, 125.0 + 0.4 * 800.0, 0.4, 6, k);
            assert!((st.scale - want).abs() < 0.01, "k={k}: {st:?} want {want}");
        }
    }

    #[test]
    fn the_device_busy_fraction_counts_when_higher_than_ours() {
        // Another container keeps the GPU 90% busy at the cap: our 20% is not what draws
        // the power, and flat out the GPU draws what it draws now: no scaling.
        let mut ps = PowerShare::new(0.5, 1000 * MS, 200 * MS);
        ps.seed(sample(0, 0.0, Some(0.0)));
        let mut e = 125.0 * 0.5;
        let mut busy = 0.0;
        let mut st = None;
        for i in 0..40 {
            st = ps
                .update(sample(500 + 100 * i, e, Some(0.9)), busy, 0.0)
                .or(st);
            e += 0.1 * 680.0;
            busy += 0.2 * 100.0 * MS as f64;
        }
        let st = st.unwrap();
        assert!((st.busy - 0.9).abs() < 0.01, "{st:?}");
        assert!(st.scale > 0.95, "{st:?}");
    }

    #[test]
    fn a_counter_that_goes_back_starts_over_and_never_panics() {
        let mut ps = PowerShare::new(0.5, 1000 * MS, 200 * MS);
        ps.seed(sample(0, 50.0, Some(0.0)));
        assert_eq!(ps.update(sample(100, 40.0, None), 0.0, 0.0), None);
        assert_eq!(
            ps.update(sample(100, 40.0, None), 0.0, 0.0),
            None,
            "same time"
        );
        assert_eq!(
            ps.update(sample(50, 45.0, None), 0.0, 0.0),
            None,
            "time going back"
        );
        assert_eq!(ps.scale(), 1.0);
    }

    #[test]
    fn counter_steps_of_100_ms_average_out() {
        // The H200's counter advances every 100 ms; samples fall between steps.
        let mut ps = PowerShare::new(0.5, 1000 * MS, 200 * MS);
        let energy_at = |t_ms: u64| {
            let step = t_ms / 100 * 100;
            let j = if step <= 500 {
                125.0 * step as f64 / 1000.0
            } else {
                62.5 + 445.0 * (step - 500) as f64 / 1000.0
            };
            (j * 1000.0) as u64
        };
        let at = |t: u64| PowerSample {
            at: t * MS,
            energy_mj: energy_at(t),
            limit_mw: 700_000,
            device_busy: None,
            idle_mw: None,
        };
        ps.seed(at(37));
        let mut st = ps.update(at(500), 0.0, 0.0);
        for i in 0..60 {
            let t = 537 + 100 * i;
            let busy = 0.4 * (t - 500) as f64 * MS as f64;
            st = ps.update(at(t), busy, 0.0).or(st);
        }
        let st = st.unwrap();
        // 445 W at 40% busy over 125 W idle: 800 W per busy second. The idle span of 463 ms
        // saw 5 steps (500 ms of energy): idle reads 8% high, which the scale barely feels.
        assert!((st.busy_watts.unwrap() - 800.0).abs() < 40.0, "{st:?}");
        assert!(
            (ps.scale() - (575.0f64 / 800.0).sqrt()).abs() < 0.02,
            "{st:?}"
        );
    }

    #[test]
    fn the_readers_idle_measurement_is_taken_as_is() {
        // No idle span at all (launches from the first instant), but the reader saw the
        // device idle for a second before: its reading sets the idle power.
        let mut ps = PowerShare::new(0.5, 1000 * MS, 200 * MS);
        let mut e = 0.0;
        let mut st = None;
        for i in 0..40u64 {
            let mut s = sample(100 * i, e, Some(0.4));
            s.idle_mw = Some(125_000);
            st = ps.update(s, 0.4 * (100 * i) as f64 * MS as f64, 0.0).or(st);
            e += 0.1 * (125.0 + 0.4 * 800.0);
        }
        let st = st.unwrap();
        assert_eq!(st.idle_watts, Some(125.0));
        assert!(
            (ps.scale() - (575.0f64 / 800.0).sqrt()).abs() < 0.02,
            "{st:?}"
        );
    }
}
