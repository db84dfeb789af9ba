//! The power share: a limited tenant's share of the GPU's power budget.
//!
//! (skeleton; filled in below)

use crate::traits::{Nanos, PowerSample};

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

#[allow(dead_code)]
fn _unused(_: PowerSample, _: Nanos) {}
