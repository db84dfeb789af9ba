#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod config;
pub mod devices;
pub mod host_limits;
pub mod log_level;
pub mod names;
pub mod size;
pub mod sm_tuning;
pub mod vars;

pub use config::{
    ByUuid, Config, ConfigError, ConfigErrors, DeviceSelector, HostBacking, Swap, SwapTrigger,
    UuidLimit, parse_duration_ms, parse_percent,
};
pub use devices::{DeviceKey, Layout};
pub use log_level::{DEFAULT_LOG_LEVEL, MAX_LOG_LEVEL, log_level_or_default, parse_log_level};
pub use names::*;
pub use size::{SizeError, parse_size};
pub use sm_tuning::SmTuning;
pub use vars::Vars;
