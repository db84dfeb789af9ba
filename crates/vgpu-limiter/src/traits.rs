//! The three things the limiter is generic over: time, GPU time and the shared view.

use std::fmt;

/// Nanoseconds on the [`Clock`]'s monotonic time line.
pub type Nanos = u64;

/// A monotonic clock.
pub trait Clock {
    /// Current time in nanoseconds; never decreases.
    fn now(&self) -> Nanos;
}

/// Why a GPU timer operation failed (the hook maps driver result codes onto this).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimerError {
    /// The driver's result code, or a negative value for errors of the timer itself.
    pub code: i32,
}

impl fmt::Display for TimerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU timer operation failed with code {}", self.code)
    }
}

impl std::error::Error for TimerError {}

/// Markers in a GPU stream whose completion times can be compared (CUDA events).
///
/// A marker completes when the GPU has finished all work submitted to its stream
/// before it; [`GpuTimer::elapsed`] is the GPU time between two completed markers.
pub trait GpuTimer {
    /// A stream handle as the application passed it (after per-thread-stream mapping).
    type Stream: Copy + Eq + fmt::Debug;
    /// A recorded marker.
    type Marker: Copy + PartialEq + fmt::Debug;

    /// Records a new marker at the current end of `stream`.
    fn record(&mut self, stream: Self::Stream) -> Result<Self::Marker, TimerError>;
    /// Whether the GPU has reached `marker`.
    fn is_complete(&mut self, marker: Self::Marker) -> Result<bool, TimerError>;
    /// Nanoseconds of GPU time between two completed markers (`start` recorded first).
    fn elapsed(&mut self, start: Self::Marker, end: Self::Marker) -> Result<Nanos, TimerError>;
    /// Returns a marker the limiter no longer needs (the hook reuses its event).
    fn release(&mut self, marker: Self::Marker);
}

/// What the other processes of the container use on this device (the limiter's sum of the
/// fresh [`PeerShare`]s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerUsage {
    /// Sum of the other live processes' published utilization, in percent.
    pub util_pct: u32,
    /// How many other processes published a non-zero utilization.
    pub active: u32,
}

/// One other live process's last published utilization of this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerShare {
    /// Published utilization, percent.
    pub util_pct: u32,
    /// When it was published, on the [`Clock`]'s time line (the hook: `CLOCK_MONOTONIC`,
    /// which all processes of a host share). `None` when the publisher left no time (an
    /// older library, or a file without the time table): the share is then taken as fresh.
    pub published_at: Option<Nanos>,
}

/// The device's own accounting of this process's work (NVML's per-process utilization),
/// over the period since the previous sample.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DeviceSample {
    /// Fraction of the period during which this process's kernels ran, as the device saw it.
    pub own: f64,
    /// Whether other processes (any container) ran kernels on the device in the period.
    pub others_active: bool,
}

/// The device's power, as the hook reads it from NVML once per publish period.
///
/// The limiter uses it to keep a limited tenant's share of the GPU's *power budget* in
/// line with its share of time ([`crate::power`]): work that would run power-capped
/// on the whole GPU runs at full clock when limited, so a time share alone gives it more
/// throughput than the same share of the unlimited GPU.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PowerSample {
    /// When it was read, on the [`Clock`]'s time line.
    pub at: Nanos,
    /// The device's energy counter, millijoules since the driver loaded
    /// (`nvmlDeviceGetTotalEnergyConsumption`; it advances in steps, ~100 ms on the H200).
    pub energy_mj: u64,
    /// The device's enforced power limit, milliwatts (`nvmlDeviceGetEnforcedPowerLimit`).
    pub limit_mw: u64,
    /// Fraction of the device's last sample period during which any kernel ran
    /// (`nvmlDeviceGetUtilizationRates().gpu / 100`), if known.
    pub device_busy: Option<f64>,
    /// The device's idle power, milliwatts, if the reader saw it idle: its one-second average
    /// power (`nvmlDeviceGetPowerUsage`) after a second in which no kernel ran on it.
    pub idle_mw: Option<u64>,
}

/// Launches of its typical length each tenant's window should hold at least.
const LAUNCHES_PER_WINDOW: u64 = 16;
/// Longest turn cycle, as a multiple of the shortest, whatever the launches' length (160 ms
/// by default: a 30% window then holds nine 5 ms launches).
const MAX_CYCLE_FACTOR: u64 = 8;
/// In share mode every window gets an edge allowance on top of its share (taken from all in
/// proportion): each window loses about the same time at its edges whatever its width
/// (whole launches fit it, so its end is left short, and its first launch starts after a
/// wake-up and a context switch), so without it a small share loses more of itself than a
/// large one; too large, and the largest window falls below its share. The allowance is
/// [`EDGE_ALLOWANCE_MIN`], or a [`EDGE_ALLOWANCE_PER_CYCLE`]th of a cycle that long
/// launches stretched (their whole-launch loss grows with them); not a part of the launch
/// length itself, so that a republished launch length does not move every window.
///
/// Fitted on the H200 (runs 26 and 27, 2026-12-01: four matmul tenants at 10/20/30/40, 200 µs
/// kernels, a 40 ms cycle, eight orders of the windows). With an 80th of the cycle (500 µs)
/// the 10% tenant got 10.0–10.6 of what the four got and the 40% one 39.4–39.7 whatever its
/// place, so the loss follows the size; with 250 µs, 9.96–10.27 and 39.6–39.97. At an 80 ms
/// cycle (500 µs) the 10% tenant got 10.5: the loss is time, not a part of the cycle. The
/// simulated GPU loses more at its edges (its 10% tenant 0.3 under with 250 µs).
const EDGE_ALLOWANCE_MIN: Nanos = 250_000;
/// See [`EDGE_ALLOWANCE_MIN`].
const EDGE_ALLOWANCE_PER_CYCLE: u64 = 160;
/// The whole GPU in [`TurnTenant::part_bp`]'s unit.
pub const WHOLE_BP: u64 = 10_000;

/// One limited container announced on a GPU's turn board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnTenant {
    /// Its key (the same for every process of the container).
    pub key: u64,
    /// Its part of the GPU, basis points ([`WHOLE_BP`] = the whole GPU): its SM limit in
    /// cap mode, its allotment in share mode (finer than a percent, so that a lent part is
    /// not rounded away).
    pub part_bp: u32,
    /// The GPU time of its typical launch, nanoseconds (0 if unknown).
    pub launch_ns: u64,
}

/// This container's turn on a GPU shared with other limited containers: a window of
/// `width` ns starting `offset` ns into every `cycle` ns of the clock (all containers of a
/// node share CLOCK_MONOTONIC, so their cycles line up). Launches wait for the window and
/// stop early enough that the queued work ends in it; the containers' work then does not
/// wait behind each other's time slices, which the events would count as ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Turn {
    /// Length of the common cycle.
    pub cycle: Nanos,
    /// Start of this container's window in the cycle.
    pub offset: Nanos,
    /// Length of the window.
    pub width: Nanos,
}

impl Turn {
    /// The turn of tenant `me` among `tenants` (every limited container on the GPU, `me`
    /// included) in cap mode, all computing the same layout: windows in key order, each as
    /// long as its part of the cycle (scaled down if the parts add up to more than the
    /// whole GPU). `None` when `me` is alone or absent: nothing to coordinate.
    pub fn layout(me: u64, tenants: &[TurnTenant], min_cycle: Nanos) -> Option<Turn> {
        Self::lay_out(me, tenants, min_cycle, false)
    }

    /// The same in share mode, where the window is the part (not a cap the pacer holds):
    /// every window also gets an edge allowance (250 µs, more in a cycle long launches
    /// stretched: `EDGE_ALLOWANCE_MIN`).
    pub fn layout_shared(me: u64, tenants: &[TurnTenant], min_cycle: Nanos) -> Option<Turn> {
        Self::lay_out(me, tenants, min_cycle, true)
    }

    fn lay_out(me: u64, tenants: &[TurnTenant], min_cycle: Nanos, edges: bool) -> Option<Turn> {
        if tenants.len() < 2 || min_cycle == 0 {
            return None;
        }
        let mut sorted: Vec<TurnTenant> = tenants.to_vec();
        sorted.sort_unstable_by_key(|t| t.key);
        sorted.dedup_by_key(|t| t.key);
        let parts: u64 = sorted.iter().map(|t| u64::from(t.part_bp)).sum();
        let total = parts.max(WHOLE_BP);
        // Long enough that every window holds several of its tenant's launches (whole
        // launches fit a window, so a window of few launches loses a large fraction to
        // rounding), bounded so that turns stay short against human time scales. Rounded
        // up to the minimum times a power of two: each tenant computes the layout from the
        // launch lengths it last read, which drift a little; the rounding keeps everyone on
        // the same cycle (different cycles would misalign the windows).
        let needed = sorted
            .iter()
            .filter(|t| t.part_bp > 0)
            .map(|t| {
                // Hostile launch lengths saturate (and hit the cap below).
                t.launch_ns
                    .saturating_mul(LAUNCHES_PER_WINDOW)
                    .saturating_mul(total)
                    / u64::from(t.part_bp)
            })
            .max()
            .unwrap_or(0);
        let mut cycle = min_cycle;
        while cycle < needed && cycle < min_cycle.saturating_mul(MAX_CYCLE_FACTOR) {
            cycle = cycle.saturating_mul(2);
        }
        // What the parts are given of the cycle; the allowances come out of it first.
        let assigned = (u128::from(cycle) * u128::from(parts) / u128::from(total)) as u64;
        let with_part = sorted.iter().filter(|t| t.part_bp > 0).count() as u64;
        let extra = match edges {
            true => (cycle / EDGE_ALLOWANCE_PER_CYCLE)
                .max(EDGE_ALLOWANCE_MIN)
                .min(assigned / 4 / with_part.max(1)),
            false => 0,
        };
        let proportional = assigned - extra * with_part;
        let mut offset = 0;
        for t in &sorted {
            let extra = if t.part_bp > 0 { extra } else { 0 };
            let width = extra
                + (u128::from(proportional) * u128::from(t.part_bp) / u128::from(parts.max(1)))
                    as u64;
            if t.key == me {
                return (sorted.len() >= 2 && width > 0).then_some(Turn {
                    cycle,
                    offset,
                    width,
                });
            }
            offset += width;
        }
        None
    }

    /// Whether `now` is in one of this turn's windows (from `lead_in` before it opens, as in
    /// [`Turn::admits`]).
    pub fn is_open(&self, now: Nanos, lead_in: Nanos) -> bool {
        let lead = lead_in.min(self.width / 8);
        let into = (now + self.cycle - self.offset % self.cycle + lead) % self.cycle;
        into < self.width + lead
    }

    /// Whether work estimated at `est` ns may be queued at `now` behind work that ends at
    /// `horizon` (≥ now): `Ok` inside the window if it ends in the window, or, for work
    /// longer than the whole window, if nothing is queued; otherwise `Err(ns until the next
    /// window)`.
    ///
    /// With a `lead_in` (at most an eighth of the window is used), queueing may start that
    /// long before the window opens, to make up for a late wake-up and the GPU's start-up
    /// latency; work queued early runs behind the other container's last work.
    pub fn admits(&self, now: Nanos, horizon: f64, est: f64, lead_in: Nanos) -> Result<(), Nanos> {
        let lead = lead_in.min(self.width / 8);
        let base = now - now % self.cycle;
        let starts = [
            (base + self.offset).checked_sub(self.cycle),
            Some(base + self.offset),
            Some(base + self.offset + self.cycle),
        ];
        let mut next = Nanos::MAX;
        for start in starts.into_iter().flatten() {
            let open = start.saturating_sub(lead);
            let end = start + self.width;
            if (open..end).contains(&now) {
                // Work that can never fit a window goes when nothing is queued; anything
                // else must end in the window (an overrun would be time-sliced with the
                // next container's work, and both would count it).
                let never_fits = est >= self.width as f64;
                if horizon + est <= end as f64 || (never_fits && horizon <= now as f64) {
                    return Ok(());
                }
            } else if open > now {
                next = next.min(open - now);
            }
        }
        Err(next.clamp(1, self.cycle))
    }
}

/// The container-wide state of one device, as the shared file holds it.
///
/// Reads are cheap loads (called on every throttled launch); [`ContainerView::peers`]
/// scans the file's process slots and is called once per publish period only.
pub trait ContainerView {
    /// The device's SM limit in percent (0 or >= 100 = unlimited); the monitor may change it.
    fn sm_limit_pct(&self) -> u32;
    /// The monitor's `recent_kernel`: negative means "block launches".
    fn recent_kernel(&self) -> i32;
    /// The monitor's `utilization_switch` (1 = the device is contended).
    fn utilization_switch(&self) -> i32;
    /// Utilization published by the other live processes sharing the file, with when each
    /// was published (the limiter ignores shares that are too old: a process that stopped
    /// launching stops publishing).
    fn peers(&self) -> Vec<PeerShare>;
    /// Publishes this process's achieved utilization (percent) in its slot's `sm_util`, with
    /// the time `now` (the [`Clock`]'s) of publishing.
    fn publish_util(&mut self, util_pct: u32, now: Nanos);
    /// Tells the monitor this process launches kernels (`recent_kernel`, `last_kernel_time`).
    fn note_activity(&mut self, now: Nanos);
    /// The device's own view of this process's utilization since the last call, if it has
    /// one (called once per contention period). Used only to correct for time the events
    /// count while this process's work waits behind other processes' time slices.
    fn device_sample(&mut self) -> Option<DeviceSample> {
        None
    }
    /// Announces this container on the GPU's turn board (with the GPU time of its typical
    /// launch) and returns its key with every limited container announced there, itself
    /// included; `None` when containers do not coordinate. Called once per publish period.
    fn turn_tenants(&mut self, _now: Nanos, _launch_ns: u64) -> Option<(u64, Vec<TurnTenant>)> {
        None
    }
    /// The device's power now (called once per publish period while a limit is enforced);
    /// `None` when it cannot be read, and then only time is limited.
    fn power_sample(&mut self, _now: Nanos) -> Option<PowerSample> {
        None
    }
    /// A power sample taken before this process ran work on the device (the hook: just
    /// before it created its context), if any. Asked once, before the first
    /// [`ContainerView::power_sample`]: if the device stayed idle from then until the first
    /// launch, the span measures its idle power.
    fn power_baseline(&mut self) -> Option<PowerSample> {
        None
    }
    /// What the power share concluded from the latest sample (for logs; called once per
    /// publish period while samples come).
    fn note_power(&mut self, _state: &crate::power::PowerState) {}
    /// Share mode ([`crate::SmMode::Share`]): writes this container's record on the GPU's
    /// turn board and returns its key with every record there (hostile input: the limiter
    /// checks them, [`crate::share::allot`]); `None` when containers do not coordinate.
    /// Called once per publish period.
    fn share_board(
        &mut self,
        _now: Nanos,
        _report: &crate::share::ShareReport,
    ) -> Option<(u64, Vec<crate::share::ShareTenant>)> {
        None
    }
    /// Share mode, called at most every `demand_poll` (sub-millisecond, so it must be a
    /// few system calls at most, no lock): writes this container's `busy_until` if given
    /// (in the record [`ContainerView::share_board`] placed), and returns every record.
    fn share_demand(
        &mut self,
        _now: Nanos,
        _busy_until: Option<Nanos>,
    ) -> Option<Vec<crate::share::ShareTenant>> {
        None
    }
    /// The container's `CUDA_TASK_PRIORITY` as its file says now (a live change), if the
    /// view has one; otherwise the limiter's configured priority holds.
    fn task_priority(&self) -> Option<i32> {
        None
    }
}
