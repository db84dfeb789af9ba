//! `vgpu status`: what a usage file says, as a stable JSON document and as a table.
//!
//! [`StatusReport`] is the one model behind `status`, `watch` and the exporter; it is
//! built from a read-only snapshot of the file (vgpu-shm) and never writes to it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde::Serialize;

use crate::Failure;
use crate::cli::{StatusArgs, UsageFileArgs};
use crate::units::{counted, format_bytes, format_limit, percent_of};
use crate::untrusted;

/// The JSON schema identifier; bumped on any incompatible change (docs/cli.md).
pub const SCHEMA: &str = "vgpu.status.v1";

/// Everything `status` shows about one usage file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StatusReport {
    /// Always [`SCHEMA`].
    pub schema: &'static str,
    /// Path of the usage file.
    pub cache: String,
    /// Devices, by index.
    pub devices: Vec<DeviceStatus>,
    /// Processes registered in the file, live ones and dead ones still counted.
    pub processes: Vec<ProcessStatus>,
    /// When a kernel was last launched under this file (HAMi's `last_kernel_time`), seconds
    /// since the epoch; `null` when none was recorded.
    pub last_kernel_unix_s: Option<u64>,
}

/// One device of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceStatus {
    /// Device index (CUDA ordinal as the processes see it).
    pub index: u32,
    /// NVML UUID, when the file records one.
    pub uuid: Option<String>,
    /// Memory limit in bytes; `null` = unlimited.
    pub memory_limit_bytes: Option<u64>,
    /// Bytes in use by all processes (context + module + data).
    pub memory_used_bytes: u64,
    /// Of which contexts.
    pub context_bytes: u64,
    /// Of which modules (code, globals).
    pub module_bytes: u64,
    /// Of which data allocations.
    pub data_bytes: u64,
    /// Host-backed bytes at this device's addresses (oversubscription, docs/oversubscription.md):
    /// not device memory, so not in `memory_used_bytes`.
    pub host_backed_bytes: u64,
    /// Host-backed bytes allowed beyond the limit (`VGPU_HOST_SPILL`; 0 = none).
    pub host_spill_bytes: u64,
    /// Whether `CUDA_OVERSUBSCRIBE` is on: host memory stands in for device memory the limit
    /// allows but the GPU has no room for (device + host within limit + spill).
    pub oversubscribe: bool,
    /// Reservations on this device the limit refused (the hook answered out of memory),
    /// all processes, since the file was created; 0 in files of libraries before the count.
    pub oom_refusals: u64,
    /// SM limit in percent; `null` = unlimited.
    pub sm_limit_percent: Option<u64>,
    /// Sum of the processes' last reported SM utilization, percent.
    pub sm_utilization_percent: u64,
    /// Limited containers on this GPU's turn board, idle share-mode ones included (empty when
    /// there is no board, or nobody announced within the last second).
    pub turns: Vec<TurnTenantStatus>,
}

/// One container announced on a GPU's turn board.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnTenantStatus {
    /// Its key, in hex (derived from its usage file).
    pub key: String,
    /// Whether it is the container of this usage file.
    pub this_container: bool,
    /// Its SM limit, percent (share mode: its part now); 0: idle (a share-mode container
    /// alive without work, for which no window is laid out).
    pub sm_limit_percent: u32,
    /// Its typical launch length, microseconds (0: not measured yet).
    pub launch_us: u64,
    /// Milliseconds since it last announced itself.
    pub age_ms: u64,
    /// Share mode (`VGPU_SM_MODE=share`): its record on the board; absent in cap mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareStatus>,
}

/// A share-mode container's record on a GPU's turn board (docs/sm-limit.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShareStatus {
    /// Its guaranteed share, percent (0: best effort).
    pub share_percent: u32,
    /// The most it borrows up to, percent.
    pub ceiling_percent: u32,
    /// `CUDA_TASK_PRIORITY` (lower is more urgent: 0 high, 1 low).
    pub priority: i32,
    /// Its achieved utilization, percent.
    pub utilization_percent: u32,
    /// Its part of the GPU now (guarantee plus borrowed), percent.
    pub part_percent: u32,
    /// Whether it has work now.
    pub busy: bool,
    /// GPU time of its guarantee it left to others, milliseconds so far.
    pub lent_ms: u64,
    /// GPU time it used above its guarantee, milliseconds so far.
    pub borrowed_ms: u64,
}

/// One process's use of one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessDevice {
    /// Device index.
    pub index: u32,
    /// Bytes in use (context + module + data).
    pub memory_used_bytes: u64,
    /// Of which context.
    pub context_bytes: u64,
    /// Of which modules.
    pub module_bytes: u64,
    /// Of which data.
    pub data_bytes: u64,
    /// Host-backed bytes at this device's addresses (not in `memory_used_bytes`).
    pub host_backed_bytes: u64,
    /// Last reported SM utilization, percent.
    pub sm_utilization_percent: u64,
}

/// One process registered in the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessStatus {
    /// Pid in the process's own namespace.
    pub pid: i32,
    /// Pid on the host, `null` when unknown.
    pub host_pid: Option<i32>,
    /// Whether the process still exists. A dead one is still counted until the next
    /// reservation or inspection sweeps it.
    pub alive: bool,
    /// `running`, `suspended` or `dead`.
    pub state: &'static str,
    /// Bytes in use over all devices.
    pub memory_used_bytes: u64,
    /// Devices it uses (those with non-zero usage or utilization).
    pub devices: Vec<ProcessDevice>,
}

/// The usage file when none is named: `$CUDA_DEVICE_MEMORY_SHARED_CACHE`, else HAMi's default
/// `/tmp/cudevshr.cache`.
pub fn default_cache_path() -> PathBuf {
    match std::env::var_os(vgpu_env::ENV_SHARED_CACHE) {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(vgpu_env::DEFAULT_SHARED_CACHE),
    }
}

/// The usage file a command reads: `--share NAME`'s group table, else `--cache`, else
/// [`default_cache_path`].
pub fn table_path(file: &UsageFileArgs) -> PathBuf {
    match (&file.share, &file.cache) {
        (Some(name), _) => crate::usage_file::share_path(name),
        (None, Some(p)) => p.clone(),
        (None, None) => default_cache_path(),
    }
}

/// Read `path` into a report; a missing, foreign or corrupt file is an error naming it, and so
/// is anything a tenant may have put there to stop a node-side reader (a symbolic link, a
/// FIFO, a file cut short while read, a read that does not finish in time).
pub fn read(path: &Path) -> Result<StatusReport, String> {
    crate::table::read_report(path)
}

/// Like [`read`], but `Ok(None)` when nothing is at the path (a dangling symbolic link is
/// something: [`read`] refuses it).
pub fn read_if_exists(path: &Path) -> Result<Option<StatusReport>, String> {
    if path.symlink_metadata().is_err() {
        return Ok(None);
    }
    read(path).map(Some)
}

impl ShareStatus {
    /// [`Self::lent_ms`] and [`Self::borrowed_ms`] in seconds, as the tables show them.
    pub(crate) fn lent_borrowed_s(&self) -> (f64, f64) {
        (self.lent_ms as f64 / 1e3, self.borrowed_ms as f64 / 1e3)
    }
}

impl DeviceStatus {
    /// The SM limits of the containers taking turns, this file's container marked `me`, an
    /// idle one (limit 0) as `idle`: `["30%", "70%*", "idle"]`.
    pub(crate) fn turn_limits(&self, me: &str) -> Vec<String> {
        self.turns
            .iter()
            .map(|t| match t.sm_limit_percent {
                0 => format!("idle{}", mark(t, me)),
                pct => format!("{pct}%{}", mark(t, me)),
            })
            .collect()
    }

    /// The share-mode records among them, each with `me` for this file's container, else "".
    pub(crate) fn shares<'a>(
        &'a self,
        me: &'a str,
    ) -> impl Iterator<Item = (&'a ShareStatus, &'a str)> {
        self.turns
            .iter()
            .filter_map(move |t| Some((t.share.as_ref()?, mark(t, me))))
    }
}

/// `me` for this file's container, else "".
fn mark<'a>(t: &TurnTenantStatus, me: &'a str) -> &'a str {
    if t.this_container { me } else { "" }
}

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
                "device {}: {} {} turns: {}",
                d.index,
                counted(n, "limited container", "limited containers"),
                if n == 1 { "takes" } else { "take" },
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
        write_process_rows(
            &mut out,
            &self.processes,
            &STATUS_COLUMNS,
            |out, p, host, d| {
                let note = if p.alive {
                    ""
                } else {
                    "  <- dead, usage still counted until swept"
                };
                let Some(d) = d else {
                    let _ = writeln!(
                        out,
                        "{:>8}  {:>8}  {:<9}  {:>3}  {:>12}  {:>7}{note}",
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
                    "{:>8}  {:>8}  {:<9}  {:>3}  {:>12}  {:>6}%{backed}{note}",
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

    /// The JSON document `vgpu status --json` prints (with what a terminal would act on
    /// escaped, [`untrusted::json`]).
    pub fn render_json(&self) -> String {
        let doc =
            serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
        untrusted::json(doc)
    }
}

/// `vgpu status`.
pub fn status(args: &StatusArgs) -> Result<ExitCode, Failure> {
    let path = table_path(&args.file);
    let report = read(&path)?;
    if args.json {
        println!("{}", report.render_json());
    } else {
        print!("{}", report.render_text());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    // --- reading: what a tenant can do to the node-side readers (issue 12, defect 3) ---

    use std::time::Duration;

    use vgpu_shm::{TableInit, UsageTable};

    /// A private directory (prefix `tag`) holding file `name`, a one-GPU table: 1 GiB, 50%.
    fn table_in(tag: &str, name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = crate::private_tempdir(tag).unwrap();
        let path = dir.path().join(name);
        table_at(&path);
        (dir, path)
    }

    fn table_at(path: &Path) {
        let init = TableInit {
            uuids: vec!["GPU-read".into()],
            memory_limits: vec![Some(1 << 30)],
            sm_limits: vec![Some(50)],
            priority: 1,
        };
        drop(UsageTable::open_or_create(path, &init).unwrap());
    }

    fn mkfifo(path: &Path) {
        let ok = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mkfifo {}", path.display());
    }

    /// `f` on another thread; `None` if it has not returned within `limit` (it hangs).
    fn within<T: Send + 'static>(
        limit: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit).ok()
    }

    const CHILD_ENV: &str = "VGPU_TEST_READ_IN_A_LOOP";

    /// Not a test of its own: the body of the child process of
    /// `read_survives_a_file_truncated_and_restored_meanwhile` (a no-op elsewhere).
    #[test]
    fn read_in_a_loop_child() {
        let Some(path) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        let path = PathBuf::from(path);
        let until = std::time::Instant::now() + Duration::from_secs(8);
        let mut ok = 0u32;
        while std::time::Instant::now() < until {
            if read(&path).is_ok() {
                ok += 1;
            }
        }
        println!("reads that succeeded: {ok}");
    }

    /// A container truncating and restoring its own file while the exporter reads it must not
    /// kill the reader (a mapped reader dies of SIGBUS).
    #[test]
    fn read_survives_a_file_truncated_and_restored_meanwhile() {
        let (_dir, path) = table_in("vgpu-read-trunc", "c.cache");
        let image = std::fs::read(&path).unwrap();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "report::tests::read_in_a_loop_child",
                "--nocapture",
            ])
            .env(CHILD_ENV, &path)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            use std::os::unix::fs::FileExt;
            file.set_len(0).unwrap();
            std::thread::yield_now();
            file.write_all_at(&image, 0).unwrap();
        };
        use std::os::unix::process::ExitStatusExt;
        assert!(
            status.success(),
            "the reader died: {status:?} (signal {:?})",
            status.signal()
        );
    }

    #[test]
    fn a_fifo_at_the_cache_path_is_an_error_not_a_hang() {
        let dir = crate::private_tempdir("vgpu-read-fifo").unwrap();
        let path = dir.path().join("c.cache");
        mkfifo(&path);
        let p = path.clone();
        let got = within(Duration::from_secs(5), move || read(&p));
        let err = got.expect("reading a FIFO hung").unwrap_err();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn a_fifo_in_the_turn_directory_is_skipped_not_a_hang() {
        let (dir, cache) = table_in("vgpu-read-turnfifo", "c.cache");
        mkfifo(&dir.path().join(vgpu_shm::board_file_name("GPU-read")));
        let d = dir.path().to_path_buf();
        let got = within(Duration::from_secs(5), move || {
            crate::table::turn_tenants(&d, "GPU-read", &cache)
        });
        assert_eq!(got.expect("reading a FIFO board hung"), Vec::new());
    }

    #[test]
    fn an_idle_share_mode_container_is_listed_not_busy() {
        // A share-mode container alive without work refreshes its entry with limit 0 and
        // its record with a demand that ran out: listed, idle, not busy. One whose
        // heartbeat is over a second old (a dead writer) is not listed.
        use vgpu_shm::shares::{ShareRecord, write_record};
        let (dir, cache) = table_in("vgpu-read-idle", "c.cache");
        let board = dir.path().join(vgpu_shm::board_file_name("GPU-read"));
        let now = vgpu_shm::monotonic_ns();
        let key = vgpu_shm::container_key(&cache).unwrap();
        let mut b = vgpu_shm::TurnBoard::open_or_create(&board).unwrap();
        b.announce(key, 0, 50_000, now, 1 << 40, 1 << 40).unwrap();
        let record = ShareRecord {
            key,
            share_pct: 30,
            ceiling_pct: 100,
            priority: 0,
            launch_ns: 50_000,
            busy_until: now - 2_000_000_000,
            heartbeat: now,
            ..ShareRecord::default()
        };
        write_record(&b.open_records().unwrap(), b.entry().unwrap(), &record).unwrap();
        let turns = crate::table::turn_tenants(dir.path(), "GPU-read", &cache);
        assert_eq!(turns.len(), 1, "{turns:?}");
        let (t, sh) = (&turns[0], turns[0].share.as_ref().unwrap());
        assert_eq!(
            (t.sm_limit_percent, sh.busy, sh.part_percent),
            (0, false, 0)
        );
        let mut r = sample();
        r.devices[0].turns = turns.clone();
        let text = r.render_text();
        assert!(text.contains("takes turns: idle (this one)"), "{text}");
        assert!(text.contains("priority 0, idle: using 0%"), "{text}");
        // A second later without a heartbeat: gone.
        b.announce(key, 0, 50_000, now - 1_100_000_000, 1 << 40, 1 << 40)
            .unwrap();
        assert!(crate::table::turn_tenants(dir.path(), "GPU-read", &cache).is_empty());
    }

    #[test]
    fn a_symlink_at_the_cache_path_is_refused() {
        let (dir, real) = table_in("vgpu-read-link", "real.cache");
        let link = dir.path().join("c.cache");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(read(&real).is_ok());
        let err = read(&link).unwrap_err();
        assert!(err.contains("symbolic link"), "{err}");
    }

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

    /// A share-mode container's status, as the status and exporter tests show it.
    pub(crate) fn sample_share() -> ShareStatus {
        ShareStatus {
            share_percent: 30,
            ceiling_percent: 80,
            priority: 0,
            utilization_percent: 29,
            part_percent: 30,
            busy: true,
            lent_ms: 1200,
            borrowed_ms: 3400,
        }
    }

    pub(crate) fn sample() -> StatusReport {
        StatusReport {
            schema: SCHEMA,
            cache: "/tmp/x.cache".into(),
            devices: vec![DeviceStatus {
                index: 0,
                uuid: Some("GPU-00000000-0000-0000-0000-000000000001".into()),
                memory_limit_bytes: Some(1 << 30),
                memory_used_bytes: 832 << 20,
                context_bytes: 64 << 20,
                module_bytes: 0,
                data_bytes: 768 << 20,
                host_backed_bytes: 0,
                host_spill_bytes: 0,
                oversubscribe: false,
                oom_refusals: 0,
                sm_limit_percent: Some(50),
                sm_utilization_percent: 12,
                turns: Vec::new(),
            }],
            processes: vec![
                ProcessStatus {
                    pid: 42,
                    host_pid: Some(4242),
                    alive: true,
                    state: "running",
                    memory_used_bytes: 832 << 20,
                    devices: vec![ProcessDevice {
                        index: 0,
                        memory_used_bytes: 832 << 20,
                        context_bytes: 64 << 20,
                        module_bytes: 0,
                        data_bytes: 768 << 20,
                        host_backed_bytes: 0,
                        sm_utilization_percent: 12,
                    }],
                },
                ProcessStatus {
                    pid: 7,
                    host_pid: None,
                    alive: false,
                    state: "dead",
                    memory_used_bytes: 0,
                    devices: vec![],
                },
            ],
            last_kernel_unix_s: Some(1_700_000_000),
        }
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

    #[test]
    fn json_has_the_documented_fields() {
        let v: serde_json::Value = serde_json::from_str(&sample().render_json()).unwrap();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["devices"][0]["memory_limit_bytes"], 1u64 << 30);
        assert_eq!(v["devices"][0]["sm_limit_percent"], 50);
        assert_eq!(v["processes"][0]["host_pid"], 4242);
        assert_eq!(v["processes"][1]["host_pid"], serde_json::Value::Null);
        assert_eq!(v["processes"][1]["alive"], false);
        assert_eq!(v["processes"][0]["devices"][0]["data_bytes"], 768u64 << 20);
    }
}
