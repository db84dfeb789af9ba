//! The CLI's side of vgpu-shm's [`UsageTable`]: a usage file read into the report model
//! (`crate::report`) for `status`, `watch`, the exporter and `vgpu run`'s checks, as a
//! node-side reader must read a file a tenant controls; or opened to write its limits.

use std::path::Path;

use vgpu_env::{ENV_TURN_DIR, SmTuning};
use vgpu_shm::{NodeReader, ShmError, TableSnapshot, UsageTable, board_file_name, container_key};

use crate::report::{
    DeviceStatus, ProcessDevice, ProcessStatus, SCHEMA, ShareStatus, StatusReport, TurnTenantStatus,
};
use crate::untrusted;

/// Explain an attach error in words a user can act on, on one line, with the path (which a
/// tenant may have named) and anything else shown through [`untrusted::text`].
pub fn describe(path: &Path, err: &ShmError) -> String {
    let message = match err {
        ShmError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => format!(
            "{} does not exist: no program has run under the hook with this usage file yet \
             (give another one with --cache or $CUDA_DEVICE_MEMORY_SHARED_CACHE, or a group's with \
             --share NAME; a `vgpu run` job without --share has a private table, named in its note)",
            path.display()
        ),
        ShmError::Io { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            format!("{}: permission denied ({err})", path.display())
        }
        ShmError::InvalidFile { .. } => format!("not a usable vgpu usage file: {err}"),
        _ => err.to_string(),
    };
    untrusted::text(&message).into_owned()
}

/// Build the report from a snapshot.
pub fn report_from_snapshot(cache: &Path, snap: &TableSnapshot) -> StatusReport {
    let devices = snap
        .devices
        .iter()
        .map(|d| DeviceStatus {
            index: d.index,
            uuid: (!d.uuid.is_empty()).then(|| d.uuid.clone()),
            memory_limit_bytes: d.limit,
            memory_used_bytes: d.used,
            context_bytes: d.context,
            module_bytes: d.module,
            data_bytes: d.data,
            host_backed_bytes: d.host,
            host_spill_bytes: d.host_policy.spill,
            oversubscribe: d.host_policy.oversubscribe,
            oom_refusals: d.oom_refusals,
            sm_limit_percent: d.sm_limit,
            sm_utilization_percent: snap
                .processes
                .iter()
                .filter_map(|p| p.devices.get(d.index as usize))
                .map(|u| u.sm_util)
                .fold(0u64, u64::saturating_add),
            turns: Vec::new(),
        })
        .collect();
    let processes = snap
        .processes
        .iter()
        .map(|p| {
            let devices: Vec<ProcessDevice> = p
                .devices
                .iter()
                .enumerate()
                .filter(|(_, u)| u.total() > 0 || u.host > 0 || u.sm_util > 0)
                .map(|(i, u)| ProcessDevice {
                    index: i as u32,
                    memory_used_bytes: u.total(),
                    context_bytes: u.context,
                    module_bytes: u.module,
                    data_bytes: u.data,
                    host_backed_bytes: u.host,
                    sm_utilization_percent: u.sm_util,
                })
                .collect();
            ProcessStatus {
                pid: p.pid,
                host_pid: (p.hostpid != 0).then_some(p.hostpid),
                alive: p.alive,
                state: match (p.alive, p.suspended, p.swapped_out) {
                    (false, _, _) => "dead",
                    (true, true, _) => "suspended",
                    (true, false, true) => "swapped",
                    (true, false, false) => "running",
                },
                memory_used_bytes: devices
                    .iter()
                    .map(|d| d.memory_used_bytes)
                    .fold(0, u64::saturating_add),
                swap_kept_host_bytes: p.kept_host,
                devices,
            }
        })
        .collect();
    StatusReport {
        schema: SCHEMA,
        cache: cache.display().to_string(),
        devices,
        processes,
        last_kernel_unix_s: (snap.last_kernel_time != 0).then_some(snap.last_kernel_time),
        swap_kept_host_bytes: snap.kept_host,
    }
}

/// The containers announced on the turn board of the GPU `uuid` in `dir` within the last
/// second, read-only and bounded in time ([`NodeReader`]: the directory is every container's);
/// empty when there is no readable board.
pub fn turn_tenants(dir: &Path, uuid: &str, cache: &Path) -> Vec<TurnTenantStatus> {
    let now = vgpu_shm::monotonic_ns();
    let Ok(tenants) =
        NodeReader::default().turn_tenants(dir.join(board_file_name(uuid)), now, 1_000_000_000)
    else {
        return Vec::new();
    };
    let mine = container_key(cache).ok();
    // Share-mode records (VGPU_SM_MODE=share), read the same way; none in cap mode.
    let shares = NodeReader::default()
        .share_records(dir.join(board_file_name(uuid)))
        .unwrap_or_default();
    tenants
        .into_iter()
        .map(|t| TurnTenantStatus {
            key: format!("{:016x}", t.key),
            this_container: mine == Some(t.key),
            sm_limit_percent: t.limit_pct,
            launch_us: t.launch_ns / 1_000,
            age_ms: now.saturating_sub(t.heartbeat_ns) / 1_000_000,
            share: shares.iter().find(|r| r.key == t.key).map(|r| ShareStatus {
                share_percent: u32::from(r.share_pct),
                ceiling_percent: u32::from(r.ceiling_pct),
                priority: r.priority,
                utilization_percent: u32::from(r.util_pct),
                part_percent: u32::from(r.allot_pct),
                busy: r.busy_until >= now,
                lent_ms: r.lent_ns / 1_000_000,
                borrowed_ms: r.borrowed_ns / 1_000_000,
            }),
        })
        .collect()
}

/// Read the usage file at `path` into a report, read-only (never sweeps or writes), as a
/// node-side reader must read a file a tenant controls: copied with `pread`, never mapped, no
/// link followed, no FIFO waited on, bounded in time ([`NodeReader`]). A missing, foreign or
/// corrupt file is an error naming it, and so is anything a tenant may have put there to stop
/// the reader (a symbolic link, a FIFO, a file cut short while read, a read that does not
/// finish in time). A file written by HAMi-core itself is decoded from its region alone.
/// Each device also lists the containers on its turn board (in `$VGPU_TURN_DIR`, default
/// `/tmp/vgpulock`).
pub fn read(path: &Path) -> Result<StatusReport, String> {
    let mut report = NodeReader::default()
        .table(path)
        .map(|snap| report_from_snapshot(path, &snap))
        .map_err(|e| describe(path, &e))?;
    let dir = SmTuning::turn_dir_of(std::env::var(ENV_TURN_DIR).ok().as_deref());
    if let Some(dir) = dir {
        for d in &mut report.devices {
            if let Some(uuid) = &d.uuid {
                d.turns = turn_tenants(Path::new(&dir), uuid, path);
            }
        }
    }
    Ok(report)
}

/// Like [`read`], but `Ok(None)` when nothing is at the path (a dangling symbolic link is
/// something: [`read`] refuses it).
pub fn read_if_exists(path: &Path) -> Result<Option<StatusReport>, String> {
    if path.symlink_metadata().is_err() {
        return Ok(None);
    }
    read(path).map(Some)
}

/// Open a usage file for writing limits.
pub fn open_writable(path: &Path) -> Result<UsageTable, String> {
    UsageTable::open_existing(path).map_err(|e| describe(path, &e))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::report::tests::sample;
    use std::path::PathBuf;
    use vgpu_shm::{ProcessDeviceUsage, ProcessSnapshot};

    #[test]
    fn process_states_follow_liveness_and_hami_status() {
        let process = |pid, alive, suspended, swapped_out| ProcessSnapshot {
            slot: 0,
            hami_index: 0,
            pid,
            hostpid: 0,
            start_time: 0,
            alive,
            suspended,
            swapped_out,
            kept_host: None,
            devices: vec![ProcessDeviceUsage::default()],
        };
        let snap = TableSnapshot {
            devices: Vec::new(),
            processes: vec![
                process(1, true, false, false),
                process(2, true, true, false),
                process(3, false, false, false),
                process(4, true, false, true),
                process(5, false, false, true),
            ],
            proc_num: 5,
            priority: 1,
            recent_kernel: 0,
            utilization_switch: 0,
            last_kernel_time: 0,
            kept_host: None,
        };
        let r = report_from_snapshot(Path::new("/x.cache"), &snap);
        let states: Vec<_> = r.processes.iter().map(|p| (p.state, p.alive)).collect();
        assert_eq!(
            states,
            [
                ("running", true),
                ("suspended", true),
                ("dead", false),
                ("swapped", true),
                ("dead", false)
            ]
        );
    }

    // --- reading: what a tenant can do to the node-side readers (issue 12, defect 3) ---

    use std::time::Duration;

    use vgpu_shm::{TableInit, UsageTable};

    /// A private directory (prefix `tag`) holding file `name`, a one-GPU table: 1 GiB, 50%.
    pub(crate) fn table_in(tag: &str, name: &str) -> (tempfile::TempDir, PathBuf) {
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
                "usage_table::tests::read_in_a_loop_child",
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
            turn_tenants(&d, "GPU-read", &cache)
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
        let turns = turn_tenants(dir.path(), "GPU-read", &cache);
        assert_eq!(turns.len(), 1, "{turns:?}");
        let (t, sh) = (&turns[0], turns[0].share.as_ref().unwrap());
        assert_eq!(
            (t.sm_limit_percent, sh.busy, sh.part_percent),
            (0, false, 0)
        );
        let mut r = sample();
        r.devices[0].turns = turns.clone();
        let text = r.render_text();
        assert!(text.contains("on the board: idle (this one)"), "{text}");
        assert!(text.contains("priority 0, idle: using 0%"), "{text}");
        // A second later without a heartbeat: gone.
        b.announce(key, 0, 50_000, now - 1_100_000_000, 1 << 40, 1 << 40)
            .unwrap();
        assert!(turn_tenants(dir.path(), "GPU-read", &cache).is_empty());
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
}
