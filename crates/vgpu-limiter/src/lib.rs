//! Compute (SM) limit control logic for vgpu.
//!
//! The limiter keeps the GPU time a process (and, through the shared file, a whole
//! container) spends on a device at or below `limit × wall time`. It is pure logic:
//! time comes from a [`Clock`], GPU time from a [`GpuTimer`] (CUDA events in the hook,
//! a simulated GPU in the tests), and the container-wide view from a [`ContainerView`]
//! (the shared file in the hook). The hook asks [`Limiter::admit`] before every kernel or
//! graph launch and reports the launch with [`Limiter::launched`]; `admit` either lets the
//! launch go or tells the caller how long to sleep before asking again.
//!
//! Design in one paragraph (docs/sm-limit.md has the reasons): launches are grouped into
//! *segments*, each bracketed by two GPU markers (events) on the launch's stream, so the
//! GPU time of a segment is measured by the GPU itself, not sampled. Admission is a
//! virtual-time pacer: every unit of GPU time `b` moves the process's virtual clock by
//! `b / limit`; launches are admitted while the virtual clock is at most one control
//! period ahead of real time, and not-yet-measured launches are charged an estimate that
//! is corrected when their segment completes. Long-run GPU time therefore equals
//! `limit × wall time` exactly, and the work queued on the GPU stays about one control
//! period deep.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod control;
mod policy;
pub mod power;
pub mod share;
mod traits;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_share;

pub use control::{Admission, Limiter, LimiterConfig, LimiterStats, Ticket};
pub use policy::Policy;
pub use share::{Allotment, ShareClaim, ShareReport, ShareRules, ShareTenant, SmMode};
pub use traits::{
    Clock, ContainerView, DeviceSample, GpuTimer, Nanos, PeerShare, PeerUsage, PowerSample,
    TimerError, Turn, TurnTenant, WHOLE_BP,
};
