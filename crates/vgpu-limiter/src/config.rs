//! The limiter's tuning: every constant it runs with, and the hook's defaults. Users set
//! only the mode, the limit, the ceiling and the priority (`vgpu-env`); the rest is here for
//! the tests and benches, each default with its reason.

use crate::policy::Policy;
use crate::share::{BoardRules, SmMode};
use crate::traits::Nanos;

const MICROS: Nanos = 1_000;
const MILLIS: Nanos = 1_000_000;

/// Tuning of a [`Limiter`](crate::Limiter); [`LimiterConfig::default`] is what the hook uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimiterConfig {
    /// When the limit is enforced.
    pub policy: Policy,
    /// Whether the limit is a cap or a guaranteed share that borrows idle time.
    pub mode: SmMode,
    /// Share mode: the most this container may use, percent.
    pub ceiling_pct: u32,
    /// `CUDA_TASK_PRIORITY` (lower = more urgent), unless the view has a live one.
    pub priority: i32,
    /// The pacer's burst: GPU time a paced container may queue at once before it waits for
    /// its rate to pay for it. Beside a container with a deep queue each burst of ours
    /// costs one context switch (0.15 ms of dead time on the H200), so bursts as long as fit
    /// in one time slice (2.09 ms) switch least; a launch that would take the burst past
    /// this waits for the next burst, so a burst never outlasts a slice.
    pub burst: Nanos,
    /// Idle credit: GPU time the bucket holds at most. A cap bounds a container's GPU time
    /// over any second within the cap's 3 points: over any window of T the pacer lets
    /// through at most `rate × T + credit + burst`, so credit + burst ≤ 30 ms keeps a
    /// second within 3 points. Below that, a step whose busy phase outruns the credit is held although its
    /// average is under the cap (a training step queues tens of milliseconds at once).
    pub credit: Nanos,
    /// Estimated GPU work after which a completion marker closes a segment.
    pub segment_work: Nanos,
    /// Launches after which a segment is closed regardless of the estimate.
    pub segment_launches: u32,
    /// Closed segments whose markers have not completed (it bounds the markers in flight);
    /// beyond it the open segment grows instead. Launches never wait for it.
    pub max_outstanding: usize,
    /// The deepest queue of a paced container beyond the kernel running (GPU time of its
    /// launches not yet known run):
    /// what the board decides applies to work not yet queued, so a lent share comes back
    /// within this. Four time slices: time slicing never finds a paced queue empty while
    /// its host runs ahead.
    pub deep_queue: Nanos,
    /// Samples (launches measured alone) in flight at most; further unknown launches are
    /// charged the mean cost and measured with their segment.
    pub max_samples: usize,
    /// Longest single wait; the caller then asks again (limit changes, monitor flags).
    pub max_wait: Nanos,
    /// Shortest wait for the queue to shrink, and the wait while nothing is known of any
    /// cost yet (the first launch runs alone).
    pub poll_interval: Nanos,
    /// Poll interval while the monitor blocks launches (`recent_kernel < 0`).
    pub blocked_poll: Nanos,
    /// How often the achieved utilization is published, the peers' read and the record on
    /// the board rewritten.
    pub publish_period: Nanos,
    /// A peer's share published longer ago than this is ignored: the peer stopped launching.
    pub peer_stale_after: Nanos,
    /// How often activity is signalled to the monitor.
    pub activity_period: Nanos,
    /// Budget against `limit − other processes' share` (the container-wide limit).
    pub share_with_peers: bool,
    /// How often the board's demands are read (and ours written) from the launch path while
    /// the priority rules depend on them: a more urgent container reads ours (we outrank it),
    /// and we read a more urgent one's five times as often.
    pub demand_poll: Nanos,
    /// How often they are read (and ours written) when no container on the board is of
    /// another priority: then nobody's plan needs another's demand sooner than a share is
    /// lent ([`BoardRules::lend_after`]).
    pub calm_poll: Nanos,
    /// A container counts as busy this long after its queued work ends: the host's time
    /// between the kernels of one request or step (tens of µs in eager PyTorch) is not lent.
    /// Twice the demand poll, so a demand rewritten at every poll never runs out while the
    /// container launches. Completions are looked for once per grace on launches that are
    /// not throttled, so a queue that ran empty is seen within one.
    pub idle_grace: Nanos,
    /// Most work queued while a container of higher priority is on the board: its next
    /// kernel waits at most this plus one kernel of ours.
    pub short_queue: Nanos,
    /// Longest a launch call is held by others' claims: no record holds a launch longer,
    /// whatever it says, so a forged claim costs a held container one launch per this.
    pub max_hold: Nanos,
    /// Which records are believed.
    pub rules: BoardRules,
}

impl Default for LimiterConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Default,
            mode: SmMode::Cap,
            ceiling_pct: 100,
            priority: 1,
            burst: 2 * MILLIS,
            credit: 25 * MILLIS,
            // One burst: the rules that use what ran work in bursts (a full deep queue waits
            // for half of its 8 ms; the priority rules close their segment before they wait),
            // and a marker costs a real workload far more than its driver call (the sample
            // ration in `costs`).
            segment_work: 2 * MILLIS,
            segment_launches: 64,
            max_outstanding: 64,
            deep_queue: 8 * MILLIS,
            // Half the segments in flight: a new loop's identities are learned within a few
            // of its steps while the rest of its work is still tracked.
            max_samples: 8,
            max_wait: 2 * MILLIS,
            poll_interval: 100 * MICROS,
            blocked_poll: MILLIS,
            publish_period: 100 * MILLIS,
            // Five publish periods: one late publish does not drop a busy peer.
            peer_stale_after: 500 * MILLIS,
            activity_period: 1_000 * MILLIS,
            share_with_peers: true,
            // Half the grace: a demand rewritten at every poll never runs out while launches
            // come (`idle_grace`). The priority rules need it this fresh.
            demand_poll: 250 * MICROS,
            // A tenth of the 50 ms after which an idle share is lent. A read of the board with
            // its write costs a launching thread about 20 µs (a pwrite and a pread of the
            // file, the records' decoding and the plan: docs/sm-limit.md): at this poll 0.4%.
            calm_poll: 5 * MILLIS,
            idle_grace: 500 * MICROS,
            // The priority model's allowance beyond the running kernel. Shorter queues cost the
            // short-queued container its share: each refill waits for a wake-up (tens of µs).
            short_queue: 500 * MICROS,
            max_hold: 200 * MILLIS,
            rules: BoardRules::default(),
        }
    }
}
