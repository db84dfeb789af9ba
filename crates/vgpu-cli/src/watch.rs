//! `vgpu watch`: the usage file refreshed in place, in 80 columns, with local time; or one
//! JSON object per sample (NDJSON) for scripts. What a tenant wrote (UUIDs, a file's name)
//! is shown through [`untrusted`].
//!
//! Terminal-only things (clearing the screen, the Ctrl-C hint, colours) appear only when
//! stdout is a terminal, colours also only without `$NO_COLOR`: a pipe gets plain frames.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anstyle::{AnsiColor, Style};
use serde::Serialize;

use crate::Failure;
use crate::cli::WatchArgs;
use crate::report::StatusReport;
use crate::signals;
use crate::status::{ProcessColumns, kept_on_row, write_device_rows, write_process_rows};
use crate::units::{counted, format_local_time, percent_of, rfc3339_local};
use crate::untrusted;
use crate::usage_table::read;

/// The NDJSON schema identifier of `watch --json` (docs/cli.md).
pub const SCHEMA: &str = "vgpu.watch.v1";

/// Clear the screen and home the cursor.
const CLEAR: &str = "\x1b[H\x1b[2J";

/// Usage at or above this share of the limit is highlighted as near the limit.
pub const NEAR_LIMIT_PERCENT: u64 = 90;

/// Free memory under the limit below which a device counts as full: the hook hands out
/// device memory in 2 MiB pages, so a request then is refused (`CUDA_ERROR_OUT_OF_MEMORY`).
pub const FULL_MARGIN: u64 = 2 << 20;

/// One `watch --json` line.
#[derive(Debug, Serialize)]
pub struct WatchSample<'a> {
    /// Always [`SCHEMA`].
    pub schema: &'static str,
    /// Local time of the sample, RFC 3339 with offset.
    pub time: String,
    /// The same instant, milliseconds since the Unix epoch.
    pub unix_ms: u64,
    /// The file's status (`vgpu.status.v1`), `null` when it could not be read.
    pub status: Option<&'a StatusReport>,
    /// Why it could not be read, else `null`.
    pub error: Option<String>,
}

/// Styles for highlights; all plain when not on a colour terminal.
#[derive(Debug, Clone, Copy)]
struct Palette {
    near: Style,
    full: Style,
    dead: Style,
    dim: Style,
}

impl Palette {
    fn new(colour: bool) -> Self {
        if !colour {
            let plain = Style::new();
            return Self {
                near: plain,
                full: plain,
                dead: plain,
                dim: plain,
            };
        }
        Self {
            near: AnsiColor::Yellow.on_default().bold(),
            full: AnsiColor::Red.on_default().bold(),
            dead: AnsiColor::Red.on_default(),
            dim: Style::new().dimmed(),
        }
    }
}

fn paint(style: Style, text: &str) -> String {
    format!("{style}{text}{style:#}")
}

/// How close a device is to its memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// Unlimited, or below [`NEAR_LIMIT_PERCENT`].
    Normal,
    /// At or above [`NEAR_LIMIT_PERCENT`] of the limit.
    Near,
    /// Less than [`FULL_MARGIN`] left: allocations are refused.
    Full,
}

/// The pressure of `used` under `limit`.
pub fn pressure(used: u64, limit: Option<u64>) -> Pressure {
    match limit {
        None | Some(0) => Pressure::Normal,
        Some(l) if used.saturating_add(FULL_MARGIN) > l => Pressure::Full,
        Some(l) if u128::from(used) * 100 >= u128::from(l) * u128::from(NEAR_LIMIT_PERCENT) => {
            Pressure::Near
        }
        Some(_) => Pressure::Normal,
    }
}

/// Bytes in at most 8 characters (three significant digits): `0 B`, `512 KiB`, `1.50 GiB`,
/// `79.6 GiB`, `1021 MiB`; exact multiples without decimals, like `format_bytes`.
pub fn short_bytes(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >= 1u64 << (10 * (unit + 1)) {
        unit += 1;
    }
    let scale = 1u64 << (10 * unit);
    if bytes % scale == 0 {
        return format!("{} {}", bytes / scale, UNITS[unit]);
    }
    let v = bytes as f64 / scale as f64;
    match v {
        v if v < 10.0 => format!("{v:.2} {}", UNITS[unit]),
        v if v < 100.0 => format!("{v:.1} {}", UNITS[unit]),
        v => format!("{v:.0} {}", UNITS[unit]),
    }
}

fn short_limit(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_owned(), short_bytes)
}

fn percent(used: u64, limit: Option<u64>) -> String {
    percent_of(used, limit).map_or_else(|| "-".to_owned(), |p| format!("{p}%"))
}

/// The width of a frame, in columns.
const COLUMNS: usize = 80;

/// `text` in lines of at most [`COLUMNS`] characters, each broken after a space (dropped) or
/// a `/`, so no word and no name in a path is cut unless it alone is wider than a line;
/// continuation lines are indented two spaces.
fn wrap(text: &str) -> String {
    const INDENT: &str = "  ";
    let width = |s: &str| s.trim_end_matches(' ').chars().count();
    let mut lines = Vec::new();
    for source in text.split('\n') {
        let mut line = String::new();
        for piece in source.split_inclusive([' ', '/']) {
            // The line keeps its trailing space: it stands between the line and the piece.
            if !line.trim().is_empty() && line.chars().count() + width(piece) > COLUMNS {
                lines.push(line.trim_end().to_owned());
                line = INDENT.to_owned();
            }
            let mut rest = piece;
            // A piece wider than a whole line is cut where the line ends.
            while line.chars().count() + width(rest) > COLUMNS {
                let room = COLUMNS - line.chars().count();
                let cut = rest.char_indices().nth(room).map_or(rest.len(), |(i, _)| i);
                line.push_str(&rest[..cut]);
                lines.push(std::mem::replace(&mut line, INDENT.to_owned()));
                rest = &rest[cut..];
            }
            line.push_str(rest);
        }
        lines.push(line.trim_end().to_owned());
    }
    lines.join("\n")
}

fn sm_pair(util: u64, limit: Option<u64>) -> String {
    format!(
        "{util}%/{}",
        limit.map_or_else(|| "-".to_owned(), |l| format!("{l}%"))
    )
}

/// Refusals on device `index` since `previous` (the last sample read): none on the first.
fn refusals_since(previous: Option<&StatusReport>, index: u32, now: u64) -> u64 {
    previous
        .and_then(|r| r.devices.iter().find(|d| d.index == index))
        .map_or(0, |d| now.saturating_sub(d.oom_refusals))
}

/// The frame body: devices and processes in at most 80 columns (the UUID on a line of its
/// own), usage near the limit, full devices, refusals since `previous` (the last sample)
/// and dead processes highlighted.
fn render_body(r: &StatusReport, previous: Option<&StatusReport>, p: Palette) -> String {
    let mut out = String::new();
    write_device_rows(
        &mut out,
        &r.devices,
        format_args!(
            "{:>3}  {:>20}  {:>4}  {:>8}  {:>8}  {:>8}  {:>10}",
            "DEV", "MEMORY USED / LIMIT", "USE", "CONTEXT", "MODULE", "DATA", "SM USE/LIM"
        ),
        |out, d| {
            let mem = format!(
                "{} / {}",
                short_bytes(d.memory_used_bytes),
                short_limit(d.memory_limit_bytes)
            );
            let line = format!(
                "{:>3}  {:>20}  {:>4}  {:>8}  {:>8}  {:>8}  {:>10}",
                d.index,
                mem,
                percent(d.memory_used_bytes, d.memory_limit_bytes),
                short_bytes(d.context_bytes),
                short_bytes(d.module_bytes),
                short_bytes(d.data_bytes),
                sm_pair(d.sm_utilization_percent, d.sm_limit_percent),
            );
            let _ = match pressure(d.memory_used_bytes, d.memory_limit_bytes) {
                Pressure::Normal => writeln!(out, "{line}"),
                Pressure::Near => writeln!(out, "{}", paint(p.near, &line)),
                Pressure::Full => writeln!(
                    out,
                    "{}\n     {}",
                    paint(p.full, &line),
                    paint(
                        p.full,
                        "FULL: allocations on this device are refused (out of memory)"
                    )
                ),
            };
            if let Some(u) = &d.uuid {
                let _ = writeln!(out, "     {}", paint(p.dim, &untrusted::text(u)));
            }
            if d.oom_refusals > 0 {
                let refusals = counted(d.oom_refusals, "OOM refusal", "OOM refusals");
                let line = format!("     {refusals} by the limit");
                let _ = match refusals_since(previous, d.index, d.oom_refusals) {
                    0 => writeln!(out, "{line}"),
                    new => writeln!(out, "{}", paint(p.full, &format!("{line} (+{new} new)"))),
                };
            }
            if !d.turns.is_empty() {
                let list = d.turn_limits("*");
                let _ = writeln!(out, "     on the board: {} (* = this file)", list.join(" "));
                // Guarantee-ceiling, then what it gets; whole seconds keep 80 columns.
                for (sh, me) in d.shares("*") {
                    let (lent, borrowed) = sh.lent_borrowed_s();
                    let _ = writeln!(
                        out,
                        "     share{me} {}-{}% prio {}: using {}% part {}% lent {lent:.0}s borrowed {borrowed:.0}s",
                        sh.share_percent,
                        sh.ceiling_percent,
                        sh.priority,
                        sh.utilization_percent,
                        sh.part_percent,
                    );
                }
            }
        },
    );
    if let Some(kept) = r.swap_kept_host_bytes.filter(|&k| k > 0) {
        let _ = writeln!(
            out,
            "kept for swap-outs: {} of pinned host memory beyond the swapped data",
            short_bytes(kept)
        );
    }
    write_process_rows(
        &mut out,
        &r.processes,
        &WATCH_COLUMNS,
        |out, proc, host, d| {
            let kept = kept_on_row(proc, d)
                .map_or_else(String::new, |k| format!("  kept {}", short_bytes(k)));
            let (dev, mem, sm) = match d {
                Some(d) => (
                    d.index.to_string(),
                    short_bytes(d.memory_used_bytes),
                    format!("{}%", d.sm_utilization_percent),
                ),
                None => ("-".into(), "0 B".into(), "-".into()),
            };
            let line = format!(
                "{:>8}  {:>8}  {:<9}  {dev:>3}  {mem:>10}  {sm:>6}{kept}",
                proc.pid, host, proc.state
            );
            let _ = if proc.alive {
                writeln!(out, "{line}")
            } else {
                writeln!(out, "{}", paint(p.dead, &format!("{line}  still counted")))
            };
        },
    );
    out
}

/// `watch`'s process table: short byte counts, to keep 80 columns.
const WATCH_COLUMNS: ProcessColumns = ProcessColumns {
    memory: 10,
    sm: 6,
    sm_title: "SM USE",
};

fn now() -> (i64, u64) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (
        i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
    )
}

/// `vgpu watch`: until Ctrl-C on a terminal; `--count` refreshes (1 by default when stdout is
/// not a terminal, so a pipe or a test never runs forever by accident).
pub fn watch(args: &WatchArgs) -> Result<ExitCode, Failure> {
    let path = args.file.path();
    let tty = std::io::stdout().is_terminal();
    let colour = tty && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let palette = Palette::new(colour);
    let count = args.count.unwrap_or(if tty && !args.json { 0 } else { 1 });
    signals::install_stop_handler();
    let mut out = std::io::stdout();
    let mut frame = 0u64;
    let mut previous: Option<StatusReport> = None;
    loop {
        frame += 1;
        let (secs, ms) = now();
        let read = read(&path);
        let text = if args.json {
            let (status, error) = match &read {
                Ok(r) => (Some(r), None),
                Err(e) => (None, Some(e.clone())),
            };
            let sample = WatchSample {
                schema: SCHEMA,
                time: rfc3339_local(secs),
                unix_ms: ms,
                status,
                error,
            };
            let line = serde_json::to_string(&sample)
                .map_err(|e| Failure::msg(format!("cannot encode a sample: {e}")))?;
            format!("{}\n", untrusted::json(line))
        } else {
            let body = match &read {
                Ok(report) => render_body(report, previous.as_ref(), palette),
                // A file that disappears or is not created yet is worth watching for, not fatal.
                Err(e) => format!("{}\n", wrap(e)),
            };
            let hint = if tty { "  (Ctrl-C to stop)" } else { "" };
            let header = format!(
                "{}  refresh {frame}, every {:?}{hint}\n{}\n\n",
                format_local_time(secs, c"%Y-%m-%d %H:%M:%S %Z"),
                args.interval,
                wrap(&untrusted::text(&path.to_string_lossy()))
            );
            if tty {
                format!("{CLEAR}{header}{body}")
            } else {
                format!("{header}{body}\n")
            }
        };
        previous = read.ok();
        // A closed pipe ends the watch quietly.
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(ExitCode::SUCCESS);
        }
        if (count != 0 && frame >= count) || !signals::sleep_unless_stopped(args.interval) {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample;

    #[test]
    fn frames_fit_80_columns_and_mark_dead_processes() {
        let mut r = sample();
        r.devices[0].uuid = Some("GPU-ffffffff-ffff-ffff-ffff-ffffffffffff".into());
        r.devices[0].memory_used_bytes = (1 << 30) - (3 << 20) - 1;
        r.devices[0].memory_limit_bytes = Some((1 << 40) - 1);
        r.devices[0].context_bytes = (1 << 30) - 1;
        r.devices[0].sm_limit_percent = Some(99);
        r.devices[0].sm_utilization_percent = 100;
        r.devices[0].turns = vec![crate::report::TurnTenantStatus {
            key: "1".into(),
            this_container: true,
            sm_limit_percent: 99,
            launch_us: 47,
            age_ms: 10,
            share: Some(crate::report::ShareStatus {
                share_percent: 100,
                ceiling_percent: 100,
                priority: 1,
                utilization_percent: 100,
                part_percent: 100,
                busy: true,
                lent_ms: 99_999_000,
                borrowed_ms: 99_999_000,
            }),
        }];
        // The widest kept figures, on the container's line and a process's row.
        r.swap_kept_host_bytes = Some((1 << 30) - 1);
        r.processes[0].swap_kept_host_bytes = Some((1 << 30) - 1);
        let text = render_body(&r, None, Palette::new(false));
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{} columns: {line}", line.len());
        }
        assert!(
            text.contains("kept for swap-outs: 1024 MiB of pinned host memory")
                && text.contains("12%  kept 1024 MiB\n"),
            "{text}"
        );
        assert!(text.contains("GPU-ffffffff"), "{text}");
        assert!(text.contains("still counted"), "{text}");
        assert!(
            text.contains("share* 100-100% prio 1: using 100%"),
            "{text}"
        );
        assert!(!text.contains('\x1b'), "{text}");
    }

    /// `status` and `watch` show the same percentage of the limit: floored, so a device is
    /// never shown at 100% before it is full (`status` rounded, `watch` floored).
    #[test]
    fn status_and_watch_agree_on_the_percentage_of_the_limit() {
        let mut r = sample();
        r.devices[0].memory_limit_bytes = Some(1 << 30);
        r.devices[0].memory_used_bytes = (1 << 30) - (1 << 20);
        let status = r.render_text();
        let watch = render_body(&r, None, Palette::new(false));
        assert!(status.contains("(99%)"), "{status}");
        let row = watch
            .lines()
            .find(|l| l.contains("1023 MiB / 1 GiB"))
            .unwrap();
        assert!(row.contains(" 99% "), "{row}");
    }

    /// One refusal is one refusal.
    #[test]
    fn counts_of_one_are_singular() {
        let mut r = sample();
        r.devices[0].oom_refusals = 1;
        r.devices[0].turns = vec![crate::report::TurnTenantStatus {
            key: "1".into(),
            this_container: true,
            sm_limit_percent: 50,
            launch_us: 47,
            age_ms: 10,
            share: None,
        }];
        let status = r.render_text();
        assert!(
            status.contains("device 0: 1 allocation refused by the limit (out of memory)"),
            "{status}"
        );
        assert!(
            status.contains("device 0: 1 limited container on the board: 50% (this one)"),
            "{status}"
        );
        let watch = render_body(&r, None, Palette::new(false));
        assert!(
            watch.contains("     1 OOM refusal by the limit\n"),
            "{watch}"
        );
    }

    #[test]
    fn a_frame_without_devices_says_so_instead_of_a_header() {
        let mut r = sample();
        r.devices.clear();
        let text = render_body(&r, None, Palette::new(false));
        assert!(text.contains("No devices recorded yet"), "{text}");
        assert!(!text.contains("MEMORY USED / LIMIT"), "{text}");
    }

    #[test]
    fn wrap_breaks_lines_between_words_and_after_slashes_only() {
        let path = format!(
            "/usr/local/vgpu/containers/{}_trainer/{}.cache",
            "a".repeat(36),
            "b".repeat(40)
        );
        let long = "x".repeat(200);
        let message = format!("{path} does not exist: no program has run under the hook yet");
        // Its 80th column is the space before `words,`.
        let at_the_edge = format!("{} words, more", "w".repeat(74));
        for text in [path.as_str(), &long, &message, &at_the_edge, "short", ""] {
            let wrapped = wrap(text);
            assert!(
                wrapped.lines().all(|l| l.chars().count() <= COLUMNS),
                "{wrapped}"
            );
            let pieces: Vec<&str> = wrapped.lines().map(str::trim_start).collect();
            let rejoined = pieces.iter().fold(String::new(), |mut all, p| {
                if !all.is_empty() && !all.ends_with('/') && !long.starts_with(&all) {
                    all.push(' ');
                }
                all.push_str(p);
                all
            });
            assert_eq!(rejoined, text, "{wrapped}");
        }
        // Names stay whole: the path breaks after the pod's directory.
        assert_eq!(
            wrap(&path).lines().nth(1).map(str::trim),
            Some(format!("{}.cache", "b".repeat(40)).as_str())
        );
    }

    #[test]
    fn short_bytes_stay_within_8_characters() {
        assert_eq!(short_bytes(100 << 20), "100 MiB");
        assert_eq!(short_bytes(3 << 29), "1.50 GiB");
        assert_eq!(short_bytes(1023 * (1 << 20) + 1), "1023 MiB");
        for b in [0, 1023, (1 << 30) - 1, u64::MAX, 99_999 << 20] {
            assert!(short_bytes(b).len() <= 8, "{}", short_bytes(b));
        }
    }

    #[test]
    fn pressure_marks_near_and_full() {
        let g = 1u64 << 30;
        assert_eq!(pressure(g, None), Pressure::Normal);
        assert_eq!(pressure(g / 2, Some(g)), Pressure::Normal);
        assert_eq!(pressure(g / 100 * 91, Some(g)), Pressure::Near);
        assert_eq!(pressure(g - (1 << 20), Some(g)), Pressure::Full);
        let coloured = render_body(
            &StatusReport {
                devices: vec![crate::report::DeviceStatus {
                    memory_used_bytes: g,
                    ..sample().devices[0].clone()
                }],
                ..sample()
            },
            None,
            Palette::new(true),
        );
        assert!(
            coloured.contains("\x1b[") && coloured.contains("FULL"),
            "{coloured}"
        );
    }

    #[test]
    fn refusals_are_shown_and_marked_when_they_grew_since_the_last_sample() {
        let red_bold = "\x1b[1m\x1b[31m";
        let with = |n| {
            let mut r = sample();
            r.devices[0].oom_refusals = n;
            r
        };
        // None counted: no line.
        let text = render_body(&with(0), None, Palette::new(true));
        assert!(!text.contains("OOM refusals"), "{text}");
        // The first sample shows the count, unmarked: nothing to compare with.
        let text = render_body(&with(3), None, Palette::new(true));
        let line = text
            .lines()
            .find(|l| l.contains("3 OOM refusals by the limit"))
            .unwrap();
        assert!(!line.contains('\x1b'), "{line:?}");
        // Grown since the previous sample: marked, with how many are new.
        let text = render_body(&with(5), Some(&with(3)), Palette::new(true));
        let line = text
            .lines()
            .find(|l| l.contains("5 OOM refusals by the limit"))
            .unwrap();
        assert!(
            line.contains(red_bold) && line.contains("(+2 new)"),
            "{line:?}"
        );
        assert!(line.chars().count() <= 80 + 2 * red_bold.len(), "{line:?}");
        // Unchanged: shown, not marked.
        let text = render_body(&with(5), Some(&with(5)), Palette::new(true));
        let line = text
            .lines()
            .find(|l| l.contains("5 OOM refusals by the limit"))
            .unwrap();
        assert!(!line.contains('\x1b'), "{line:?}");
        // Not on a colour terminal: the note, never an escape code.
        let text = render_body(&with(u64::MAX), Some(&with(0)), Palette::new(false));
        assert!(text.contains("new)") && !text.contains('\x1b'));
        for line in text.lines() {
            assert!(line.chars().count() <= 80, "{line}");
        }
    }
}
