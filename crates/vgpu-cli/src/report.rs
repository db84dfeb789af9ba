//! The versioned JSON model of a usage file: [`StatusReport`] (schema [`SCHEMA`]) is the one
//! model behind `status`, `watch` and the exporter, built from a read-only snapshot of the
//! file (`crate::usage_table`) and never written back. docs/cli.md documents its fields;
//! an incompatible change bumps the schema.

use serde::Serialize;

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
    /// Pinned host memory the container's processes keep for their swap-outs beyond their
    /// swapped data (`VGPU_SWAP_KEEP_HOST`, docs/swap.md "Host memory"; the swapped data
    /// itself is `host_backed_bytes`), bytes; `null` when the file does not say (a library
    /// before extension minor 5, a HAMi-core file). What a tenant wrote: shown, never used.
    pub swap_kept_host_bytes: Option<u64>,
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
    /// `running`, `suspended`, `swapped` (its movable device memory is swapped out to host
    /// memory, shown as host-backed bytes, until its next call that can touch device memory;
    /// docs/swap.md) or `dead`.
    pub state: &'static str,
    /// Bytes in use over all devices.
    pub memory_used_bytes: u64,
    /// Pinned host memory it keeps for its swap-outs beyond its swapped data, bytes (0 once
    /// dead); `null` when it does not say (its library, or the file's, is older).
    pub swap_kept_host_bytes: Option<u64>,
    /// Devices it uses (those with non-zero usage or utilization).
    pub devices: Vec<ProcessDevice>,
}

impl ShareStatus {
    /// [`Self::lent_ms`] and [`Self::borrowed_ms`] in seconds, as the tables show them.
    pub(crate) fn lent_borrowed_s(&self) -> (f64, f64) {
        (self.lent_ms as f64 / 1e3, self.borrowed_ms as f64 / 1e3)
    }
}

impl DeviceStatus {
    /// The parts of the containers on the GPU's board, this file's container marked `me`, an
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

impl StatusReport {
    /// The JSON document `vgpu status --json` prints (with what a terminal would act on
    /// escaped, [`untrusted::json`]).
    pub fn render_json(&self) -> String {
        let doc =
            serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
        untrusted::json(doc)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
                    swap_kept_host_bytes: Some(0),
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
                    swap_kept_host_bytes: Some(0),
                    devices: vec![],
                },
            ],
            last_kernel_unix_s: Some(1_700_000_000),
            swap_kept_host_bytes: Some(0),
        }
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
        assert_eq!(v["swap_kept_host_bytes"], 0);
        assert_eq!(v["processes"][0]["swap_kept_host_bytes"], 0);
        let mut older = sample();
        older.swap_kept_host_bytes = None;
        let v: serde_json::Value = serde_json::from_str(&older.render_json()).unwrap();
        assert_eq!(
            v["swap_kept_host_bytes"],
            serde_json::Value::Null,
            "not said: null"
        );
    }
}
