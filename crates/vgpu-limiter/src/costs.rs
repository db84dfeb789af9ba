//! What a launch costs: the GPU time of each kind of launch, learned from samples.
//!
//! **Model.** A container's GPU time is the time its kernels execute. A span between two
//! markers on a stream measures more than that whenever something else falls between them:
//! a host gap in which the stream ran dry (the GPU was idle, or ran another context), or a
//! time slice the GPU gave another context while ours still had work (at slice expiry the
//! running kernel is preempted). So spans are not charged. Each launch is charged the
//! learned cost of its *identity* (the function with its grid, block and shared memory, or
//! the graph), and identities are measured now and then by a *sample*: one launch bracketed
//! alone by a start and an end marker.
//!
//! A sample is exact but for two things, each handled here:
//! - **Preemption** makes a sample long by another context's slice (milliseconds against a
//!   kernel's microseconds): such an *outlier* is kept out of the identity's window unless
//!   it keeps coming (the work changed), and the estimate is the median of the window, which
//!   follows the clock (a kernel's time moves by ~10% as the GPU's power management moves
//!   its clock; the smallest sample would undercharge by that).
//! - **Submission latency**: a start marker recorded on an idle stream completes at once, and
//!   the kernel behind it starts only when the launch call has handed it to the GPU, a few
//!   microseconds later. A sample taken behind queued work ("chained": the start marker is the
//!   previous work's end) has none. Identities seen both ways give the process's latency
//!   (the difference of their medians, averaged), which is taken off samples from an idle
//!   stream (never more than half of one).
//!
//! Charging a learned cost per launch makes the charge independent of what the other
//! contexts do, of host gaps and of how launches are grouped for completion tracking.

use std::collections::HashMap;

/// A launch's identity: equal for launches that do the same work (the hook hashes the
/// function with its launch geometry, or the graph).
pub type LaunchId = u64;

/// Samples kept per identity; the estimate is their median.
const SAMPLES: usize = 4;
/// Identities remembered; the least recently used goes first. A training or serving loop
/// launches a few hundred to a few thousand distinct kernels.
const MAX_IDS: usize = 4096;
/// An identity is sampled again once this many of its launches went unsampled, so that its
/// window follows the clock (the GPU's power management) within a few samples.
const RESAMPLE_AFTER: u32 = 32;
/// A due sample is taken at one launch in this many, picked at random.
const SAMPLE_ODDS: u64 = 4;
/// Longest submission latency believed (the launch call's host time is a few µs).
const MAX_LATENCY: f64 = 20_000.0;
/// A sample longer than the estimate by more than half the estimate, and by more than this,
/// is an *outlier*: a context switch (0.15 ms on the H200) or another context's time slice
/// (2.09 ms) fell inside it. No change of the clock (about ±10%) moves a kernel that far.
const OUTLIER_BY: f64 = 100_000.0;
/// Outliers in a row after which they are believed (the work really changed).
const OUTLIERS_BELIEVED: u32 = 16;

#[derive(Debug, Clone)]
struct Entry {
    /// Recent samples from behind queued work (exact but for preemption), ns.
    chained: Ring,
    /// Recent samples from an idle stream (plus the submission latency), ns.
    fresh: Ring,
    /// Launches since the last sample.
    unsampled: u32,
    /// Outlier samples in a row, not yet believed.
    outliers: u32,
    /// Use stamp for eviction.
    used: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Ring {
    v: [f64; SAMPLES],
    n: usize,
    next: usize,
}

impl Ring {
    fn push(&mut self, x: f64) {
        self.v[self.next] = x;
        self.next = (self.next + 1) % SAMPLES;
        self.n = (self.n + 1).min(SAMPLES);
    }

    /// The lower median of the samples kept: robust to one inflated sample in the window,
    /// and close to the typical sample (the smallest would undercharge by the clock's
    /// variation).
    fn median(&self) -> Option<f64> {
        let mut v = self.v;
        let v = &mut v[..self.n];
        v.sort_unstable_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[(v.len() - 1) / 2])
    }
}

/// Per-identity GPU time estimates of one process on one device.
#[derive(Debug, Default)]
pub struct CostTable {
    ids: HashMap<LaunchId, Entry>,
    /// The process's submission latency, when identities sampled both ways tell it.
    latency: Option<f64>,
    stamp: u64,
    /// State of the generator that picks which launches are sampled.
    rng: u64,
    /// Sum and count of the estimates handed out, for launches of unknown identity.
    mean_sum: f64,
    mean_n: f64,
}

impl CostTable {
    /// The learned GPU time of a launch of `id`, ns.
    pub fn cost(&self, id: LaunchId) -> Option<f64> {
        let e = self.ids.get(&id)?;
        self.estimate(e)
    }

    /// What to charge a launch of `id` now: its cost, or the mean cost of launches so far
    /// when it is unknown (`None` before anything is known).
    pub fn charge(&mut self, id: LaunchId) -> Option<f64> {
        self.stamp += 1;
        let stamp = self.stamp;
        let known = self.ids.get_mut(&id).map(|e| {
            e.used = stamp;
            e.unsampled = e.unsampled.saturating_add(1);
        });
        let c = known.and_then(|()| self.cost(id));
        if let Some(c) = c {
            // A slowly forgetting mean: the fallback follows the current mix of launches.
            self.mean_sum = 0.999 * self.mean_sum + c;
            self.mean_n = 0.999 * self.mean_n + 1.0;
            return Some(c);
        }
        self.mean()
    }

    /// The mean cost of the launches charged lately, if any was known.
    pub fn mean(&self) -> Option<f64> {
        (self.mean_n > 0.0).then(|| self.mean_sum / self.mean_n)
    }

    /// Whether this launch of `id` should be sampled: the first one, then until its window is
    /// full (so that one clean sample is likely among them) and again after 32 unsampled
    /// launches, each time at a launch picked at random (one in 4): a sample then meets other
    /// contexts' time slices at random, not in step with our own bursts (a kernel that always
    /// ends a burst is always preempted).
    pub fn wants_sample(&mut self, id: LaunchId) -> bool {
        let due = match self.ids.get(&id) {
            None => return true,
            Some(e) => e.chained.n + e.fresh.n < SAMPLES || e.unsampled >= RESAMPLE_AFTER,
        };
        // xorshift64: cheap, deterministic for the tests.
        let mut x = self.rng.max(1);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        due && x % SAMPLE_ODDS == 0
    }

    /// Whether anything is known yet.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The process's submission latency as learned, ns.
    pub fn latency(&self) -> Option<f64> {
        self.latency
    }

    /// Records a sample of `id`: `span` ns between its markers, `chained` when the start
    /// marker was the end of work still queued (no submission latency in the span).
    pub fn sample(&mut self, id: LaunchId, span: f64, chained: bool) {
        if !span.is_finite() || span < 0.0 {
            return;
        }
        if !self.ids.contains_key(&id) && self.ids.len() >= MAX_IDS {
            self.evict();
        }
        self.stamp += 1;
        let stamp = self.stamp;
        let e = self.ids.entry(id).or_insert_with(|| Entry {
            chained: Ring::default(),
            fresh: Ring::default(),
            unsampled: 0,
            outliers: 0,
            used: stamp,
        });
        e.unsampled = 0;
        e.used = stamp;
        // A slice of another context inside a sample can recur for an identity whose launches
        // keep meeting the same moment of the other's schedule: outliers wait for several in
        // a row before they enter the window.
        let est = estimate_of(e, self.latency);
        if let Some(est) = est
            && span > est + (est / 2.0).max(OUTLIER_BY)
        {
            e.outliers += 1;
            if e.outliers <= OUTLIERS_BELIEVED {
                return;
            }
            // The work changed: what was learned before no longer holds.
            e.chained = Ring::default();
            e.fresh = Ring::default();
        }
        e.outliers = 0;
        match chained {
            true => e.chained.push(span),
            false => e.fresh.push(span),
        }
        // Both windows' medians are clean, so their difference is the latency; one that is
        // negative or too large means a window holds preempted samples yet.
        if let (Some(c), Some(f)) = (e.chained.median(), e.fresh.median())
            && (0.0..=MAX_LATENCY).contains(&(f - c))
        {
            let l = f - c;
            self.latency = Some(self.latency.map_or(l, |old| 0.9 * old + 0.1 * l));
        }
    }

    /// The lower median of the window's samples, those from an idle stream less the
    /// latency: robust to one inflated sample of either kind (only preemption inflates a
    /// sample behind queued work, and the outlier rule keeps most of that out; beside busy
    /// contexts an idle stream's sample can also hold another context's kernel, tens of µs,
    /// which the outlier rule does not see) and close to the typical sample (the smallest
    /// would undercharge by the clock's variation, about 10%).
    fn estimate(&self, e: &Entry) -> Option<f64> {
        estimate_of(e, self.latency)
    }

    fn evict(&mut self) {
        if let Some((&id, _)) = self.ids.iter().min_by_key(|(_, e)| e.used) {
            self.ids.remove(&id);
        }
    }
}

/// [`CostTable::estimate`] of one entry.
fn estimate_of(e: &Entry, latency: Option<f64>) -> Option<f64> {
    let latency = latency.unwrap_or(0.0);
    let mut v = [0.0; 2 * SAMPLES];
    let mut n = 0;
    for &c in &e.chained.v[..e.chained.n] {
        v[n] = c;
        n += 1;
    }
    for &f in &e.fresh.v[..e.fresh.n] {
        v[n] = (f - latency).max(f / 2.0);
        n += 1;
    }
    let v = &mut v[..n];
    v.sort_unstable_by(f64::total_cmp);
    (n > 0).then(|| v[(n - 1) / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cost_is_the_median_of_recent_samples_and_a_preempted_one_is_kept_out() {
        let mut t = CostTable::default();
        t.sample(1, 100_000.0, true);
        t.sample(1, 2_300_000.0, true); // waited a whole slice of another context
        assert_eq!(t.cost(1), Some(100_000.0));
        t.sample(1, 90_000.0, true);
        t.sample(1, 110_000.0, true);
        assert_eq!(t.cost(1), Some(100_000.0), "the median of 90, 100 and 110");
        t.sample(1, 120_000.0, true);
        assert_eq!(
            t.cost(1),
            Some(100_000.0),
            "the lower median of 90, 100, 110 and 120"
        );
        // A real slowdown (the clock went down) shows in every sample: after a window of
        // them the estimate follows.
        for _ in 0..SAMPLES {
            t.sample(1, 130_000.0, true);
        }
        assert_eq!(t.cost(1), Some(130_000.0));
    }

    #[test]
    fn outliers_enter_the_window_only_when_they_keep_coming() {
        let mut t = CostTable::default();
        t.sample(1, 150_000.0, true);
        for _ in 0..SAMPLES + 2 {
            t.sample(1, 2_540_000.0, true); // every sample met the other's slice
        }
        assert_eq!(t.cost(1), Some(150_000.0));
        assert_eq!(t.cost(1), Some(150_000.0), "not yet");
        for _ in 0..OUTLIERS_BELIEVED {
            t.sample(1, 2_540_000.0, true);
        }
        assert_eq!(t.cost(1), Some(2_540_000.0), "the work changed after all");
    }

    #[test]
    fn the_submission_latency_is_learned_from_identities_sampled_both_ways() {
        let mut t = CostTable::default();
        t.sample(1, 20_000.0, true);
        t.sample(1, 24_000.0, false); // from an idle stream: 4 µs of latency
        assert_eq!(t.latency(), Some(4_000.0));
        t.sample(2, 14_000.0, false); // only ever from an idle stream
        assert_eq!(t.cost(2), Some(10_000.0));
        // Never more than half a sample is taken off.
        t.sample(3, 5_000.0, false);
        assert_eq!(t.cost(3), Some(2_500.0));
    }

    #[test]
    fn unknown_identities_are_charged_the_mean_and_asked_for_a_sample() {
        let mut t = CostTable::default();
        assert!(t.wants_sample(9));
        assert_eq!(t.charge(9), None);
        t.sample(1, 100.0, true);
        t.sample(2, 300.0, true);
        assert_eq!(t.charge(1), Some(100.0));
        assert_eq!(t.charge(2), Some(300.0));
        let m = t.charge(9).unwrap();
        assert!((m - 200.0).abs() < 1.0, "{m}");
        let picked = |t: &mut CostTable| (0..64).filter(|_| t.wants_sample(1)).count();
        assert!(picked(&mut t) > 0, "until its window is full");
        for _ in 1..SAMPLES {
            t.sample(1, 100.0, true);
        }
        assert_eq!(picked(&mut t), 0);
        for _ in 0..RESAMPLE_AFTER {
            t.charge(1);
        }
        let n = picked(&mut t);
        assert!(
            (4..=32).contains(&n),
            "resampled now and then, at random launches: {n} of 64"
        );
    }

    #[test]
    fn the_table_is_bounded_and_forgets_the_least_recently_used() {
        let mut t = CostTable::default();
        for id in 0..(MAX_IDS as u64 + 10) {
            t.sample(id, 1_000.0, true);
        }
        assert_eq!(t.ids.len(), MAX_IDS);
        assert!(t.cost(0).is_none() && t.cost(MAX_IDS as u64 + 9).is_some());
    }

    #[test]
    fn nonsense_samples_are_ignored() {
        let mut t = CostTable::default();
        t.sample(1, f64::NAN, true);
        t.sample(1, -5.0, true);
        t.sample(1, f64::INFINITY, true);
        assert!(t.cost(1).is_none());
    }
}
