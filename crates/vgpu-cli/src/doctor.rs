//! `vgpu doctor`: is enforcement really in effect here? Each check ends in a plain-words
//! verdict; the exit code is 1 when any check fails.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use serde::Serialize;
use vgpu_env::{Config, Vars};

use crate::Failure;
use crate::cli::{DoctorArgs, RunDriver};
use crate::cuda::Library;
use crate::hook_env::{HookSetup, hook_env, library_path_with, make_sim_link_dir};
use crate::limits::MemoryFlag;
use crate::locate::{self, Found};
use crate::report;
use crate::units::{format_bytes, format_limit};
use crate::usage_table;
use crate::workload::WorkloadProcess;

/// The limit the mechanism probe runs under: room for a large GPU's context (a few hundred
/// MiB, counted against the limit), and not the physical total of any current GPU.
pub const PROBE_LIMIT: u64 = 1536 << 20;

/// The JSON schema identifier of `doctor --json` (docs/cli.md).
pub const SCHEMA: &str = "vgpu.doctor.v1";

/// HAMi's device plugin sets this to `true` when `deviceMemoryScaling > 1` (memory
/// oversubscription; docs/oversubscription.md).
pub const ENV_OVERSUBSCRIBE: &str = vgpu_env::ENV_OVERSUBSCRIBE;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Fine.
    Ok,
    /// Works, but something deserves attention.
    Warn,
    /// Enforcement is not (fully) in effect.
    Fail,
    /// Could not be checked because an earlier check failed.
    Skip,
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Short name.
    pub name: &'static str,
    /// Outcome.
    pub verdict: Verdict,
    /// What was found, in plain words.
    pub detail: String,
}

fn check(name: &'static str, verdict: Verdict, detail: impl Into<String>) -> Check {
    Check {
        name,
        verdict,
        detail: detail.into(),
    }
}

impl Check {
    /// One line for the terminal (more when the detail has several).
    pub fn render(&self) -> String {
        let tag = match self.verdict {
            Verdict::Ok => "[ ok ]",
            Verdict::Warn => "[warn]",
            Verdict::Fail => "[FAIL]",
            Verdict::Skip => "[skip]",
        };
        let detail = self.detail.replace('\n', "\n                         ");
        format!("{tag} {:<16} {detail}", self.name)
    }
}

fn check_hook(lib: Option<&Path>) -> (Check, Option<Found>) {
    let found = match locate::find_hook(lib) {
        Ok(f) => f,
        Err(e) => return (check("libvgpu.so", Verdict::Fail, e), None),
    };
    let c = match Library::open(&found.path.display().to_string()) {
        Err(e) => check(
            "libvgpu.so",
            Verdict::Fail,
            format!(
                "{} ({}) does not load: {e}",
                found.path.display(),
                found.how
            ),
        ),
        Ok(l) => {
            // Defined by the library itself (dlsym on a handle also searches its
            // dependencies, where libc's dlsym lives).
            let missing: Vec<&str> = ["cuMemAlloc_v2", "cuGetProcAddress", "dlsym"]
                .into_iter()
                .filter(|s| l.file_of(s).as_deref() != Some(found.path.as_path()))
                .collect();
            if missing.is_empty() {
                check(
                    "libvgpu.so",
                    Verdict::Ok,
                    format!(
                        "{} ({}) loads and exports the driver API",
                        found.path.display(),
                        found.how
                    ),
                )
            } else {
                check(
                    "libvgpu.so",
                    Verdict::Fail,
                    format!(
                        "{} loads but does not export {}: not a vgpu hook library",
                        found.path.display(),
                        missing.join(", ")
                    ),
                )
            }
        }
    };
    (c, Some(found))
}

/// Whether the hook is preloaded for programs started from here.
fn check_preload(hook: Option<&Found>) -> (Check, bool) {
    let env = std::env::var("LD_PRELOAD").unwrap_or_default();
    let etc = std::fs::read_to_string("/etc/ld.so.preload").unwrap_or_default();
    let mut entries: Vec<(String, &str)> = locate::preload_entries(&env)
        .into_iter()
        .map(|e| (e, "LD_PRELOAD"))
        .collect();
    entries.extend(
        locate::preload_entries(&etc)
            .into_iter()
            .map(|e| (e, "/etc/ld.so.preload")),
    );
    if entries.is_empty() {
        return (
            check(
                "preload",
                Verdict::Warn,
                "libvgpu.so is in neither LD_PRELOAD nor /etc/ld.so.preload: programs started from here are \
                 NOT limited unless started with `vgpu run`",
            ),
            false,
        );
    }
    let mut notes = Vec::new();
    let mut verdict = Verdict::Ok;
    for (entry, source) in &entries {
        let path = Path::new(entry);
        if !path.is_file() {
            verdict = Verdict::Fail;
            notes.push(format!("{source} names {entry}, which does not exist: the loader skips it and nothing is limited"));
        } else if let Some(h) = hook {
            let same = path.canonicalize().ok().as_deref() == Some(h.path.as_path());
            notes.push(format!(
                "{source} preloads {entry}{}",
                if same {
                    ""
                } else {
                    " (a different file than the one vgpu found; check versions)"
                }
            ));
            if !same && verdict == Verdict::Ok {
                verdict = Verdict::Warn;
            }
        } else {
            notes.push(format!("{source} preloads {entry}"));
        }
    }
    (
        check("preload", verdict, notes.join("\n")),
        verdict != Verdict::Fail,
    )
}

/// `sim_links`: the directory serving the simulated driver under the driver's names
/// (`--driver simulated`), where `soname` is opened instead of the loader's search.
fn check_driver(
    name: &'static str,
    soname: &str,
    required: bool,
    sim_links: Option<&Path>,
) -> (Check, bool) {
    let target = sim_links.map_or_else(
        || soname.to_owned(),
        |d| d.join(soname).display().to_string(),
    );
    match Library::open(&target) {
        Ok(l) => {
            let path = l.path().unwrap_or_else(|| PathBuf::from(soname));
            let simulated = path.file_name().is_some_and(|n| n == locate::SIM_NAME);
            if simulated && sim_links.is_some() {
                (
                    check(
                        name,
                        Verdict::Ok,
                        format!(
                            "{soname} is the simulated driver {} (--driver simulated)",
                            path.display()
                        ),
                    ),
                    true,
                )
            } else if simulated {
                (
                    check(
                        name,
                        Verdict::Warn,
                        format!(
                            "{soname} is the SIMULATED driver {}: no real GPU here",
                            path.display()
                        ),
                    ),
                    true,
                )
            } else {
                (
                    check(
                        name,
                        Verdict::Ok,
                        format!("{soname} found: {}", path.display()),
                    ),
                    true,
                )
            }
        }
        Err(e) => {
            let what = if required {
                "no CUDA program can run here, limited or not (without a GPU, `--driver simulated` checks against the simulated driver; `vgpu demo` and `vgpu run --driver simulated` use it)"
            } else {
                "NVML views (nvidia-smi, nvmlDeviceGetMemoryInfo) cannot be virtualized"
            };
            (
                check(
                    name,
                    if required {
                        Verdict::Fail
                    } else {
                        Verdict::Warn
                    },
                    format!("{soname} not loadable ({e}): {what}"),
                ),
                false,
            )
        }
    }
}

fn check_environment() -> (Check, Option<Config>) {
    match Config::from_vars(&Vars::from_os(std::env::vars_os())) {
        Err(e) => (
            check(
                "environment",
                Verdict::Fail,
                format!("the hook would reject this environment: {e}"),
            ),
            None,
        ),
        Ok(cfg) => {
            let limits: Vec<String> = cfg
                .memory_limit
                .iter()
                .enumerate()
                .filter_map(|(i, l)| l.map(|b| format!("device {i}: {}", format_bytes(b))))
                .collect();
            let by_uuid: Vec<String> = cfg
                .limits_by_uuid
                .iter()
                .map(|l| match l.limit {
                    vgpu_env::UuidLimit::Memory(m) => format!(
                        "{}: {}",
                        l.uuid,
                        m.map_or_else(|| "unlimited".to_owned(), format_bytes)
                    ),
                    vgpu_env::UuidLimit::Sm(p) => format!(
                        "{}: SM {}",
                        l.uuid,
                        p.map_or_else(|| "unlimited".to_owned(), |p| format!("{p}%"))
                    ),
                })
                .collect();
            let c = if !cfg.notices.is_empty() {
                check("environment", Verdict::Warn, cfg.notices.join("; "))
            } else if limits.is_empty() && !by_uuid.is_empty() {
                check(
                    "environment",
                    Verdict::Ok,
                    format!(
                        "memory and SM limits by GPU UUID ({}); usage file {}",
                        by_uuid.join(", "),
                        cfg.shared_cache
                    ),
                )
            } else if limits.is_empty() {
                check(
                    "environment",
                    Verdict::Warn,
                    "no memory limit configured (CUDA_DEVICE_MEMORY_LIMIT unset or 0)",
                )
            } else {
                let shown = if limits.len() > 3 {
                    format!("{} (and {} more)", limits[..3].join(", "), limits.len() - 3)
                } else {
                    limits.join(", ")
                };
                let uuids = if by_uuid.is_empty() {
                    String::new()
                } else {
                    format!(", by GPU UUID {}", by_uuid.join(", "))
                };
                check(
                    "environment",
                    Verdict::Ok,
                    format!(
                        "memory limits {shown}{uuids}; usage file {}",
                        cfg.shared_cache
                    ),
                )
            };
            (c, Some(cfg))
        }
    }
}

/// Host backing (`CUDA_OVERSUBSCRIBE`, `VGPU_HOST_SPILL`), when either is set: what the hook
/// will do, and whether the host lets it pin (docs/oversubscription.md). A warning when
/// neither switch turns anything on, or when the container's memory cgroup leaves less than
/// [`HOST_HEADROOM_WARN`] to pin.
fn check_oversubscribe() -> Option<Check> {
    let over = std::env::var(ENV_OVERSUBSCRIBE).ok();
    let spill = std::env::var(vgpu_env::ENV_HOST_SPILL).ok();
    if over.is_none() && spill.is_none() {
        return None;
    }
    let pairs = [
        (ENV_OVERSUBSCRIBE, &over),
        (vgpu_env::ENV_HOST_SPILL, &spill),
    ];
    // The shared file's path too: it says which plugin set the switch.
    let cache = std::env::var(vgpu_env::ENV_SHARED_CACHE).ok();
    let vars = vgpu_env::Vars::from_pairs(
        pairs
            .iter()
            .chain([(vgpu_env::ENV_SHARED_CACHE, &cache)].iter())
            .filter_map(|(k, v)| v.as_ref().map(|v| (*k, v.as_str()))),
    );
    let set: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
        .collect();
    let set = set.join(" ");
    let (backing, layout) = match vgpu_env::Config::from_vars(&vars) {
        Ok(c) => (c.host_backing, c.layout),
        Err(e) => return Some(check("oversubscribe", Verdict::Fail, format!("{set}: {e}"))),
    };
    if !backing.enabled() && !layout.oversubscribe_means_memory() {
        return Some(check(
            "oversubscribe",
            Verdict::Ok,
            format!(
                "{set}: set by {} for core scaling (deviceCoreScaling > 1), not memory: host \
                 backing stays off, as under HAMi-core ({} turns it on)",
                layout.describe(),
                vgpu_env::ENV_HOST_SPILL
            ),
        ));
    }
    if !backing.enabled() {
        return Some(check(
            "oversubscribe",
            Verdict::Warn,
            format!(
                "{set}: host backing is off; allocations past the GPU or the limit are refused"
            ),
        ));
    }
    let mut what = Vec::new();
    if backing.oversubscribe {
        what.push(
            "what the limit allows but the GPU has no room for is backed by host memory, and              programs see a device as large as the limit"
                .to_owned(),
        );
    }
    if backing.spill > 0 {
        what.push(format!(
            "up to {} of host memory past the limit",
            crate::units::format_bytes(backing.spill)
        ));
    }
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let headroom = read("/proc/self/cgroup")
        .and_then(|c| vgpu_env::host_limits::cgroup_memory_files(&c))
        .and_then(|(max, cur)| vgpu_env::host_limits::cgroup_headroom(&read(&max)?, &read(&cur)?));
    let memlock =
        read("/proc/self/limits").and_then(|l| vgpu_env::host_limits::memlock_soft_limit(&l));
    let show = |v: Option<u64>| v.map_or("unlimited".to_owned(), crate::units::format_bytes);
    let verdict = match headroom {
        Some(h) if h < HOST_HEADROOM_WARN => Verdict::Warn,
        _ => Verdict::Ok,
    };
    Some(check(
        "oversubscribe",
        verdict,
        format!(
            "{set}: {}; the host lets it pin: memory cgroup headroom {}, RLIMIT_MEMLOCK {} (past              them an allocation fails with CUDA_ERROR_OUT_OF_MEMORY)",
            what.join("; "),
            show(headroom),
            show(memlock)
        ),
    ))
}

/// Less cgroup headroom than this for pinned host memory is worth a warning.
const HOST_HEADROOM_WARN: u64 = 1 << 30;

/// What `doctor --json` prints.
#[derive(Debug, Serialize)]
pub struct DoctorReport<'a> {
    /// Always [`SCHEMA`].
    pub schema: &'static str,
    /// No check failed.
    pub ok: bool,
    /// Whether libvgpu.so is preloaded for programs started here.
    pub preloaded: bool,
    /// The verdict line of the text output.
    pub verdict: &'a str,
    /// Every check, in order.
    pub checks: &'a [Check],
}

fn check_cache(path: &Path) -> (Check, Option<report::StatusReport>) {
    match usage_table::read_if_exists(path) {
        Ok(None) => (
            check(
                "usage file",
                Verdict::Ok,
                format!(
                    "{} not created yet (the first program under the hook creates it)",
                    crate::untrusted::path(path)
                ),
            ),
            None,
        ),
        Err(e) => (
            check(
                "usage file",
                Verdict::Fail,
                format!(
                    "{e}\nprograms using it will fail to register; remove it when no process uses it"
                ),
            ),
            None,
        ),
        Ok(Some(r)) => {
            let limits: Vec<String> = r
                .devices
                .iter()
                .map(|d| format!("device {}: {}", d.index, format_limit(d.memory_limit_bytes)))
                .collect();
            let dead = r.processes.iter().filter(|p| !p.alive).count();
            let detail = format!(
                "{} valid: {} device(s) [{}], {} process(es){}",
                crate::untrusted::path(path),
                r.devices.len(),
                limits.join(", "),
                r.processes.len(),
                if dead > 0 {
                    format!(", {dead} dead but still counted")
                } else {
                    String::new()
                }
            );
            (
                check(
                    "usage file",
                    if dead > 0 { Verdict::Warn } else { Verdict::Ok },
                    detail,
                ),
                Some(r),
            )
        }
    }
}

/// What a probe program under the hook saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    /// `cuDeviceTotalMem_v2`.
    pub device_total: u64,
    /// `cuMemGetInfo_v2` total.
    pub info_total: u64,
    /// `cuMemGetInfo_v2` free.
    pub info_free: u64,
    /// The file `dlsym(libcuda, "cuMemAlloc_v2")` resolved into.
    pub alloc_from: String,
}

/// Run `vgpu workload` with `configure` and ask it for the device's totals.
pub fn probe(configure: impl FnOnce(&mut Command)) -> Result<ProbeResult, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the vgpu binary: {e}"))?;
    let mut w = WorkloadProcess::spawn(&exe, configure, false)?;
    let init = w.send("init")?;
    if !init.ok() {
        return Err(format!(
            "the probe could not initialize CUDA: {}",
            init.line
        ));
    }
    let total = w.send("total")?;
    let info = w.send("info")?;
    let _ = w.finish();
    let (Some(device_total), Some(info_total), Some(info_free)) =
        (total.num("bytes"), info.num("total"), info.num("free"))
    else {
        return Err(format!(
            "the probe's driver calls failed: {} / {}",
            total.line, info.line
        ));
    };
    Ok(ProbeResult {
        device_total,
        info_total,
        info_free,
        alloc_from: init.get("alloc_from").unwrap_or("").to_owned(),
    })
}

/// Put the simulated driver's directory first on `cmd`'s `LD_LIBRARY_PATH`, if there is one.
fn serve_sim(cmd: &mut Command, sim_links: Option<&Path>) {
    if let Some(d) = sim_links {
        cmd.env("LD_LIBRARY_PATH", library_path_with(d));
    }
}

fn check_mechanism(hook: &Found, sim_links: Option<&Path>) -> Check {
    let tmp = match crate::private_tempdir("vgpu-doctor-") {
        Ok(t) => t,
        Err(e) => {
            return check(
                "probe (hook)",
                Verdict::Fail,
                format!("cannot create a temporary directory: {e}"),
            );
        }
    };
    let cache = tmp.path().join("probe.cache");
    let env = match hook_env(&HookSetup {
        hook: &hook.path,
        memory: &[MemoryFlag {
            device: None,
            bytes: PROBE_LIMIT,
        }],
        sm: &[],
        cache: Some(&cache),
    }) {
        Ok(e) => e,
        Err(e) => return check("probe (hook)", Verdict::Fail, e.message),
    };
    match probe(|cmd| {
        env.apply(cmd);
        serve_sim(cmd, sim_links);
    }) {
        Err(e) => check("probe (hook)", Verdict::Fail, e),
        Ok(p) if p.device_total == PROBE_LIMIT && p.info_total == PROBE_LIMIT => check(
            "probe (hook)",
            Verdict::Ok,
            format!(
                "a program under the hook with a {} limit sees cuDeviceTotalMem {} and cuMemGetInfo total {}",
                format_bytes(PROBE_LIMIT),
                format_bytes(p.device_total),
                format_bytes(p.info_total)
            ),
        ),
        Ok(p) => check(
            "probe (hook)",
            Verdict::Fail,
            format!(
                "the hook does not virtualize memory: under a {} limit the program saw cuDeviceTotalMem {} and \
                 cuMemGetInfo total {} (cuMemAlloc_v2 resolved into {})",
                format_bytes(PROBE_LIMIT),
                format_bytes(p.device_total),
                format_bytes(p.info_total),
                if p.alloc_from.is_empty() {
                    "?"
                } else {
                    &p.alloc_from
                }
            ),
        ),
    }
}

/// The probe in this environment as it is: does a program started here see its limit?
fn check_here(
    cfg: &Config,
    file: Option<&report::StatusReport>,
    sim_links: Option<&Path>,
) -> Check {
    // Limits stored in the file win over the environment.
    let expected = file
        .and_then(|r| r.devices.iter().find(|d| d.index == 0))
        .map_or(cfg.memory_limit[0], |d| d.memory_limit_bytes);
    let p = match probe(|cmd| serve_sim(cmd, sim_links)) {
        Ok(p) => p,
        Err(e) => return check("probe (here)", Verdict::Fail, e),
    };
    match expected {
        None => check(
            "probe (here)",
            Verdict::Warn,
            format!(
                "device 0 has no memory limit here; a program sees {}",
                format_bytes(p.device_total)
            ),
        ),
        Some(limit)
            if p.device_total == limit
                || p.device_total < limit && p.info_total == p.device_total =>
        {
            check(
                "probe (here)",
                Verdict::Ok,
                format!(
                    "a program started here sees device 0 as {} (limit {})",
                    format_bytes(p.device_total),
                    format_bytes(limit)
                ),
            )
        }
        Some(limit) => check(
            "probe (here)",
            Verdict::Fail,
            format!(
                "a program started here sees device 0 as {}, not its limit {}: the preload is not in effect",
                format_bytes(p.device_total),
                format_bytes(limit)
            ),
        ),
    }
}

/// `vgpu doctor`.
pub fn doctor(args: &DoctorArgs) -> Result<ExitCode, Failure> {
    let mut checks = Vec::new();
    let text = !args.json;
    let emit = |c: Check, checks: &mut Vec<Check>| {
        if text {
            println!("{}", c.render());
        }
        checks.push(c);
    };
    let (c, hook) = check_hook(args.lib.as_deref());
    let hook_ok = c.verdict == Verdict::Ok;
    emit(c, &mut checks);
    let (c, preloaded) = check_preload(hook.as_ref());
    emit(c, &mut checks);
    // --driver simulated: the simulated driver served as libcuda.so.1 from a private
    // directory, for the driver checks and the probes alike.
    let sim_dir = match args.driver {
        RunDriver::Real => None,
        RunDriver::Simulated => {
            let dir = crate::private_tempdir("vgpu-doctor-sim-")
                .map_err(|e| Failure::msg(format!("cannot create a temporary directory: {e}")))?;
            let sim = locate::find_sim()?;
            make_sim_link_dir(&sim.path, dir.path())?;
            Some(dir)
        }
    };
    let sim_links = sim_dir.as_ref().map(tempfile::TempDir::path);
    let (c, have_driver) = check_driver("CUDA driver", "libcuda.so.1", true, sim_links);
    emit(c, &mut checks);
    let (c, _) = check_driver("NVML", "libnvidia-ml.so.1", false, sim_links);
    emit(c, &mut checks);
    let (c, cfg) = check_environment();
    emit(c, &mut checks);
    if let Some(c) = check_oversubscribe() {
        emit(c, &mut checks);
    }
    let cache = args.file.path();
    let (c, file) = check_cache(&cache);
    emit(c, &mut checks);
    if args.no_probe {
        emit(
            check("probe", Verdict::Skip, "skipped (--no-probe)"),
            &mut checks,
        );
    } else if !(hook_ok && have_driver) {
        emit(
            check(
                "probe (hook)",
                Verdict::Skip,
                "needs a loadable libvgpu.so and a CUDA driver",
            ),
            &mut checks,
        );
    } else if let Some(hook) = &hook {
        emit(check_mechanism(hook, sim_links), &mut checks);
        if preloaded {
            if let Some(cfg) = &cfg {
                emit(check_here(cfg, file.as_ref(), sim_links), &mut checks);
            }
        }
    }
    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    let verdict = if failed > 0 {
        format!("enforcement is NOT in effect: {failed} check(s) failed")
    } else if preloaded {
        "enforcement is in effect for programs started here".to_owned()
    } else {
        "the hook works; programs are limited when started with `vgpu run` (nothing is preloaded here)"
            .to_owned()
    };
    if text {
        println!();
        let see = if failed > 0 {
            " (see [FAIL] above)"
        } else {
            ""
        };
        println!("verdict: {verdict}{see}.");
    } else {
        let report = DoctorReport {
            schema: SCHEMA,
            ok: failed == 0,
            preloaded,
            verdict: &verdict,
            checks: &checks,
        };
        let json = serde_json::to_string_pretty(&report)
            .map_err(|e| Failure::msg(format!("cannot encode the report: {e}")))?;
        println!("{}", crate::untrusted::json(json));
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
