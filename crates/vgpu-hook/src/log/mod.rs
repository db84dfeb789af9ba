//! Logging to stderr with the `[vgpu]` prefix, filtered by `LIBCUDA_LOG_LEVEL`
//! (0 errors, 1 warnings, 2 messages (default), 3 info, 4 debug — HAMi-core's scale).
//!
//! The log is the program's guest on its stderr: a line never raises a signal in the
//! program, never makes it wait and never changes its state (`stderr`: a pipe whose reader
//! has gone or nobody drains, a socket, a file), and each kind of line (one `vlog!` call
//! site) is rate-limited (`rate`: a burst of 10, then 2 a second), the next line of its kind
//! saying how many were suppressed, and the process's exit how many it never reported. A
//! line is one write of at most `PIPE_BUF` bytes, so lines of concurrent threads and
//! processes do not interleave, with control characters escaped (paths and UUIDs from the
//! shared file are its writers' bytes), so a record is always one line.
//!
//! The level is read from the environment once, with `vgpu-env`'s grammar but without the
//! whole config parser, so the parser's own errors can be logged; an invalid value gives the
//! default level here, and the parser's warning (logged once when the state is built)
//! reports it.

mod rate;
// fstat, open, write, send and the thread's signal mask on fd 2.
#[allow(unsafe_code)]
mod stderr;

use rate::Admit;
pub(crate) use rate::Kind;

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

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

/// Lines suppressed by the rate limit, and those of them a later line reported: the
/// difference is said at exit.
static SUPPRESSED: AtomicU64 = AtomicU64::new(0);
static REPORTED: AtomicU64 = AtomicU64::new(0);

/// Writes one line of `kind` at `lvl` unless the kind's rate limit suppresses it (used by
/// the macro, after the level check).
pub(crate) fn write_line(kind: &Kind, lvl: u8, args: std::fmt::Arguments<'_>) {
    match kind.admit(vgpu_shm::monotonic_ns()) {
        Admit::Suppress => {
            SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        }
        Admit::Write { suppressed } => {
            REPORTED.fetch_add(suppressed, Ordering::Relaxed);
            let note = (suppressed > 0).then(|| {
                format!(" ({suppressed} more lines like this were suppressed since the last one)")
            });
            let line = render(lvl, &args.to_string(), note.as_deref().unwrap_or(""));
            stderr::write_line(line.as_bytes());
        }
    }
}

/// At exit: one line with the suppressed lines no later line reported (not rate-limited;
/// nothing when there are none). Counts inherited from before a `fork` are the parent's and
/// may be said by both.
pub(crate) fn say_suppressed_at_exit() {
    let unreported = SUPPRESSED
        .load(Ordering::Relaxed)
        .saturating_sub(REPORTED.load(Ordering::Relaxed));
    if unreported > 0 && enabled(MSG) {
        let text = format!(
            "{unreported} log lines were suppressed by the rate limit (at most {} lines of a \
             kind at once, then one per {} ms) after the last line of their kind",
            rate::BURST,
            rate::INTERVAL_NS / 1_000_000
        );
        stderr::write_line(render(MSG, &text, "").as_bytes());
    }
}

/// The line: `[vgpu PID LEVEL] message note`, control characters of the message escaped,
/// cut to [`stderr::MAX_LINE`] bytes with its newline.
fn render(lvl: u8, message: &str, note: &str) -> String {
    let tag = match lvl {
        ERROR => "ERROR",
        WARN => "WARN",
        MSG => "MSG",
        INFO => "INFO",
        _ => "DEBUG",
    };
    let mut line = format!("[vgpu {} {tag}] ", std::process::id());
    for c in message.chars() {
        if c.is_control() {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    line.push_str(note);
    const CUT: &str = "...";
    if line.len() + 1 > stderr::MAX_LINE {
        let mut end = stderr::MAX_LINE - 1 - CUT.len();
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push_str(CUT);
    }
    line.push('\n');
    line
}

/// `vlog!(level, "fmt", args...)`: logs when `level` is enabled, rate-limited per call site.
macro_rules! vlog {
    ($lvl:expr, $($arg:tt)+) => {
        if $crate::log::enabled($lvl) {
            static KIND: $crate::log::Kind = $crate::log::Kind::new();
            $crate::log::write_line(&KIND, $lvl, format_args!($($arg)+));
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

    #[test]
    fn a_line_is_one_line_of_at_most_pipe_buf_bytes() {
        let line = render(MSG, "file /tmp/a\nFAKE\x1b]0;title\x07 é", " (2 more)");
        assert!(
            line.ends_with("] file /tmp/a\\nFAKE\\u{1b}]0;title\\u{7} é (2 more)\n"),
            "{line:?}"
        );
        assert_eq!(line.matches('\n').count(), 1);
        let long = render(ERROR, &"é".repeat(5000), "");
        // Cut at a character boundary (é is two bytes), within the last one's reach.
        assert!(long.len() <= stderr::MAX_LINE && long.len() > stderr::MAX_LINE - 2);
        assert!(long.ends_with("...\n") && long.starts_with("[vgpu "));
    }
}
