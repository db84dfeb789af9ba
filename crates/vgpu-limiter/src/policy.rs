//! When the SM limit is enforced (`GPU_CORE_UTILIZATION_POLICY`). The limiter owns the
//! policy because it is the one that acts on it; the variable's grammar lives in
//! `vgpu-env`, which parses it straight into this type.

/// When the SM limit is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Enforce a set limit always, also when the tenant is alone on the device
    /// (unlike HAMi-core's default). The monitor's `utilization_switch` is not needed.
    #[default]
    Default,
    /// Enforce a set limit always (`FORCE`); same as [`Policy::Default`] here, kept for
    /// compatibility with HAMi-core's value.
    Force,
    /// Never enforce the SM limit (`DISABLE`); the launch path does nothing.
    Disable,
    /// HAMi-core's default behaviour (`MONITOR`): enforce only while the monitor's
    /// `utilization_switch` is non-zero, i.e. while the device is shared.
    Monitor,
}

impl Policy {
    /// Whether a set limit is enforced given the monitor's `utilization_switch`.
    pub fn enforces(self, utilization_switch: i32) -> bool {
        match self {
            Self::Default | Self::Force => true,
            Self::Disable => false,
            Self::Monitor => utilization_switch != 0,
        }
    }
}
