//! What the limiter is generic over: time, GPU time and the container's usage file (the
//! node's board, [`crate::NodeBoard`], lives with its records in `share`). The hook
//! implements them with `CLOCK_MONOTONIC`, CUDA events and the shared file; the tests with a
//! simulated clock, GPU and file.

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

/// What a marker is recorded for.
///
/// A span is read only between two timed markers; a completion marker only tells when the
/// GPU reached it. On the H200 a timing event costs about 2 µs of the stream's engine time
/// (its timestamp waits for the work ahead to drain), a completion-only event none measurably
/// (`gpu-tests/compute/marker_cost.cu`); recording a timing event takes about 3 µs of host
/// time (the `launch-timing` build's split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkerKind {
    /// Its completion time can be compared ([`GpuTimer::elapsed`]).
    Timed,
    /// Completion only (`CU_EVENT_DISABLE_TIMING`).
    Completion,
}

/// Markers in a GPU stream whose completion times can be compared (CUDA events).
///
/// A marker completes when the GPU has finished all work submitted to its stream
/// before it; [`GpuTimer::elapsed`] is the GPU time between two completed timed markers.
pub trait GpuTimer {
    /// A stream handle as the application passed it (after per-thread-stream mapping).
    type Stream: Copy + Eq + fmt::Debug;
    /// A recorded marker.
    type Marker: Copy + PartialEq + fmt::Debug;

    /// Records a new marker of `kind` at the current end of `stream`.
    fn record(
        &mut self,
        stream: Self::Stream,
        kind: MarkerKind,
    ) -> Result<Self::Marker, TimerError>;
    /// Whether the GPU has reached `marker`.
    fn is_complete(&mut self, marker: Self::Marker) -> Result<bool, TimerError>;
    /// Nanoseconds of GPU time between two completed timed markers (`start` recorded first).
    fn elapsed(&mut self, start: Self::Marker, end: Self::Marker) -> Result<Nanos, TimerError>;
    /// Returns a marker the limiter no longer needs (the hook reuses its event).
    fn release(&mut self, marker: Self::Marker);
    /// Holds `stream`'s work queued after this call until [`GpuTimer::open_gates`] (the hook:
    /// a stream wait on a host word). A sample's bracket opens behind a gate that is opened
    /// once its launch and end marker are queued, so the span holds no host time and no
    /// switch away from a stream that ran dry during the launch call. `Err`: nothing is held.
    fn gate(&mut self, stream: Self::Stream) -> Result<(), TimerError>;
    /// Opens every gate this timer holds; whether they held until now (false when none was
    /// held, or the timer had to open one earlier: the hook's opens a gate held past a bound,
    /// because a launch call can wait inside the driver for the GPU, which waits for the gate).
    fn open_gates(&mut self) -> bool;
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

/// The container's own state of one device, as its usage file holds it (written by its
/// processes and HAMi's monitor; trusted like the container's own configuration).
///
/// Reads are cheap loads (called on every limited launch); [`ContainerView::peers`] scans
/// the file's process slots and is called once per publish period only.
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
    /// The container's `CUDA_TASK_PRIORITY` as its file says now (a live change), if the
    /// view has one; otherwise the limiter's configured priority holds.
    fn task_priority(&self) -> Option<i32> {
        None
    }
}
