//! Compute (SM) limit control logic for vgpu.
//!
//! The limiter keeps the GPU time a process (and, through the shared file, a whole
//! container) spends on a device at its part: a cap (HAMi's meaning), or in share mode a
//! guarantee plus what idle containers lend, ordered by priority. It is pure logic: time
//! comes from a [`Clock`], GPU time from a [`GpuTimer`] (CUDA events in the hook, a
//! simulated GPU in the tests), the container's own state from a [`ContainerView`] (its
//! usage file) and the other containers' from a [`NodeBoard`] (the node's turn board). The
//! hook asks [`Limiter::admit`] before every kernel or graph launch and reports the launch
//! with [`Limiter::launched`]; `admit` either lets the launch go or says how long to sleep.
//!
//! The model in one paragraph (docs/sm-limit.md has the reasons): a container's GPU time is
//! the time its kernels execute, charged per launch at its identity's learned cost
//! ([`costs`]: samples of launches measured alone, robust to other contexts' time slices and
//! to host gaps); its launches are paced at a *rate* and its queue kept at a *depth*, both
//! from one [`Plan`] computed from its claim and the board ([`plan`], [`share`]). Nothing
//! else is enforced: no time windows, so whatever one container leaves idle another can
//! use, within its own rate.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod control;
pub mod costs;
pub mod plan;
mod policy;
pub mod share;
mod traits;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod sim_sliced;
#[cfg(test)]
mod tests;

pub use control::{Admission, Limiter, LimiterConfig, LimiterStats, Ticket};
pub use costs::{CostProfile, LaunchId};
pub use plan::{Plan, QueueRule};
pub use policy::Policy;
pub use share::{
    Allotment, BoardRecord, BoardReport, BoardRules, NoBoard, NodeBoard, ShareClaim, SmMode,
};
pub use traits::{
    Clock, ContainerView, GpuTimer, MarkerKind, Nanos, PeerShare, PeerUsage, TimerError,
};
