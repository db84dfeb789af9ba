//! `GPU_CORE_UTILIZATION_POLICY`.

use std::fmt;

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

/// An unknown `GPU_CORE_UTILIZATION_POLICY` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPU_CORE_UTILIZATION_POLICY={:?}: expected default, force, disable or monitor",
            self.0
        )
    }
}

impl std::error::Error for PolicyError {}

impl Policy {
    /// Parses the variable's value (case-insensitive, surrounding blanks ignored; empty = default).
    pub fn parse(value: &str) -> Result<Self, PolicyError> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "default" => Ok(Self::Default),
            "force" => Ok(Self::Force),
            "disable" => Ok(Self::Disable),
            "monitor" => Ok(Self::Monitor),
            _ => Err(PolicyError(value.to_owned())),
        }
    }

    /// Whether a set limit is enforced given the monitor's `utilization_switch`.
    pub fn enforces(self, utilization_switch: i32) -> bool {
        match self {
            Self::Default | Self::Force => true,
            Self::Disable => false,
            Self::Monitor => utilization_switch != 0,
        }
    }
}
