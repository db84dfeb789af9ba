//! `vgpu status`: what a usage file says, as the JSON document (`crate::report`) or as a
//! table; the table's device and process rows are shared with `vgpu watch`.

use std::fmt::Write as _;
use std::process::ExitCode;

use crate::Failure;
use crate::cli::StatusArgs;
use crate::report::{DeviceStatus, ProcessDevice, ProcessStatus, StatusReport};
use crate::units::{counted, format_bytes, format_limit, percent_of};
use crate::untrusted;
use crate::usage_table;

/// What `status` and `watch` say of a file no process has used a GPU under yet.
const NO_DEVICES: &str = "No devices recorded yet (no process has used a GPU under this file).";

/// The device table `status` and `watch` begin with: [`NO_DEVICES`], or `header` and then
/// what `row` writes for each device.
pub(crate) fn write_device_rows(
    out: &mut String,
    devices: &[DeviceStatus],
    header: std::fmt::Arguments<'_>,
    mut row: impl FnMut(&mut String, &DeviceStatus),
) {
    if devices.is_empty() {
        let _ = writeln!(out, "{NO_DEVICES}");
        return;
    }
    let _ = writeln!(out, "{header}");
    for d in devices {
        row(out, d);
    }
}

/// The widths of the process table's last two columns (memory, then SM) and the SM column's
/// title: `status` and `watch` share the columns, each at its own widths.
pub(crate) struct ProcessColumns {
    pub memory: usize,
    pub sm: usize,
    pub sm_title: &'static str,
}

/// `status`'s process table: full byte counts.
const STATUS_COLUMNS: ProcessColumns = ProcessColumns {
    memory: 12,
    sm: 7,
    sm_title: "SM UTIL",
};

/// The process table `status` and `watch` end with, after a blank line: "No processes.", or
/// the header of `columns` and then
/// per process one row per device it uses (a process using none still gets one, its device
/// `None`). `row` writes a row, given the process, its host PID ("-" when unknown) and the
/// device.
pub(crate) fn write_process_rows(
    out: &mut String,
    processes: &[ProcessStatus],
    columns: &ProcessColumns,
    mut row: impl FnMut(&mut String, &ProcessStatus, &str, Option<&ProcessDevice>),
) {
    let _ = writeln!(out);
    if processes.is_empty() {
        let _ = writeln!(out, "No processes.");
        return;
    }
    let _ = writeln!(
        out,
        "{:>8}  {:>8}  {:<9}  {:>3}  {:>memory$}  {:>sm$}",
        "PID",
        "HOST PID",
        "STATE",
        "DEV",
        "MEMORY",
        columns.sm_title,
        memory = columns.memory,
        sm = columns.sm,
    );
    for p in processes {
        let host = p.host_pid.map_or_else(|| "-".to_owned(), |h| h.to_string());
        if p.devices.is_empty() {
            row(out, p, &host, None);
        }
        for d in &p.devices {
            row(out, p, &host, Some(d));
        }
    }
}

/// The pinned host memory process `p` keeps for swap-outs, on the first of its rows (`d`
/// its device, `None` for a process using none) when there is any: it is the process's, not
/// a device's, so it is said once; a dead process keeps none (its memory went with it).
pub(crate) fn kept_on_row(p: &ProcessStatus, d: Option<&ProcessDevice>) -> Option<u64> {
    let first = d.is_none_or(|d| p.devices.first().is_some_and(|f| std::ptr::eq(f, d)));
    p.swap_kept_host_bytes
        .filter(|&kept| p.alive && first && kept > 0)
}

/// The line `status` says the container's kept host memory in, if it keeps any.
fn kept_line(kept: Option<u64>) -> Option<String> {
    kept.filter(|&k| k > 0).map(|k| {
        format!(
            "host memory kept for swap-outs: {} pinned beyond the swapped data \
             (VGPU_SWAP_KEEP_HOST)",
            format_bytes(k)
        )
    })
}

fn pct(used: u64, limit: Option<u64>) -> String {
    percent_of(used, limit).map_or_else(String::new, |p| format!(" ({p}%)"))
}

fn opt_pct(p: Option<u64>) -> String {
    p.map_or_else(|| "unlimited".to_owned(), |p| format!("{p}%"))
}

impl StatusReport {
    /// The table `vgpu status` prints; the file's path and UUIDs through [`untrusted::text`].
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "vgpu status: {}", untrusted::text(&self.cache));
        let _ = writeln!(out);
        write_device_rows(
            &mut out,
            &self.devices,
            format_args!(
                "{:>3}  {:>28}  {:>10}  {:>10}  {:>10}  {:>9}  {:>7}  UUID",
                "DEV", "MEMORY USED / LIMIT", "CONTEXT", "MODULE", "DATA", "SM LIMIT", "SM UTIL",
            ),
            |out, d| {
                let mem = format!(
                    "{} / {}{}",
                    format_bytes(d.memory_used_bytes),
                    format_limit(d.memory_limit_bytes),
                    pct(d.memory_used_bytes, d.memory_limit_bytes)
                );
                let _ = writeln!(
                    out,
                    "{:>3}  {:>28}  {:>10}  {:>10}  {:>10}  {:>9}  {:>6}%  {}",
                    d.index,
                    mem,
                    format_bytes(d.context_bytes),
                    format_bytes(d.module_bytes),
                    format_bytes(d.data_bytes),
                    opt_pct(d.sm_limit_percent),
                    d.sm_utilization_percent,
                    untrusted::text(d.uuid.as_deref().unwrap_or("-")),
                );
            },
        );
        for d in self
            .devices
            .iter()
            .filter(|d| d.host_backed_bytes > 0 || d.oversubscribe || d.host_spill_bytes > 0)
            .collect::<Vec<_>>()
        {
            let mut how = Vec::new();
            if d.oversubscribe {
                how.push("oversubscribed (CUDA_OVERSUBSCRIBE)".to_owned());
            }
            if d.host_spill_bytes > 0 {
                how.push(format!(
                    "{} allowed past the limit (VGPU_HOST_SPILL)",
                    format_bytes(d.host_spill_bytes)
                ));
            }
            let _ = writeln!(
                out,
                "device {}: {} host-backed, not device memory: {}",
                d.index,
                format_bytes(d.host_backed_bytes),
                how.join(", ")
            );
        }
        for d in self.devices.iter().filter(|d| d.oom_refusals > 0) {
            let _ = writeln!(
                out,
                "device {}: {} refused by the limit (out of memory)",
                d.index,
                counted(d.oom_refusals, "allocation", "allocations")
            );
        }
        for d in self.devices.iter().filter(|d| !d.turns.is_empty()) {
            let list = d.turn_limits(" (this one)");
            let n = d.turns.len() as u64;
            let _ = writeln!(
                out,
                "device {}: {} on the board: {}",
                d.index,
                counted(n, "limited container", "limited containers"),
                list.join(", ")
            );
            for (sh, me) in d.shares(" (this one)") {
                let (lent, borrowed) = sh.lent_borrowed_s();
                let _ = writeln!(
                    out,
                    "device {}: share mode{me}: {}% share, ceiling {}%, priority {}, {}: \
                     using {}%, part {}%, lent {lent:.1} s, borrowed {borrowed:.1} s",
                    d.index,
                    sh.share_percent,
                    sh.ceiling_percent,
                    sh.priority,
                    if sh.busy { "busy" } else { "idle" },
                    sh.utilization_percent,
                    sh.part_percent,
                );
            }
        }
        if let Some(line) = kept_line(self.swap_kept_host_bytes) {
            let _ = writeln!(out, "{line}");
        }
        write_process_rows(
            &mut out,
            &self.processes,
            &STATUS_COLUMNS,
            |out, p, host, d| {
                let kept = kept_on_row(p, d).map_or_else(String::new, |k| {
                    format!("  + {} kept for swap-outs", format_bytes(k))
                });
                let note = if p.alive {
                    ""
                } else {
                    "  <- dead, usage still counted until swept"
                };
                let Some(d) = d else {
                    let _ = writeln!(
                        out,
                        "{:>8}  {:>8}  {:<9}  {:>3}  {:>12}  {:>7}{kept}{note}",
                        p.pid, host, p.state, "-", "0 B", "-"
                    );
                    return;
                };
                let backed = if d.host_backed_bytes > 0 {
                    format!("  + {} host-backed", format_bytes(d.host_backed_bytes))
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "{:>8}  {:>8}  {:<9}  {:>3}  {:>12}  {:>6}%{backed}{kept}{note}",
                    p.pid,
                    host,
                    p.state,
                    d.index,
                    format_bytes(d.memory_used_bytes),
                    d.sm_utilization_percent
                );
            },
        );
        out
    }
}

/// `vgpu status`.
pub fn status(args: &StatusArgs) -> Result<ExitCode, Failure> {
    let report = usage_table::read(&args.file.path())?;
    if args.json {
        println!("{}", report.render_json());
    } else {
        print!("{}", report.render_text());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::{sample, sample_share};
    use crate::report::{ShareStatus, TurnTenantStatus};
    use crate::usage_table::read;
    use crate::usage_table::tests::table_in;
    use vgpu_shm::UsageTable;

    /// Host-backed bytes are shown as their own figure in the text, the JSON and the
    /// exporter, and never added into device memory.
    #[test]
    fn host_backed_bytes_are_shown_apart_from_device_memory() {
        use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
        let (_dir, path) = table_in("vgpu-read-host", "t.cache");
        let t = UsageTable::open_existing(&path).unwrap();
        let d0 = DeviceIndex(0);
        t.set_host_policy(
            d0,
            vgpu_shm::HostPolicy {
                spill: 2 << 30,
                oversubscribe: true,
            },
        )
        .unwrap();
        let me = t.register_self().unwrap();
        me.try_reserve(d0, UsageClass::Data, 512 << 20).unwrap();
        me.try_reserve_host(d0, 256 << 20).unwrap();
        let report = read(&path).unwrap();
        let d = &report.devices[0];
        assert_eq!(
            (
                d.memory_used_bytes,
                d.host_backed_bytes,
                d.host_spill_bytes,
                d.oversubscribe
            ),
            (512 << 20, 256 << 20, 2 << 30, true)
        );
        assert_eq!(report.processes[0].devices[0].host_backed_bytes, 256 << 20);
        let text = report.render_text();
        assert!(
            text.contains("device 0: 256 MiB host-backed, not device memory: oversubscribed")
                && text.contains("2 GiB allowed past the limit (VGPU_HOST_SPILL)")
                && text.contains("+ 256 MiB host-backed"),
            "{text}"
        );
        let json: serde_json::Value = serde_json::from_str(&report.render_json()).unwrap();
        assert_eq!(json["devices"][0]["host_backed_bytes"], 256u64 << 20);
        assert_eq!(json["devices"][0]["memory_used_bytes"], 512u64 << 20);
        let scraped = crate::exporter::Scraped {
            cache: path.display().to_string(),
            identity: None,
            result: Ok(report),
        };
        let metrics = crate::exporter::render::render(
            &[scraped],
            &Default::default(),
            None,
            crate::exporter::Options::default(),
            0,
        );
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("vgpu_device_host_backed_bytes{")
                    && l.ends_with(&format!(" {}", 256u64 << 20))),
            "{metrics}"
        );
    }

    /// The host memory kept for swap-outs is said once for the container and once per
    /// process (on its first row), and only where there is some.
    #[test]
    fn host_memory_kept_for_swap_outs_is_said_once_per_container_and_process() {
        let mut r = sample();
        let text = r.render_text();
        assert!(!text.contains("kept for swap-outs"), "none kept: {text}");
        r.swap_kept_host_bytes = Some(48 << 20);
        r.processes[0].swap_kept_host_bytes = Some(48 << 20);
        let second = ProcessDevice {
            index: 1,
            ..r.processes[0].devices[0].clone()
        };
        r.processes[0].devices.push(second);
        let text = r.render_text();
        assert!(
            text.contains(
                "host memory kept for swap-outs: 48 MiB pinned beyond the swapped data \
                 (VGPU_SWAP_KEEP_HOST)"
            ),
            "{text}"
        );
        let rows: Vec<&str> = text.lines().filter(|l| l.contains("4242")).collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(rows[0].ends_with("  + 48 MiB kept for swap-outs"), "{text}");
        assert!(!rows[1].contains("kept"), "{text}");
    }

    #[test]
    fn text_shows_limits_usage_and_dead_processes() {
        let text = sample().render_text();
        assert!(text.contains("832 MiB / 1 GiB (81%)"), "{text}");
        assert!(text.contains("50%"), "{text}");
        assert!(text.contains("4242") && text.contains("running"), "{text}");
        assert!(
            text.contains("dead") && text.contains("still counted"),
            "{text}"
        );
    }

    #[test]
    fn a_file_without_devices_says_so_instead_of_a_header() {
        let mut r = sample();
        r.devices.clear();
        let text = r.render_text();
        assert!(text.contains(NO_DEVICES), "{text}");
        assert!(!text.contains("MEMORY USED / LIMIT"), "{text}");
        assert!(
            text.contains("4242"),
            "the processes are still listed: {text}"
        );
    }

    #[test]
    fn share_mode_containers_get_a_line_and_json_fields() {
        let mut r = sample();
        let turn = |me: bool, share: Option<ShareStatus>| TurnTenantStatus {
            key: "1".into(),
            this_container: me,
            sm_limit_percent: 30,
            launch_us: 47,
            age_ms: 10,
            share,
        };
        r.devices[0].turns = vec![turn(true, Some(sample_share())), turn(false, None)];
        let text = r.render_text();
        assert!(
            text.contains(
                "share mode (this one): 30% share, ceiling 80%, priority 0, busy: using 29%, \
                 part 30%, lent 1.2 s, borrowed 3.4 s"
            ),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(&r.render_json()).unwrap();
        assert_eq!(v["devices"][0]["turns"][0]["share"]["borrowed_ms"], 3400);
        assert!(
            v["devices"][0]["turns"][1].get("share").is_none(),
            "absent in cap mode"
        );
    }
}
