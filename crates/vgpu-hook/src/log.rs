//! Logging to stderr with the `[vgpu]` prefix, filtered by `LIBCUDA_LOG_LEVEL`
//! (0 errors, 1 warnings, 2 messages (default), 3 info, 4 debug — HAMi-core's scale).
//!
//! Each line is written with one `write(2)` so lines of concurrent threads and processes
//! do not interleave. The level is read from the environment once, with `vgpu-env`'s
//! grammar but without the whole config parser, so the parser's own errors can be logged;
//! an invalid value gives the default level here, and the parser's warning (logged once
//! when the state is built) reports it.

use std::sync::atomic::{AtomicU8, Ordering};

/// Error: always shown.
pub(crate) const ERROR: u8 = 0;
/// Warning.
pub(crate) const WARN: u8 = 1;
/// Notable messages (default level).
pub(crate) const MSG: u8 = 2;
/// Info.
pub(crate) const INFO: u8 = 3;
/// Debug.
pub(crate) const DEBUG: u8 = 4;

const UNSET: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNSET);

/// The level for a `LIBCUDA_LOG_LEVEL` value; unset or not a level: the default (2), since
/// a typo in a log level must not stop a program.
pub(crate) fn parse_level(value: Option<&str>) -> u8 {
    vgpu_env::log_level_or_default(value)
}

/// The active level (read from the environment on first use).
#[inline]
pub(crate) fn level() -> u8 {
    let l = LEVEL.load(Ordering::Relaxed);
    if l != UNSET {
        return l;
    }
    let value = std::env::var_os(vgpu_env::ENV_LOG_LEVEL);
    let l = parse_level(value.as_ref().map(|v| v.to_string_lossy()).as_deref());
    LEVEL.store(l, Ordering::Relaxed);
    l
}

/// Whether messages of `lvl` are shown.
#[inline]
pub(crate) fn enabled(lvl: u8) -> bool {
    lvl <= level()
}

/// Writes one formatted line (used by the macros).
pub(crate) fn write_line(lvl: u8, args: std::fmt::Arguments<'_>) {
    let tag = match lvl {
        ERROR => "ERROR",
        WARN => "WARN",
        MSG => "MSG",
        INFO => "INFO",
        _ => "DEBUG",
    };
    let line = format!("[vgpu {} {tag}] {args}\n", std::process::id());
    crate::ffi::write_stderr(line.as_bytes());
}

/// `vlog!(level, "fmt", args...)`: logs when `level` is enabled.
macro_rules! vlog {
    ($lvl:expr, $($arg:tt)+) => {
        if $crate::log::enabled($lvl) {
            $crate::log::write_line($lvl, format_args!($($arg)+));
        }
    };
}
pub(crate) use vlog;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_parsing_defaults_and_refuses_values_above_debug() {
        assert_eq!(parse_level(None), MSG);
        assert_eq!(parse_level(Some("0")), ERROR);
        assert_eq!(parse_level(Some(" 4 ")), DEBUG);
        // Not a level (one grammar with `vgpu run`, which refuses it): the default, not debug.
        assert_eq!(parse_level(Some("9")), MSG);
        assert_eq!(parse_level(Some("loud")), MSG);
        // The hook's names agree with the grammar's bounds.
        assert_eq!(
            (MSG, DEBUG),
            (vgpu_env::DEFAULT_LOG_LEVEL, vgpu_env::MAX_LOG_LEVEL)
        );
    }
}
