//! The adapter between vgpu-shm's [`UsageTable`] and the CLI's report model: a read-only
//! snapshot for `status`/`watch`/the exporter, and the limit setters for `set-limit`.

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
                state: match (p.alive, p.suspended) {
                    (false, _) => "dead",
                    (true, true) => "suspended",
                    (true, false) => "running",
                },
                memory_used_bytes: devices
                    .iter()
                    .map(|d| d.memory_used_bytes)
                    .fold(0, u64::saturating_add),
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

/// Read a usage file into a report, read-only (never sweeps or writes), as a node-side reader
/// must read a file a tenant controls: copied with `pread`, never mapped, no link followed, no
/// FIFO waited on, bounded in time ([`NodeReader`]). A file written by HAMi-core itself is
/// decoded from its region alone. Each device also lists the containers
/// on its turn board (in `$VGPU_TURN_DIR`, default `/tmp/vgpulock`).
pub fn read_report(path: &Path) -> Result<StatusReport, String> {
    let mut report = read_usage(path)?;
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

fn read_usage(path: &Path) -> Result<StatusReport, String> {
    NodeReader::default()
        .table(path)
        .map(|snap| report_from_snapshot(path, &snap))
        .map_err(|e| describe(path, &e))
}

/// Open a usage file for writing limits.
pub fn open_writable(path: &Path) -> Result<UsageTable, String> {
    UsageTable::open_existing(path).map_err(|e| describe(path, &e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_shm::{ProcessDeviceUsage, ProcessSnapshot};

    #[test]
    fn process_states_follow_liveness_and_hami_status() {
        let process = |pid, alive, suspended| ProcessSnapshot {
            slot: 0,
            hami_index: 0,
            pid,
            hostpid: 0,
            start_time: 0,
            alive,
            suspended,
            devices: vec![ProcessDeviceUsage::default()],
        };
        let snap = TableSnapshot {
            devices: Vec::new(),
            processes: vec![
                process(1, true, false),
                process(2, true, true),
                process(3, false, false),
            ],
            proc_num: 3,
            priority: 1,
            recent_kernel: 0,
            utilization_switch: 0,
            last_kernel_time: 0,
        };
        let r = report_from_snapshot(Path::new("/x.cache"), &snap);
        let states: Vec<_> = r.processes.iter().map(|p| (p.state, p.alive)).collect();
        assert_eq!(
            states,
            [("running", true), ("suspended", true), ("dead", false)]
        );
    }
}
