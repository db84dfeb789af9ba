//! End to end on the simulated driver: `vgpu run` starting a CUDA workload under the real
//! `libvgpu.so`, `set-limit` seen by that running process, `vgpu demo`, and `vgpu doctor`.
//!
//! Needs `libvgpu.so` and `libvgpusim.so` from `cargo build --workspace` next to the test
//! binaries (target/<profile>/); `cargo xtask test` builds them first.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use vgpu_cli::workload::WorkloadProcess;

const MIB: u64 = 1 << 20;

/// The simulated machine (one device of 4 GiB; a context costs 32 MiB) on a [`SimNode`].
struct Sim {
    node: SimNode,
}

impl Sim {
    fn new() -> Self {
        Sim {
            node: SimNode::new("vgpu-live"),
        }
    }

    fn cache(&self) -> PathBuf {
        self.node.path("usage.cache")
    }

    fn configure(&self, cmd: &mut Command) {
        cmd.env("LD_LIBRARY_PATH", self.node.driver())
            .env("VGPU_SIM_TOTAL_MEM", (4u64 << 30).to_string())
            .env("VGPU_SIM_CTX_OVERHEAD", (32 * MIB).to_string())
            .env("VGPU_LIB", &self.node.hook);
    }

    fn vgpu(&self) -> Command {
        let mut cmd = vgpu();
        self.configure(&mut cmd);
        cmd
    }
}

/// The workload `cmd` runs, initialised, its `cuMemAlloc_v2` resolved from `library`.
#[track_caller]
fn started(cmd: Command, library: &str) -> WorkloadProcess {
    let mut w = WorkloadProcess::spawn_command(cmd, false).unwrap();
    let init = w.send("init").unwrap();
    assert!(init.ok(), "{}", init.line);
    assert!(
        init.get("alloc_from").is_some_and(|f| f.ends_with(library)),
        "cuMemAlloc_v2 should come from {library}: {}",
        init.line
    );
    w
}

fn status_json(sim: &Sim, cache: &Path) -> serde_json::Value {
    let mut cmd = sim.vgpu();
    cache_args(&mut cmd, &["status", "--json"], cache);
    let out = run(cmd);
    out.assert_success();
    serde_json::from_str(&out.stdout).unwrap()
}

#[test]
fn set_limit_is_seen_by_a_running_process() {
    let sim = Sim::new();
    let cache = sim.cache();
    // Exactly as a user would: vgpu run ... -- <program>.
    let mut cmd = sim.vgpu();
    cmd.args([
        "run",
        "--memory",
        "256m",
        "--cache",
        cache.to_str().unwrap(),
        "--",
    ])
    .arg(vgpu_exe())
    .arg("workload");
    // dlsym(libcuda, cuMemAlloc_v2) should answer from the hook.
    let mut w = started(cmd, "libvgpu.so");
    assert_eq!(w.send("total").unwrap().num("bytes"), Some(256 * MIB));
    let a = w.send("alloc 128m").unwrap();
    assert!(a.ok(), "{}", a.line);
    // Context 32 MiB + 128 MiB + 128 MiB > 256 MiB.
    let refused = w.send("alloc 128m").unwrap();
    assert!(!refused.ok(), "{}", refused.line);
    assert_eq!(
        refused.get("code"),
        Some("2"),
        "CUDA_ERROR_OUT_OF_MEMORY: {}",
        refused.line
    );

    let v = status_json(&sim, &cache);
    let me = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == w.pid())
        .expect("workload listed");
    assert_eq!(me["alive"], true);
    assert_eq!(v["devices"][0]["memory_limit_bytes"], 256 * MIB);
    assert_eq!(v["devices"][0]["data_bytes"], 128 * MIB);

    let mut cmd = sim.vgpu();
    cache_args(&mut cmd, &["set-limit", "--memory", "512m"], &cache);
    let out = run(cmd);
    out.assert_success();
    out.assert_stdout_has(&["device 0: memory limit 256 MiB -> 512 MiB"]);
    // The same process, without restarting, now gets what it was refused.
    let again = w.send("alloc 128m").unwrap();
    assert!(again.ok(), "after set-limit: {}", again.line);
    let refused = w.send("alloc 256m").unwrap();
    assert!(!refused.ok(), "512 MiB is still a limit: {}", refused.line);
    let v = status_json(&sim, &cache);
    assert_eq!(v["devices"][0]["data_bytes"], 256 * MIB);
    let w_pid = w.pid();
    // Exit 1: one of its allocations was refused.
    let status = w.finish().unwrap();
    assert_eq!(status.code(), Some(1), "{status}");
    // After exit it is either gone or shown dead (status is read-only and never sweeps)...
    let v = status_json(&sim, &cache);
    let procs = v["processes"].as_array().unwrap();
    assert!(
        procs
            .iter()
            .all(|p| p["pid"] != w_pid || p["alive"] == false),
        "{v:#}"
    );
    let dead_held: u64 = procs
        .iter()
        .filter(|p| p["alive"] == false)
        .map(|p| p["memory_used_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(
        v["devices"][0]["memory_used_bytes"].as_u64(),
        Some(dead_held),
        "{v:#}"
    );
    // ...and the next program to attach (here set-limit) returns its usage to the pool.
    let mut cmd = sim.vgpu();
    cache_args(&mut cmd, &["set-limit", "--memory", "512m"], &cache);
    assert_eq!(run(cmd).code(), Some(0));
    let v = status_json(&sim, &cache);
    assert_eq!(v["devices"][0]["memory_used_bytes"], 0, "{v:#}");
    assert_eq!(v["processes"].as_array().unwrap().len(), 0, "{v:#}");
}

#[test]
fn demo_shows_the_limit_enforced_on_the_simulated_driver() {
    let sim = Sim::new();
    let mut cmd = sim.vgpu();
    cmd.env_remove("LD_LIBRARY_PATH").args([
        "demo",
        "--driver",
        "simulated",
        "--memory",
        "512m",
        "--step",
        "128m",
    ]);
    let out = run(cmd);
    assert_eq!(
        out.code(),
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    for want in [
        "simulated driver",
        "cuDeviceTotalMem_v2 says 512 MiB",
        "REFUSED  CUDA_ERROR_OUT_OF_MEMORY (2)",
        "vgpu status --cache",
        "MEMORY USED / LIMIT",
        "running",
        "freed memory is returned to the limit",
        "RESULT: limit enforced",
    ] {
        assert!(
            out.stdout.contains(want),
            "missing {want:?} in\n{}",
            out.stdout
        );
    }
    // The closing hint is a command that works after the demo: it names no file the demo
    // deleted (it used to suggest `--cache` with the demo's temporary file).
    let last_cache = out.stdout.rfind("vgpu status --cache").unwrap();
    let next = out.stdout[last_cache..]
        .lines()
        .find(|l| l.starts_with("next:"))
        .unwrap_or_else(|| panic!("no closing hint in\n{}", out.stdout));
    assert!(
        next.contains("vgpu run --memory 512m --driver simulated --") && !next.contains("--cache"),
        "{next}"
    );
}

#[test]
fn doctor_passes_with_the_hook_and_names_what_is_missing() {
    let sim = Sim::new();
    let cache = sim.cache();
    let mut cmd = sim.vgpu();
    cache_args(&mut cmd, &["doctor"], &cache);
    let out = run(cmd);
    out.assert_success();
    out.assert_stdout_has(&[
        "[ ok ] libvgpu.so",
        "[warn] preload",
        "SIMULATED driver",
        "[ ok ] probe (hook)",
        "sees cuDeviceTotalMem 1.50 GiB",
    ]);

    // Preloaded here with a limit: the probe in this very environment sees it.
    let mut cmd = sim.vgpu();
    cmd.env("LD_PRELOAD", &sim.node.hook)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "768m")
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache)
        .arg("doctor");
    let out = run(cmd);
    out.assert_success();
    out.assert_stdout_has(&[
        "[ ok ] preload",
        "[ ok ] probe (here)",
        "sees device 0 as 768 MiB",
    ]);

    // A preload entry naming a missing file, or a library that is not the hook, fails.
    let mut cmd = sim.vgpu();
    cmd.env("LD_PRELOAD", "/nonexistent/libvgpu.so").args([
        "doctor",
        "--no-probe",
        "--cache",
        cache.to_str().unwrap(),
    ]);
    let out = run(cmd);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    out.assert_stdout_has(&["[FAIL] preload", "does not exist"]);
    let bogus = sim.node.path("libvgpu.so");
    std::fs::write(&bogus, b"not an ELF file").unwrap();
    let mut cmd = sim.vgpu();
    cache_args(
        &mut cmd,
        &["doctor", "--lib", bogus.to_str().unwrap()],
        &cache,
    );
    let out = run(cmd);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    out.assert_stdout_has(&[
        "[FAIL] libvgpu.so",
        "does not load",
        "[skip] probe (hook)",
        "enforcement is NOT in effect",
    ]);
}

#[test]
fn doctor_without_any_driver_fails_and_says_so() {
    if vgpu_cli::cuda::Library::open("libcuda.so.1").is_ok() {
        return; // a machine with a real driver: covered by the GPU harness instead
    }
    let sim = Sim::new();
    let mut cmd = sim.vgpu();
    cmd.env_remove("LD_LIBRARY_PATH")
        .args(["doctor", "--cache", sim.cache().to_str().unwrap()]);
    let out = run(cmd);
    assert_eq!(out.code(), Some(1), "{}", out.stdout);
    out.assert_stdout_has(&["[FAIL] CUDA driver"]);
    assert!(
        out.stdout.contains("vgpu demo"),
        "points to the simulated demo: {}",
        out.stdout
    );
}

#[test]
fn without_the_hook_the_same_workload_is_not_limited() {
    // The control for the tests above: the limit comes from the hook, not from the
    // simulated driver or the environment alone.
    let sim = Sim::new();
    let mut cmd = Command::new(vgpu_exe());
    sim.configure(&mut cmd);
    cmd.env_remove("LD_PRELOAD")
        .env("CUDA_DEVICE_MEMORY_LIMIT", "256m")
        .arg("workload");
    let mut w = started(cmd, "libvgpusim.so");
    assert_eq!(w.send("total").unwrap().num("bytes"), Some(4 << 30));
    assert!(w.send("alloc 512m").unwrap().ok());
    w.finish().unwrap();
}
