//! The metrics page: HAMi's families (names and labels exactly as HAMi's monitor serves them,
//! `cmd/vGPUmonitor/metrics.go`), optionally its legacy names, and vgpu's own richer families.
//!
//! Invariants: every sample follows its family's `# HELP`/`# TYPE`, and each series appears
//! once; every string a tenant controls (a file name, a UUID, a pod's names) reaches the page
//! as a label value or a comment escaped by [`crate::untrusted`], so no line can be forged or
//! broken; a limit that means "unlimited" produces no limit sample (so `used / limit` has no
//! series rather than +Inf); a container's usage counts only processes that are alive (a
//! killed container drops to 0, what the GPU really holds), while vgpu's own `dead` families
//! show what dead processes still hold in the file.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;

use super::pods::Identity;
use crate::report::{DeviceStatus, StatusReport};
use crate::untrusted;

/// What the page includes besides vgpu's own families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// HAMi's `hami_*` families (for its dashboard).
    pub hami: bool,
    /// HAMi's pre-2.6 names (`vGPU_device_memory_usage_in_bytes`, ...).
    pub legacy: bool,
    /// One series per process (`vgpu_process_*`): many series on busy nodes, so opt-in.
    pub per_process: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            hami: true,
            legacy: false,
            per_process: false,
        }
    }
}

/// One usage file as read at one scrape.
#[derive(Debug, Clone)]
pub struct Scraped {
    /// Its path.
    pub cache: String,
    /// Its pod and container, when it lies in the device plugins' layout.
    pub identity: Option<Identity>,
    /// The report, or why it could not be read.
    pub result: Result<StatusReport, String>,
}

/// Which set a family belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Set {
    Vgpu,
    PerProcess,
    Hami,
    Legacy,
}

/// Families in output order: set, name, type, help.
const FAMILIES: &[(Set, &str, &str, &str)] = &[
    (
        Set::Vgpu,
        "vgpu_build_info",
        "gauge",
        "Always 1; the exporter's version.",
    ),
    (
        Set::Vgpu,
        "vgpu_up",
        "gauge",
        "1 if the usage file was read, 0 if it is missing or invalid.",
    ),
    (
        Set::Vgpu,
        "vgpu_scrape_errors_total",
        "counter",
        "Failed reads of the usage file since the exporter started.",
    ),
    (
        Set::Vgpu,
        "vgpu_exporter_files",
        "gauge",
        "Usage files matched by the glob at this scrape.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_memory_limit_bytes",
        "gauge",
        "Device memory limit in bytes (no sample when unlimited).",
    ),
    (
        Set::Vgpu,
        "vgpu_device_memory_used_bytes",
        "gauge",
        "Device memory the file counts against the limit (dead processes included until swept), bytes.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_memory_class_bytes",
        "gauge",
        "Device memory counted by class (context, module, data), bytes.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_host_backed_bytes",
        "gauge",
        "Host memory standing in for device memory at the device's addresses \
         (CUDA_OVERSUBSCRIBE, VGPU_HOST_SPILL), bytes; not in the device memory figures.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_host_spill_bytes",
        "gauge",
        "Host-backed bytes allowed beyond the limit (VGPU_HOST_SPILL; 0 = none).",
    ),
    (
        Set::Vgpu,
        "vgpu_swap_kept_host_bytes",
        "gauge",
        "Pinned host memory the container's processes keep for swap-outs beyond their swapped \
         data (VGPU_SWAP_KEEP_HOST), bytes; the swapped data is in vgpu_device_host_backed_bytes \
         (no sample for a usage file of a library that does not say).",
    ),
    (
        Set::Vgpu,
        "vgpu_device_oom_refusals_total",
        "counter",
        "Allocations on the device the memory limit refused (out of memory), all processes, \
         since the usage file was created.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_memory_dead_bytes",
        "gauge",
        "Device memory still counted for processes that no longer exist, bytes.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_dead_processes",
        "gauge",
        "Processes that no longer exist but are still counted on the device.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_limit_percent",
        "gauge",
        "SM (compute) limit in percent (no sample when unlimited).",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_utilization_percent",
        "gauge",
        "Sum of the processes' SM utilization, percent.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_processes",
        "gauge",
        "Processes registered in the file using the device.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_turn_containers",
        "gauge",
        "Limited containers on the GPU's turn board, idle share-mode ones included (0 = none).",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_share_percent",
        "gauge",
        "Share mode: the container's guaranteed SM share, percent (label priority: CUDA_TASK_PRIORITY, 0 = high).",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_ceiling_percent",
        "gauge",
        "Share mode: the most the container borrows up to, percent.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_part_percent",
        "gauge",
        "Share mode: the container's part of the GPU now (guarantee plus borrowed), percent.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_lent_milliseconds_total",
        "counter",
        "Share mode: GPU time of the container's guarantee left to others, milliseconds.",
    ),
    (
        Set::Vgpu,
        "vgpu_device_sm_borrowed_milliseconds_total",
        "counter",
        "Share mode: GPU time the container used above its guarantee, milliseconds.",
    ),
    (
        Set::PerProcess,
        "vgpu_process_memory_used_bytes",
        "gauge",
        "Device memory in use by one process, bytes.",
    ),
    (
        Set::PerProcess,
        "vgpu_process_sm_utilization_percent",
        "gauge",
        "SM utilization of one process on one device, percent.",
    ),
    (
        Set::PerProcess,
        "vgpu_process_alive",
        "gauge",
        "1 if the process exists, 0 if it is dead but still counted.",
    ),
    (
        Set::PerProcess,
        "vgpu_process_swapped_out",
        "gauge",
        "1 while the process has its movable device memory swapped out to host memory.",
    ),
    (
        Set::PerProcess,
        "vgpu_process_swap_kept_host_bytes",
        "gauge",
        "Pinned host memory one process keeps for swap-outs beyond its swapped data, bytes.",
    ),
    (
        Set::Hami,
        "hami_vgpu_memory_used_bytes",
        "gauge",
        "vGPU device memory usage in bytes",
    ),
    (
        Set::Hami,
        "hami_vgpu_memory_limit_bytes",
        "gauge",
        "vGPU device memory limit in bytes",
    ),
    (
        Set::Hami,
        "hami_container_device_memory_bytes",
        "gauge",
        "Container device memory usage in bytes",
    ),
    (
        Set::Hami,
        "hami_container_device_utilization_ratio",
        "gauge",
        "Container device SM utilization ratio",
    ),
    (
        Set::Hami,
        "hami_container_last_kernel_elapsed_seconds",
        "gauge",
        "Seconds since last kernel execution in container",
    ),
    (
        Set::Hami,
        "hami_vgpu_memory_context_bytes",
        "gauge",
        "Container device memory context size in bytes",
    ),
    (
        Set::Hami,
        "hami_vgpu_memory_module_bytes",
        "gauge",
        "Container device memory module size in bytes",
    ),
    (
        Set::Hami,
        "hami_vgpu_memory_buffer_bytes",
        "gauge",
        "Container device memory buffer size in bytes",
    ),
    (
        Set::Legacy,
        "vGPU_device_memory_usage_in_bytes",
        "gauge",
        "vGPU device usage",
    ),
    (
        Set::Legacy,
        "vGPU_device_memory_limit_in_bytes",
        "gauge",
        "vGPU device limit",
    ),
    (
        Set::Legacy,
        "Device_memory_desc_of_container",
        "gauge",
        "Container device memory description",
    ),
    (
        Set::Legacy,
        "Device_utilization_desc_of_container",
        "gauge",
        "Container device utilization description",
    ),
    (
        Set::Legacy,
        "Device_last_kernel_of_container",
        "gauge",
        "Container device last kernel description",
    ),
];

/// HAMi's monitor registers its collector with a constant `zone="vGPU"` label.
const HAMI_ZONE: (&str, &str) = ("zone", "vGPU");

/// HAMi's names for what both generations of its container families say: the labels
/// (namespace, pod, container, device index, device UUID) and four families.
struct HamiNames {
    labels: [&'static str; 5],
    memory_used: &'static str,
    memory_limit: &'static str,
    utilization: &'static str,
    last_kernel: &'static str,
}

/// Today's names (the `hami_*` families).
const HAMI_NAMES: HamiNames = HamiNames {
    labels: [
        "namespace",
        "pod",
        "container",
        "vdevice_index",
        "device_uuid",
    ],
    memory_used: "hami_vgpu_memory_used_bytes",
    memory_limit: "hami_vgpu_memory_limit_bytes",
    utilization: "hami_container_device_utilization_ratio",
    last_kernel: "hami_container_last_kernel_elapsed_seconds",
};

/// The pre-2.6 names (`--legacy-metrics`).
const LEGACY_NAMES: HamiNames = HamiNames {
    labels: [
        "podnamespace",
        "podname",
        "ctrname",
        "vdeviceid",
        "deviceuuid",
    ],
    memory_used: "vGPU_device_memory_usage_in_bytes",
    memory_limit: "vGPU_device_memory_limit_in_bytes",
    utilization: "Device_utilization_desc_of_container",
    last_kernel: "Device_last_kernel_of_container",
};

/// One container on one device, as both generations of HAMi's families report it.
struct ContainerDevice<'a> {
    id: &'a Identity,
    index: &'a str,
    uuid: &'a str,
    used: u64,
    limit: Option<u64>,
    utilization: u64,
    /// Seconds since its last kernel, when one was recorded.
    last_kernel: Option<u64>,
}

impl<'a> ContainerDevice<'a> {
    /// Its labels under `names`, with [`HAMI_ZONE`].
    fn labels(&self, names: &HamiNames) -> [(&'static str, &'a str); 6] {
        let [ns, pod, ctr, idx, dev] = names.labels;
        [
            (ns, self.id.namespace.as_str()),
            (pod, self.id.pod.as_str()),
            (ctr, self.id.container.as_str()),
            (idx, self.index),
            (dev, self.uuid),
            HAMI_ZONE,
        ]
    }

    /// Adds the four families both generations have, under `names`; returns the labels, for
    /// the families only one of them has.
    fn add_common(&self, s: &mut Samples, names: &HamiNames) -> [(&'static str, &'a str); 6] {
        let l = self.labels(names);
        s.add(names.memory_used, &l, self.used);
        if let Some(limit) = self.limit {
            s.add(names.memory_limit, &l, limit);
        }
        s.add(names.utilization, &l, self.utilization);
        if let Some(secs) = self.last_kernel {
            s.add(names.last_kernel, &l, secs);
        }
        l
    }
}

/// A label value as the exposition format writes it: first made safe ([`untrusted::text`]:
/// a file name or UUID is a tenant's), then its backslashes, quotes and line ends escaped.
fn label_value(v: &str) -> String {
    untrusted::text(v)
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Samples collected per family name, each series once: HAMi's families name a container's
/// GPU without the file, so two usage files in one container's directory (a tenant's copy of
/// its own) would give one series twice; the first file in path order wins, and the page says
/// how many were dropped.
#[derive(Debug, Default)]
struct Samples {
    by_family: BTreeMap<&'static str, Vec<String>>,
    series: HashSet<String>,
    duplicates: usize,
}

impl Samples {
    fn add(&mut self, name: &'static str, labels: &[(&str, &str)], value: u64) {
        let mut line = String::from(name);
        if !labels.is_empty() {
            line.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    line.push(',');
                }
                let _ = write!(line, "{k}=\"{}\"", label_value(v));
            }
            line.push('}');
        }
        if !self.series.insert(line.clone()) {
            self.duplicates += 1;
            return;
        }
        let _ = write!(line, " {value}");
        self.by_family.entry(name).or_default().push(line);
    }
}

/// Live processes' memory on device `d` (what the GPU holds for this container now).
fn live_used(report: &StatusReport, d: &DeviceStatus) -> (u64, u64, u64, u64) {
    let mut sum = (0u64, 0u64, 0u64, 0u64);
    for pd in report
        .processes
        .iter()
        .filter(|p| p.alive)
        .flat_map(|p| p.devices.iter().filter(|pd| pd.index == d.index))
    {
        sum.0 = sum.0.saturating_add(pd.memory_used_bytes);
        sum.1 = sum.1.saturating_add(pd.context_bytes);
        sum.2 = sum.2.saturating_add(pd.module_bytes);
        sum.3 = sum.3.saturating_add(pd.data_bytes);
    }
    sum
}

fn hami_samples(
    s: &mut Samples,
    opts: Options,
    id: &Identity,
    report: &StatusReport,
    now_unix: u64,
) {
    for d in &report.devices {
        // HAMi skips a device whose UUID is not recorded yet, and keeps 40 characters of it.
        let Some(uuid) = d.uuid.as_deref().filter(|u| !u.is_empty()) else {
            continue;
        };
        let uuid: String = uuid.chars().take(40).collect();
        let index = d.index.to_string();
        let (used, context, module, data) = live_used(report, d);
        let last_kernel = report
            .last_kernel_unix_s
            .map(|t| now_unix.saturating_sub(t));
        let c = ContainerDevice {
            id,
            index: &index,
            uuid: &uuid,
            used,
            limit: d.memory_limit_bytes,
            utilization: d.sm_utilization_percent,
            last_kernel,
        };
        if opts.hami {
            let l = c.add_common(s, &HAMI_NAMES);
            s.add("hami_container_device_memory_bytes", &l, used);
            s.add("hami_vgpu_memory_context_bytes", &l, context);
            s.add("hami_vgpu_memory_module_bytes", &l, module);
            s.add("hami_vgpu_memory_buffer_bytes", &l, data);
        }
        if opts.legacy {
            let l = c.add_common(s, &LEGACY_NAMES);
            let offset = used.saturating_sub(context + module + data).to_string();
            let (c, m, b) = (context.to_string(), module.to_string(), data.to_string());
            let mut desc = l.to_vec();
            desc.extend([
                ("context", c.as_str()),
                ("module", m.as_str()),
                ("data", b.as_str()),
                ("offset", offset.as_str()),
            ]);
            s.add("Device_memory_desc_of_container", &desc, used);
        }
    }
}

fn vgpu_samples(s: &mut Samples, opts: Options, base: &[(&str, &str)], report: &StatusReport) {
    for d in &report.devices {
        let index = d.index.to_string();
        let mut l = base.to_vec();
        l.extend([
            ("device", index.as_str()),
            ("uuid", d.uuid.as_deref().unwrap_or("")),
        ]);
        if let Some(limit) = d.memory_limit_bytes {
            s.add("vgpu_device_memory_limit_bytes", &l, limit);
        }
        s.add("vgpu_device_memory_used_bytes", &l, d.memory_used_bytes);
        for (class, v) in [
            ("context", d.context_bytes),
            ("module", d.module_bytes),
            ("data", d.data_bytes),
        ] {
            let mut lc = l.clone();
            lc.push(("class", class));
            s.add("vgpu_device_memory_class_bytes", &lc, v);
        }
        s.add("vgpu_device_host_backed_bytes", &l, d.host_backed_bytes);
        s.add("vgpu_device_host_spill_bytes", &l, d.host_spill_bytes);
        s.add("vgpu_device_oom_refusals_total", &l, d.oom_refusals);
        let on_device = |alive: bool| {
            report
                .processes
                .iter()
                .filter(move |p| p.alive == alive)
                .filter_map(|p| p.devices.iter().find(|pd| pd.index == d.index))
        };
        let dead_bytes = on_device(false)
            .map(|pd| pd.memory_used_bytes)
            .fold(0, u64::saturating_add);
        s.add("vgpu_device_memory_dead_bytes", &l, dead_bytes);
        s.add(
            "vgpu_device_dead_processes",
            &l,
            on_device(false).count() as u64,
        );
        if let Some(sm) = d.sm_limit_percent {
            s.add("vgpu_device_sm_limit_percent", &l, sm);
        }
        s.add(
            "vgpu_device_sm_utilization_percent",
            &l,
            d.sm_utilization_percent,
        );
        let users = on_device(true).count() + on_device(false).count();
        s.add("vgpu_device_processes", &l, users as u64);
        s.add("vgpu_device_turn_containers", &l, d.turns.len() as u64);
        let share = d
            .turns
            .iter()
            .filter(|t| t.this_container)
            .find_map(|t| t.share.as_ref());
        if let Some(sh) = share {
            let priority = sh.priority.to_string();
            let mut lp = l.clone();
            lp.push(("priority", priority.as_str()));
            s.add(
                "vgpu_device_sm_share_percent",
                &lp,
                u64::from(sh.share_percent),
            );
            s.add(
                "vgpu_device_sm_ceiling_percent",
                &l,
                u64::from(sh.ceiling_percent),
            );
            s.add(
                "vgpu_device_sm_part_percent",
                &l,
                u64::from(sh.part_percent),
            );
            s.add("vgpu_device_sm_lent_milliseconds_total", &l, sh.lent_ms);
            s.add(
                "vgpu_device_sm_borrowed_milliseconds_total",
                &l,
                sh.borrowed_ms,
            );
        }
    }
    // A tenant's own figure: shown as it says it, never used for anything.
    if let Some(kept) = report.swap_kept_host_bytes {
        s.add("vgpu_swap_kept_host_bytes", base, kept);
    }
    if !opts.per_process {
        return;
    }
    for p in &report.processes {
        let pid = p.pid.to_string();
        let host = p.host_pid.map_or_else(String::new, |h| h.to_string());
        let mut pl = base.to_vec();
        pl.extend([("pid", pid.as_str()), ("host_pid", host.as_str())]);
        s.add("vgpu_process_alive", &pl, u64::from(p.alive));
        s.add(
            "vgpu_process_swapped_out",
            &pl,
            u64::from(p.state == "swapped"),
        );
        if let Some(kept) = p.swap_kept_host_bytes {
            s.add("vgpu_process_swap_kept_host_bytes", &pl, kept);
        }
        for d in &p.devices {
            let index = d.index.to_string();
            let mut l = pl.clone();
            l.push(("device", index.as_str()));
            s.add("vgpu_process_memory_used_bytes", &l, d.memory_used_bytes);
            s.add(
                "vgpu_process_sm_utilization_percent",
                &l,
                d.sm_utilization_percent,
            );
        }
    }
}

/// Render the Prometheus text format (0.0.4) for the scraped files at `now_unix`.
pub fn render(
    scraped: &[Scraped],
    errors_total: &BTreeMap<String, u64>,
    glob_error: Option<&str>,
    opts: Options,
    now_unix: u64,
) -> String {
    let mut s = Samples::default();
    s.add(
        "vgpu_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1,
    );
    s.add("vgpu_exporter_files", &[], scraped.len() as u64);
    for f in scraped {
        // A container's file also carries its pod labels, for joins with HAMi's families.
        let mut base = vec![("cache", f.cache.as_str())];
        if let Some(id) = &f.identity {
            base.extend([
                ("namespace", id.namespace.as_str()),
                ("pod", id.pod.as_str()),
                ("container", id.container.as_str()),
                ("pod_uid", id.pod_uid.as_str()),
            ]);
        }
        s.add("vgpu_up", &base, u64::from(f.result.is_ok()));
        s.add(
            "vgpu_scrape_errors_total",
            &base,
            errors_total.get(&f.cache).copied().unwrap_or(0),
        );
        let Ok(report) = &f.result else { continue };
        vgpu_samples(&mut s, opts, &base, report);
        // HAMi's families exist only for containers (its monitor knows nothing else).
        if let Some(id) = &f.identity {
            hami_samples(&mut s, opts, id, report, now_unix);
        }
    }
    // Comments are ignored by Prometheus but visible to a person reading the page; what a
    // tenant named is escaped, so a comment stays one line.
    let mut out = String::new();
    if let Some(e) = glob_error {
        let _ = writeln!(out, "# glob error: {}", untrusted::text(e));
    }
    for f in scraped {
        if let Err(e) = &f.result {
            let _ = writeln!(
                out,
                "# error reading {}: {}",
                untrusted::text(&f.cache),
                untrusted::text(e)
            );
        }
    }
    if s.duplicates > 0 {
        let _ = writeln!(
            out,
            "# {} duplicate series dropped (more than one usage file for one container's GPU)",
            s.duplicates
        );
    }
    for (set, name, kind, help) in FAMILIES {
        let included = match set {
            Set::Vgpu => true,
            Set::PerProcess => opts.per_process,
            Set::Hami => opts.hami,
            Set::Legacy => opts.legacy,
        };
        if !included {
            continue;
        }
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for line in s.by_family.get(name).into_iter().flatten() {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}
