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
//! - **Submission latency**: a start marker the GPU reaches before the launch call has handed
//!   the kernel over (an idle stream, or queued work that ran out during the call) completes
//!   early, and the span holds up to the call's few microseconds, or another context's slice
//!   if the GPU switched away meanwhile. A sample behind a *gate* (the segments queue its start
//!   marker behind a stream wait they release once the launch and its end marker are queued:
//!   [`crate::GpuTimer::gate`]) has none, nor does one whose start marker was still pending
//!   when the call returned; both are *clean*. Only an identity's first launch is sampled
//!   ungated; identities seen both ways give the process's latency (the difference of their
//!   medians, averaged), which is taken off the others (never more than half of one).
//!
//! - **The bracket's drain**: an end marker is stamped only once the work ahead of it has
//!   drained, which back-to-back kernels overlap with their neighbours' launches, so a
//!   bracket adds a few microseconds to what it measures, once per bracket (as much as a
//!   small-batch convnet's kernel takes). A *back-to-back segment* (launches that were all
//!   queued before the GPU reached its start marker, so no host gap falls inside) measures
//!   its launches' time plus one drain, where their samples hold one drain each: the drain is
//!   (Σ samples − span) / (launches − 1), and the estimate of a launch is its sample less the
//!   drain (never less than half of it). Another context's slice inside such a segment makes
//!   that figure low; the median of recent ones keeps it out.
//!
//! Charging a learned cost per launch makes the charge independent of what the other
//! contexts do, of host gaps and of how launches are grouped for completion tracking.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A launch's identity: equal for launches that do the same work (the hook hashes the
/// function with its launch geometry, or the graph).
pub type LaunchId = u64;

/// The cost table's hasher: a launch identity is already a hash of what tells launches
/// apart, so its bits index the table as they are (SipHash would cost the launch path more
/// than the lookup).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is reached for a `LaunchId`; any other key is folded in.
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }
}

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
/// Resamples a process takes per second at most (filling a new identity's window is a
/// one-time cost, not rationed). On a real workload markers cost far more than their driver
/// calls: on the H200 a host-bound PyTorch pair whose processes took 700–1,100 samples a
/// second each made 4–11 points less of its alone throughput than the same pair with no
/// markers at all, which matched plain time slicing (docs/sm-limit.md). So measuring is
/// rationed in time. The floor is the submission latency, learned from resamples
/// (identities seen both ways): in the model's loop of 4–20 µs kernels, 150 a second left it
/// unlearned and the loop got 17.2% at a cap of 20; 200 learn it.
const SAMPLES_PER_SECOND: f64 = 200.0;
/// Samples the ration holds at most: a new loop's windows fill within a few seconds.
const SAMPLE_BURST: f64 = 200.0;
/// Timed ordinary segments per second at most (the others are completion-only: see
/// `control::segments`). Their spans give the bracket's drain (the median of the last
/// `DRAINS`) and bound their own charges; a timing marker costs the GPU about 2 µs and its
/// record the host about 3 µs on the H200, so this many cost each under 0.1%, as the samples
/// do, and the drain's window turns over in a tenth of a second.
const SPANS_PER_SECOND: f64 = 200.0;
/// Timed ordinary segments the ration holds at most.
const SPAN_BURST: f64 = 200.0;
/// Longest submission latency believed (the launch call's host time is a few µs).
const MAX_LATENCY: f64 = 20_000.0;
/// A sample longer than the estimate by more than half the estimate, and by more than this,
/// is an *outlier*: a context switch (0.15 ms on the H200) or another context's time slice
/// (2.09 ms) fell inside it. No change of the clock (about ±10%) moves a kernel that far.
const OUTLIER_BY: f64 = 100_000.0;
/// Outliers in a row after which they are believed (the work really changed).
const OUTLIERS_BELIEVED: u32 = 16;
/// Back-to-back segments whose drain figures are kept; the drain is their median. A few
/// hundred segments settle per second, so it follows within a tenth of a second.
const DRAINS: usize = 16;

#[derive(Debug, Clone)]
struct Entry {
    /// Recent clean samples (exact but for preemption and the drain), ns.
    chained: Ring<SAMPLES>,
    /// Recent samples whose span may hold part of the submission latency, ns.
    fresh: Ring<SAMPLES>,
    /// Launches since the last sample.
    unsampled: u32,
    /// Outlier samples in a row, not yet believed.
    outliers: u32,
    /// The estimate of the windows as they are, and the latency it was computed with (the
    /// launch path reads it two or three times per launch; it changes only with a sample or
    /// the latency).
    cached: Option<(f64, Option<u64>)>,
    /// Use stamp for eviction.
    used: u64,
    /// Launches charged, for [`CostTable::profile`].
    launches: u64,
}

#[derive(Debug, Clone, Copy)]
struct Ring<const N: usize> {
    v: [f64; N],
    n: usize,
    next: usize,
}

impl<const N: usize> Default for Ring<N> {
    fn default() -> Self {
        Self {
            v: [0.0; N],
            n: 0,
            next: 0,
        }
    }
}

impl<const N: usize> Ring<N> {
    fn push(&mut self, x: f64) {
        self.v[self.next] = x;
        self.next = (self.next + 1) % N;
        self.n = (self.n + 1).min(N);
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

/// A ration in time: `per_second` refills, at most `burst` held, full at first.
#[derive(Debug, Default, Clone, Copy)]
struct Ration {
    left: f64,
    /// When it was last refilled (`None`: never, full).
    at: Option<crate::Nanos>,
}

impl Ration {
    /// Takes one if one is left.
    fn take(&mut self, now: crate::Nanos, per_second: f64, burst: f64) -> bool {
        let refill = match self.at {
            None => burst,
            Some(at) => now.saturating_sub(at) as f64 * per_second / 1e9,
        };
        self.left = (self.left + refill).min(burst);
        self.at = Some(now);
        if self.left >= 1.0 {
            self.left -= 1.0;
            return true;
        }
        false
    }
}

/// Per-identity GPU time estimates of one process on one device.
#[derive(Debug, Default)]
pub struct CostTable {
    ids: HashMap<LaunchId, Entry, BuildHasherDefault<IdHasher>>,
    /// The process's submission latency, when identities sampled both ways tell it.
    latency: Option<f64>,
    stamp: u64,
    /// State of the generator that picks which launches are sampled.
    rng: u64,
    /// The sample ration.
    ration: Ration,
    /// The ration of timed ordinary segments.
    spans: Ration,
    /// Sum and count of the estimates handed out, for launches of unknown identity.
    mean_sum: f64,
    mean_n: f64,
    /// Samples taken so far: behind queued work, from an idle stream, kept out as outliers.
    taken: [u64; 3],
    /// Recent back-to-back segments' figures of the bracket's drain, ns.
    drains: Ring<DRAINS>,
    /// The bracket's drain: their median, at least 0.
    drain: f64,
}

/// What a launch is charged: its learned cost, and the sample figure it came from (the
/// cost plus the bracket's drain), which back-to-back segments compare with their span.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Charge {
    /// The launch's learned cost, ns.
    pub cost: f64,
    /// The sample figure behind it (the cost plus a bracket's drain), ns.
    pub sampled: f64,
}

/// What the launch path needs of an identity, from one lookup ([`CostTable::quote`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Quote {
    /// What the launch is charged: its cost, or the mean cost of launches so far when its
    /// identity is unknown (`None` before anything is known).
    pub charge: Option<Charge>,
    /// Whether its identity has been sampled.
    pub known: bool,
    /// Whether this launch should be sampled (the rule is [`CostTable::quote`]'s).
    pub sample_due: bool,
}

/// What the table holds, for the limiter's report at exit: how its launches would be charged
/// by the estimate and by the smallest sample of each identity (the gap between the two is
/// what contention and submission latency add to samples).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostProfile {
    /// Identities known.
    pub ids: usize,
    /// Clean samples taken (no submission latency in their span).
    pub chained: u64,
    /// Samples whose span may hold part of the submission latency.
    pub fresh: u64,
    /// Samples kept out as outliers.
    pub outliers: u64,
    /// The learned submission latency, ns.
    pub latency: Option<f64>,
    /// The learned drain of a bracket, ns.
    pub drain: f64,
    /// The launches of the known identities, charged at their estimate, ns.
    pub by_estimate: f64,
    /// The same launches charged at each identity's smallest sample kept, ns.
    pub by_smallest: f64,
}

/// One identity as the table holds it, for the limiter's report at exit (the heaviest by
/// charged time): whether its samples agree, or a few long ones set its estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct IdentityReport {
    /// The identity.
    pub id: LaunchId,
    /// Launches charged.
    pub launches: u64,
    /// Its learned cost (the estimate less the drain), ns.
    pub cost: f64,
    /// Its clean samples, ns, oldest first within the window's order.
    pub chained: Vec<f64>,
    /// Its samples whose span may hold the submission latency, ns.
    pub fresh: Vec<f64>,
    /// Outliers in a row not yet believed.
    pub outliers: u32,
}

impl CostTable {
    /// The learned GPU time of a launch of `id`, ns.
    pub fn cost(&self, id: LaunchId) -> Option<f64> {
        let e = self.ids.get(&id)?;
        self.estimate(e).map(|sampled| self.less_drain(sampled))
    }

    /// A sample figure less the bracket's drain, never less than half of it.
    fn less_drain(&self, sampled: f64) -> f64 {
        (sampled - self.drain).max(sampled / 2.0)
    }

    /// What a launch of `id` would be charged now, whether its identity is known and
    /// whether it is to be sampled: one lookup, nothing counted (an admission that waits asks
    /// again). [`Self::count`] counts the launch once it goes.
    ///
    /// Sampled are an identity's first launch, then launches until its window is full (so
    /// that one clean sample is likely among them), and again after `RESAMPLE_AFTER`
    /// unsampled launches while the ration lasts (`SAMPLES_PER_SECOND`), each time at a
    /// launch picked at random (one in 4): a sample then meets other contexts' time slices at
    /// random, not in step with our own bursts (a kernel that always ends a burst is always
    /// preempted).
    pub fn quote(&mut self, id: LaunchId, now: crate::Nanos) -> Quote {
        let latency = self.latency;
        let key = latency.map(f64::to_bits);
        // An unknown identity is always due; a known one at a launch picked at random (a
        // resample only while the ration lasts).
        let (known, sampled, due) = match self.ids.get_mut(&id) {
            None => (false, None, None),
            Some(e) => {
                let sampled = match e.cached {
                    Some((est, k)) if k == key => Some(est),
                    _ => {
                        let est = estimate_of(e, latency);
                        e.cached = est.map(|est| (est, key));
                        est
                    }
                };
                // Filling a new identity's window is a one-time cost; resampling is rationed.
                let filling = e.chained.n + e.fresh.n < SAMPLES;
                (
                    true,
                    sampled,
                    Some((filling, e.unsampled >= RESAMPLE_AFTER)),
                )
            }
        };
        let charge = match sampled {
            Some(sampled) => Some(Charge {
                cost: self.less_drain(sampled),
                sampled,
            }),
            None => self.mean().map(|cost| Charge {
                cost,
                sampled: cost,
            }),
        };
        Quote {
            charge,
            known,
            sample_due: due.is_none_or(|(filling, resample)| {
                self.pick_sample(filling || resample) && (filling || self.take_ration(now))
            }),
        }
    }

    /// Counts a launch of `id` that goes with `quote` (its identity's use and launches, and
    /// the mean cost the unknown ones are charged).
    pub fn count(&mut self, id: LaunchId, quote: &Quote) {
        self.stamp += 1;
        let stamp = self.stamp;
        if let Some(e) = self.ids.get_mut(&id) {
            e.used = stamp;
            e.unsampled = e.unsampled.saturating_add(1);
            e.launches += 1;
        }
        if let (true, Some(c)) = (quote.known, quote.charge) {
            // A slowly forgetting mean: the fallback follows the current mix of launches.
            self.mean_sum = 0.999 * self.mean_sum + c.cost;
            self.mean_n = 0.999 * self.mean_n + 1.0;
        }
    }

    /// What to charge a launch of `id` now, counted as launched ([`Self::quote`] then
    /// [`Self::count`]; the tests' shorthand).
    #[cfg(test)]
    pub fn charge(&mut self, id: LaunchId) -> Option<Charge> {
        let (rng, ration) = (self.rng, self.ration);
        let q = self.quote(id, ration.at.unwrap_or(0));
        // Charging picks no sample: the generator and the ration are left as they were.
        (self.rng, self.ration) = (rng, ration);
        self.count(id, &q);
        q.charge
    }

    /// A back-to-back segment settled: `launches` launches whose sample figures add up to
    /// `sampled` took `span` ns between its markers.
    pub fn back_to_back(&mut self, sampled: f64, span: f64, launches: u32) {
        if launches < 2 || !sampled.is_finite() || !span.is_finite() {
            return;
        }
        self.drains.push((sampled - span) / f64::from(launches - 1));
        self.drain = self.drains.median().unwrap_or(0.0).max(0.0);
    }

    /// What a back-to-back segment whose launches were charged `charged` is charged, given
    /// its `span`: every launch of it was queued before the GPU reached its start marker, so
    /// all of them ran inside the span, which (less the end marker's drain, charged on its
    /// own) bounds their GPU time from above, as their costs do. The tighter bound is charged:
    /// costs learned from samples can be high in the flow (each sample pays a bracket's ramp
    /// and drain, which the learned drain may not cover for every kind of kernel), and the
    /// span cannot be low, whatever else ran inside it (another context's slice makes it
    /// long, and the costs are charged then).
    pub fn within_span(&self, charged: f64, span: f64) -> f64 {
        if !span.is_finite() {
            return charged;
        }
        charged.min((span - self.drain).max(0.0))
    }

    /// The mean cost of the launches charged lately, if any was known.
    pub fn mean(&self) -> Option<f64> {
        (self.mean_n > 0.0).then(|| self.mean_sum / self.mean_n)
    }

    /// Whether this launch of `id` should be sampled ([`Self::quote`]; the tests' shorthand).
    #[cfg(test)]
    pub fn wants_sample(&mut self, id: LaunchId, now: crate::Nanos) -> bool {
        self.quote(id, now).sample_due
    }

    /// Takes one sample from the ration (refilled at `SAMPLES_PER_SECOND`), if one is left.
    fn take_ration(&mut self, now: crate::Nanos) -> bool {
        self.ration.take(now, SAMPLES_PER_SECOND, SAMPLE_BURST)
    }

    /// Whether the next ordinary segment is timed: one from the span ration
    /// (`SPANS_PER_SECOND`), if one is left.
    pub fn take_span(&mut self, now: crate::Nanos) -> bool {
        self.spans.take(now, SPANS_PER_SECOND, SPAN_BURST)
    }

    /// One draw of the sample picker: `due` at one launch in `SAMPLE_ODDS`.
    fn pick_sample(&mut self, due: bool) -> bool {
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

    /// The drain a bracket adds, as learned, ns.
    pub fn drain(&self) -> f64 {
        self.drain
    }

    /// The process's submission latency as learned, ns.
    pub fn latency(&self) -> Option<f64> {
        self.latency
    }

    /// Records a sample of `id`: `span` ns between its markers, `chained` when it is clean
    /// (no submission latency in the span).
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
            cached: None,
            used: stamp,
            launches: 0,
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
                self.taken[2] += 1;
                return;
            }
            // The work changed: what was learned before no longer holds.
            e.cached = None;
            e.chained = Ring::default();
            e.fresh = Ring::default();
        }
        e.outliers = 0;
        e.cached = None;
        self.taken[usize::from(!chained)] += 1;
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

    /// The lower median of the window's samples (the drain not taken off), those from an
    /// idle stream less the latency: robust to one inflated sample of either kind (only preemption inflates a
    /// sample behind queued work, and the outlier rule keeps most of that out; beside busy
    /// contexts an idle stream's sample can also hold another context's kernel, tens of µs,
    /// which the outlier rule does not see) and close to the typical sample (the smallest
    /// would undercharge by the clock's variation, about 10%).
    fn estimate(&self, e: &Entry) -> Option<f64> {
        match e.cached {
            Some((est, k)) if k == self.latency.map(f64::to_bits) => Some(est),
            _ => estimate_of(e, self.latency),
        }
    }

    /// What the table holds now (see [`CostProfile`]).
    pub fn profile(&self) -> CostProfile {
        let latency = self.latency.unwrap_or(0.0);
        let mut p = CostProfile {
            ids: self.ids.len(),
            chained: self.taken[0],
            fresh: self.taken[1],
            outliers: self.taken[2],
            latency: self.latency,
            drain: self.drain,
            ..CostProfile::default()
        };
        for e in self.ids.values() {
            let Some(est) = estimate_of(e, self.latency) else {
                continue;
            };
            let smallest = e.chained.v[..e.chained.n]
                .iter()
                .copied()
                .chain(
                    e.fresh.v[..e.fresh.n]
                        .iter()
                        .map(|&f| (f - latency).max(f / 2.0)),
                )
                .fold(est, f64::min);
            p.by_estimate += e.launches as f64 * self.less_drain(est);
            p.by_smallest += e.launches as f64 * self.less_drain(smallest);
        }
        p
    }

    /// The `n` identities that were charged the most time (launches × cost), heaviest first.
    pub fn heaviest(&self, n: usize) -> Vec<IdentityReport> {
        let mut v: Vec<IdentityReport> = self
            .ids
            .iter()
            .filter_map(|(&id, e)| {
                let cost = self.less_drain(estimate_of(e, self.latency)?);
                Some(IdentityReport {
                    id,
                    launches: e.launches,
                    cost,
                    chained: e.chained.v[..e.chained.n].to_vec(),
                    fresh: e.fresh.v[..e.fresh.n].to_vec(),
                    outliers: e.outliers,
                })
            })
            .collect();
        let weight = |r: &IdentityReport| r.launches as f64 * r.cost;
        v.sort_by(|a, b| weight(b).total_cmp(&weight(a)));
        v.truncate(n);
        v
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
        assert!(t.wants_sample(9, 0));
        assert_eq!(t.charge(9), None);
        t.sample(1, 100.0, true);
        t.sample(2, 300.0, true);
        assert_eq!(t.charge(1).map(|c| c.cost), Some(100.0));
        assert_eq!(t.charge(2).map(|c| c.cost), Some(300.0));
        let m = t.charge(9).unwrap().cost;
        assert!((m - 200.0).abs() < 1.0, "{m}");
        let picked = |t: &mut CostTable| (0..64).filter(|_| t.wants_sample(1, 0)).count();
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
    fn resamples_are_rationed_in_time() {
        let mut t = CostTable::default();
        for id in 0..1_000 {
            for _ in 0..SAMPLES {
                t.sample(id, 1_000.0, true);
            }
            for _ in 0..RESAMPLE_AFTER {
                t.charge(id);
            }
        }
        // Every identity is due for a resample; over ten seconds of launches 1 µs apart only
        // the burst and the rate's samples are taken.
        let (mut taken, mut now) = (0u32, 0u64);
        for k in 0..10_000_000u64 {
            now = k * 1_000;
            taken += u32::from(t.wants_sample(k % 1_000, now));
        }
        let most = SAMPLE_BURST + SAMPLES_PER_SECOND * now as f64 / 1e9;
        assert!(
            f64::from(taken) <= most && f64::from(taken) >= most - 2.0,
            "{taken} of {most}"
        );
        // An identity never seen, or whose window is not full, is sampled whatever the ration.
        assert!(t.wants_sample(5_000, now));
        t.sample(5_000, 1_000.0, true);
        assert!((0..64).any(|_| t.wants_sample(5_000, now)));
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
    fn the_profile_charges_the_launches_at_the_estimate_and_at_the_smallest_sample() {
        let mut t = CostTable::default();
        for span in [100.0, 140.0, 120.0] {
            t.sample(1, span, true);
        }
        t.sample(1, 900_000.0, true); // an outlier, kept out
        for _ in 0..10 {
            t.charge(1);
        }
        let p = t.profile();
        assert_eq!((p.ids, p.chained, p.fresh, p.outliers), (1, 3, 0, 1));
        assert_eq!(p.by_estimate, 10.0 * 120.0);
        assert_eq!(p.by_smallest, 10.0 * 100.0);
    }

    #[test]
    fn the_drain_of_a_bracket_is_learned_from_back_to_back_segments_and_taken_off() {
        // Kernels of 6 and 10 µs; a bracket adds a 4 µs drain, once per bracket.
        let mut t = CostTable::default();
        for _ in 0..SAMPLES {
            t.sample(1, 10_000.0, true);
            t.sample(2, 14_000.0, true);
        }
        assert_eq!(t.cost(1), Some(10_000.0), "nothing learned yet");
        // Segments of 10 launches (5 of each) back to back: 80 µs of kernels + one drain.
        let sampled = 5.0 * 10_000.0 + 5.0 * 14_000.0;
        for _ in 0..5 {
            t.back_to_back(sampled, 84_000.0, 10);
        }
        // One segment held another context's slice: kept out by the median.
        t.back_to_back(sampled, 2_084_000.0, 10);
        assert_eq!(t.cost(1), Some(6_000.0));
        assert_eq!(t.cost(2), Some(10_000.0));
        let c = t.charge(1).unwrap();
        assert_eq!((c.cost, c.sampled), (6_000.0, 10_000.0));
        // Never more than half a sample, and never a negative drain.
        t.sample(3, 5_000.0, true);
        assert_eq!(t.cost(3), Some(2_500.0));
        let mut u = CostTable::default();
        u.sample(1, 10_000.0, true);
        for _ in 0..DRAINS {
            u.back_to_back(10_000.0 * 4.0, 60_000.0, 4);
        }
        assert_eq!(u.cost(1), Some(10_000.0), "a span longer than its samples");
        u.back_to_back(1.0, 1.0, 1);
        assert_eq!(u.profile().drain, 0.0, "one launch tells nothing");
    }

    #[test]
    fn nonsense_samples_are_ignored() {
        let mut t = CostTable::default();
        t.sample(1, f64::NAN, true);
        t.sample(1, -5.0, true);
        t.sample(1, f64::INFINITY, true);
        assert!(t.cost(1).is_none());
    }

    #[test]
    fn the_cached_estimate_follows_every_sample_and_latency_change() {
        // Identities sampled both ways move the latency, which changes the estimate of
        // every identity with samples from an idle stream, not only the one sampled.
        let mut t = CostTable::default();
        let mut x = 7u64;
        for i in 0..2_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = x % 5;
            if i % 3 == 0 {
                let clean = x % 2 == 0;
                let span = 10_000.0 * (id + 1) as f64
                    + if clean {
                        0.0
                    } else {
                        3_000.0 + (x % 997) as f64
                    };
                t.sample(id, span, clean);
            } else {
                let _ = t.charge(id);
            }
            for id in 0..5 {
                let fresh = t.ids.get(&id).and_then(|e| estimate_of(e, t.latency));
                let cached = t.ids.get(&id).and_then(|e| t.estimate(e));
                assert_eq!(cached, fresh, "identity {id} after step {i}");
            }
        }
    }

    #[test]
    fn a_back_to_back_segment_is_charged_at_most_its_span() {
        let mut t = CostTable::default();
        // Segments of 10 launches whose samples say 10 µs each took 100 µs less 9 drains of
        // 2 µs: the drain is 2 µs.
        for _ in 0..DRAINS {
            t.back_to_back(100_000.0, 82_000.0, 10);
        }
        assert_eq!(t.drain(), 2_000.0);
        // Charged 80 µs, it ran in 62 µs (its end marker's 2 µs are charged apart): 60 µs.
        assert_eq!(t.within_span(80_000.0, 62_000.0), 60_000.0);
        // Another context's slice inside the span makes it long: the costs stand.
        assert_eq!(t.within_span(80_000.0, 2_500_000.0), 80_000.0);
        // A span shorter than the drain charges nothing more, never less than nothing.
        assert_eq!(t.within_span(80_000.0, 1_000.0), 0.0);
        assert_eq!(t.within_span(80_000.0, f64::NAN), 80_000.0);
    }

    #[test]
    fn the_report_names_the_identities_charged_most_with_their_samples() {
        let mut t = CostTable::default();
        for _ in 0..SAMPLES {
            t.sample(1, 10_000.0, true);
            t.sample(2, 50_000.0, false);
            t.sample(3, 1_000.0, true);
        }
        for (id, n) in [(1, 100), (2, 40), (3, 500)] {
            for _ in 0..n {
                t.charge(id);
            }
        }
        // Charged: 2 ms (40 x 50 us), 1 ms (100 x 10 us), 0.5 ms (500 x 1 us).
        let r = t.heaviest(2);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].id, r[0].launches), (2, 40));
        assert_eq!((r[0].chained.len(), r[0].fresh.len()), (0, SAMPLES));
        assert_eq!((r[1].id, r[1].launches), (1, 100));
        assert_eq!(r[1].chained, vec![10_000.0; SAMPLES]);
        assert_eq!(t.heaviest(10).len(), 3);
    }
}
