//! The limiter's tuning: every constant it runs with, and the hook's defaults.

use crate::policy::Policy;
use crate::share::{ShareRules, SmMode};
use crate::traits::Nanos;

const MICROS: Nanos = 1_000;
const MILLIS: Nanos = 1_000_000;

/// Tuning of a [`Limiter`](crate::Limiter); [`LimiterConfig::default`] is what the hook uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LimiterConfig {
    /// When the limit is enforced.
    pub policy: Policy,
    /// Control period: how far the virtual clock may run ahead of real time before
    /// launches wait. It bounds the work queued on the GPU to about `limit × period`
    /// (plus one kernel) and sets the granularity of the duty cycle.
    pub period: Nanos,
    /// How far the virtual clock may fall behind real time: the credit that makes up
    /// for late wake-ups, and the largest burst after an idle spell (`limit × burst`
    /// of GPU time on top of `limit × period`).
    pub burst: Nanos,
    /// Estimated GPU work after which a segment is closed with a marker.
    pub segment_work: Nanos,
    /// Launches after which a segment is closed regardless of the estimate.
    pub segment_launches: u32,
    /// A launch this long after the previous one first closes the open segment, and a
    /// segment closed this late is checked for GPU idle time at its end.
    pub idle_gap: Nanos,
    /// Closed segments whose markers have not completed; more make launches wait.
    pub max_outstanding: usize,
    /// Longest single wait; the caller then asks again (limit changes, monitor flags).
    pub max_wait: Nanos,
    /// Completions are polled at most this often on launches that are not throttled.
    pub poll_interval: Nanos,
    /// Poll interval while the monitor blocks launches (`recent_kernel < 0`).
    pub blocked_poll: Nanos,
    /// How often the achieved utilization is published and the peers' is read.
    pub publish_period: Nanos,
    /// A peer's share published longer ago than this is ignored: the peer stopped launching
    /// (a process publishes only while it launches or waits to launch). A few publish
    /// periods, so that one late publish does not drop a busy peer.
    pub peer_stale_after: Nanos,
    /// How often activity is signalled to the monitor.
    pub activity_period: Nanos,
    /// Budget against `limit − other processes' share` (the container-wide limit).
    pub share_with_peers: bool,
    /// How often the device's own accounting ([`crate::ContainerView::device_sample`]) is compared
    /// with the events' measurements; 0 (the default) turns the contention correction off.
    /// Off by default: on the H200, NVML's per-process utilization split time-sliced work
    /// about evenly between two tenants whatever their real shares (docs/sm-limit.md).
    pub contention_period: Nanos,
    /// The correction applies only when the device sees clearly less of our work than the
    /// events do (ratio below this), and other processes are active.
    pub contention_threshold: f64,
    /// Lowest correction factor: measurements are never discounted by more than this.
    pub contention_floor: f64,
    /// Shortest cycle of the turns limited containers on one GPU take
    /// ([`crate::ContainerView::turn_tenants`]; stretched for long launches, see [`crate::Turn::layout`]).
    pub turn_cycle: Nanos,
    /// How long before its window a container may start queueing ([`crate::Turn::admits`]).
    pub turn_lead_in: Nanos,
    /// How strongly the limit also bounds the share of the GPU's power budget
    /// ([`crate::power`]): 0 = time only, 1 = the power share fully; default 0.5.
    pub power_exponent: f64,
    /// Span over which device power and busy time are averaged for the power share.
    pub power_window: Nanos,
    /// Shortest idle span (no work of ours, the device not busy) that measures idle power.
    pub power_idle_span: Nanos,
    /// Whether the limit is a cap or a guaranteed share that borrows idle time.
    pub mode: SmMode,
    /// Share mode: the most this container may borrow up to, percent.
    pub ceiling_pct: u32,
    /// Share mode: `CUDA_TASK_PRIORITY` (lower = more urgent), unless the view has a live one.
    pub priority: i32,
    /// Share mode: how often the others' demand is read (and ours written, when it runs out).
    pub demand_poll: Nanos,
    /// Share mode: a container counts as busy this long after its queued work ends, so
    /// that the gaps between its launches are not lent out (the host's time between
    /// launches; short, so that a best-effort container fills the gaps of a service).
    pub idle_grace: Nanos,
    /// The same while the container takes turns: then it waits for its window up to
    /// `max_wait` at a time with nothing queued, and must not look idle meanwhile.
    pub idle_grace_in_turns: Nanos,
    /// Share mode: most work queued while a container of higher priority is on the board,
    /// so that its next work waits at most this (plus one kernel) behind ours.
    pub outranked_queue: Nanos,
    /// Share mode: most work queued while filling the gaps of a busy container of higher
    /// priority ([`crate::Allotment::gap_fill`]): what is queued lands in its bursts. 0: no
    /// gap filling (held while the higher one is busy).
    pub gap_fill_queue: Nanos,
    /// Share mode: which records are believed.
    pub share_rules: ShareRules,
}

impl Default for LimiterConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Default,
            period: 2 * MILLIS,
            burst: 10 * MILLIS,
            segment_work: 500 * MICROS,
            segment_launches: 64,
            idle_gap: MILLIS,
            max_outstanding: 16,
            max_wait: 2 * MILLIS,
            poll_interval: 100 * MICROS,
            blocked_poll: MILLIS,
            publish_period: 100 * MILLIS,
            peer_stale_after: 500 * MILLIS,
            activity_period: 1_000 * MILLIS,
            share_with_peers: true,
            contention_period: 0,
            contention_threshold: 0.9,
            contention_floor: 0.5,
            turn_cycle: 20 * MILLIS,
            turn_lead_in: 0,
            power_exponent: 0.5,
            power_window: 1_000 * MILLIS,
            power_idle_span: 200 * MILLIS,
            mode: SmMode::Cap,
            ceiling_pct: 100,
            priority: 1,
            demand_poll: 500 * MICROS,
            idle_grace: 500 * MICROS,
            idle_grace_in_turns: 5 * MILLIS,
            outranked_queue: 500 * MICROS,
            gap_fill_queue: 125 * MICROS,
            share_rules: ShareRules::default(),
        }
    }
}
