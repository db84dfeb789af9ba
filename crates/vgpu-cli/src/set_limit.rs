//! `vgpu set-limit`: change limits in a live usage file.

use std::process::ExitCode;

use crate::Failure;
use crate::cli::SetLimitArgs;

/// `vgpu set-limit`.
pub fn set_limit(_args: &SetLimitArgs) -> Result<ExitCode, Failure> {
    Err(Failure::msg("set-limit is not implemented yet"))
}
