//! Every JSON output of `vgpu` parses, and every object names its schema: `status --json`,
//! `watch --json` (NDJSON: one object per line), `set-limit --json`, `doctor --json`.
//! The usage file is written by a real job on the simulated driver.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use vgpu_testkit::built_library;

struct Setup {
    dir: TempDir,
}

impl Setup {
    /// A usage file left by one job on the simulated driver under a 1 GiB limit.
    fn new() -> (Self, PathBuf) {
        let s = Self {
            dir: TempDir::new("vgpu-json").unwrap(),
        };
        let cache = s.dir.path().join("job.cache");
        let mut cmd = s.vgpu();
        cmd.args(["run", "--driver", "simulated", "--memory", "1g", "--cache"])
            .arg(&cache)
            .arg("--")
            .arg(vgpu_exe())
            .args(["workload", "--script", "init;alloc 100m"]);
        let out = run(cmd);
        out.assert_success();
        (s, cache)
    }

    /// `vgpu ARGS --cache CACHE` in this setup, run to the end.
    fn run_on(&self, args: &[&str], cache: &Path) -> Output {
        let mut cmd = self.vgpu();
        cache_args(&mut cmd, args, cache);
        run(cmd)
    }

    fn vgpu(&self) -> Command {
        let mut cmd = vgpu();
        cmd.env("TMPDIR", self.dir.path())
            .env("VGPU_TURN_DIR", "off")
            .env("VGPU_LIB", built_library("libvgpu.so"))
            .env("VGPU_SIM_LIB", built_library("libvgpusim.so"));
        cmd
    }
}

#[track_caller]
fn parse(text: &str, schema: &str) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"));
    assert_eq!(v["schema"], schema, "{text}");
    v
}

#[test]
fn status_watch_and_set_limit_print_json_with_a_schema() {
    let (s, cache) = Setup::new();
    let out = s.run_on(&["status", "--json"], &cache);
    out.assert_success();
    let v = parse(&out.stdout, "vgpu.status.v1");
    assert_eq!(v["devices"][0]["memory_limit_bytes"], 1u64 << 30);

    let out = s.run_on(
        &["watch", "--json", "--count", "3", "--interval", "10ms"],
        &cache,
    );
    out.assert_success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "one object per line:\n{}", out.stdout);
    for line in lines {
        let v = parse(line, "vgpu.watch.v1");
        assert_eq!(v["status"]["schema"], "vgpu.status.v1");
        assert!(v["error"].is_null());
        assert!(v["unix_ms"].as_u64().unwrap() > 1_600_000_000_000);
        let time = v["time"].as_str().unwrap();
        assert_eq!(time.len(), 25, "RFC 3339 with offset: {time}");
    }
    // A missing file is a sample with an error, not the end of the stream.
    let out = s.run_on(&["watch", "--json"], &s.dir.path().join("none.cache"));
    assert_eq!(out.code(), Some(0));
    let v = parse(out.stdout.trim(), "vgpu.watch.v1");
    assert!(v["status"].is_null() && v["error"].as_str().unwrap().contains("does not exist"));

    let out = s.run_on(
        &["set-limit", "--json", "--memory", "2g", "--sm", "40"],
        &cache,
    );
    out.assert_success();
    let v = parse(&out.stdout, "vgpu.set-limit.v1");
    let changes = v["changes"].as_array().unwrap();
    assert_eq!(changes[0]["limit"], "memory_bytes");
    assert_eq!(changes[0]["old"], 1u64 << 30);
    assert_eq!(changes[0]["new"], 2u64 << 30);
    assert_eq!(changes[1]["limit"], "sm_percent");
    assert!(changes[1]["old"].is_null());
    assert_eq!(changes[1]["new"], 40);
    assert!(v.get("priority").is_none(), "no priority change asked");

    // The file's CUDA_TASK_PRIORITY (share mode honours it live): 1 is the default.
    let out = s.run_on(&["set-limit", "--json", "--priority", "-2"], &cache);
    out.assert_success();
    let v = parse(&out.stdout, "vgpu.set-limit.v1");
    assert_eq!(
        (v["priority"]["old"].as_i64(), v["priority"]["new"].as_i64()),
        (Some(1), Some(-2))
    );
    assert!(v["changes"].as_array().unwrap().is_empty());
}

#[test]
fn doctor_json_names_every_check_and_reports_oversubscribe() {
    let (s, cache) = Setup::new();
    let mut cmd = s.vgpu();
    cmd.env("CUDA_OVERSUBSCRIBE", "true");
    cache_args(&mut cmd, &["doctor", "--json", "--no-probe"], &cache);
    let out = run(cmd);
    let v = parse(&out.stdout, "vgpu.doctor.v1");
    assert_eq!(
        v["ok"].as_bool(),
        Some(out.code() == Some(0)),
        "{}",
        out.stdout
    );
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.iter().all(|c| {
        ["ok", "warn", "fail", "skip"].contains(&c["verdict"].as_str().unwrap())
            && c["name"].is_string()
            && c["detail"].is_string()
    }));
    let over = checks
        .iter()
        .find(|c| c["name"] == "oversubscribe")
        .unwrap_or_else(|| panic!("no oversubscribe check:\n{}", out.stdout));
    // Honoured since issue 16 (it used to be a warning that vgpu ignores it): the check says
    // what happens and what the host lets the hook pin.
    assert_ne!(over["verdict"], "fail");
    let detail = over["detail"].as_str().unwrap();
    assert!(
        detail.contains("CUDA_OVERSUBSCRIBE=true")
            && detail.contains("backed by host memory")
            && detail.contains("RLIMIT_MEMLOCK"),
        "{detail}"
    );
    // The text form says the same; a typo is a failure; without the variable there is no
    // such check.
    let mut cmd = s.vgpu();
    cmd.env("CUDA_OVERSUBSCRIBE", "true");
    cache_args(&mut cmd, &["doctor", "--no-probe"], &cache);
    assert!(run(cmd).stdout.contains("backed by host memory"));
    let mut cmd = s.vgpu();
    cmd.env("CUDA_OVERSUBSCRIBE", "yes");
    cache_args(&mut cmd, &["doctor", "--json", "--no-probe"], &cache);
    let v = parse(&run(cmd).stdout, "vgpu.doctor.v1");
    let over = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "oversubscribe")
        .cloned()
        .unwrap();
    assert_eq!(over["verdict"], "fail", "{over}");
    let v = parse(
        &s.run_on(&["doctor", "--json", "--no-probe"], &cache).stdout,
        "vgpu.doctor.v1",
    );
    assert!(
        !v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["name"] == "oversubscribe")
    );
}

#[test]
fn doctor_checks_the_simulated_driver_when_asked() {
    let (s, cache) = Setup::new();
    let mut cmd = s.vgpu();
    // No real driver on the library path: only --driver simulated can pass.
    cmd.env("LD_LIBRARY_PATH", s.dir.path());
    cache_args(
        &mut cmd,
        &["doctor", "--json", "--driver", "simulated"],
        &cache,
    );
    let out = run(cmd);
    let v = parse(&out.stdout, "vgpu.doctor.v1");
    out.assert_success();
    assert_eq!(v["ok"], true);
    let verdict = |name: &str| {
        v["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .map(|c| c["verdict"].as_str().unwrap().to_owned())
    };
    assert_eq!(
        verdict("CUDA driver").as_deref(),
        Some("ok"),
        "{}",
        out.stdout
    );
    assert_eq!(
        verdict("probe (hook)").as_deref(),
        Some("ok"),
        "{}",
        out.stdout
    );
}

#[test]
fn doctor_explains_volcanos_oversubscribe_and_a_dra_claims_limits() {
    let (s, cache) = Setup::new();
    let checks = |env: &[(&str, &str)]| {
        let mut cmd = s.vgpu();
        cmd.envs(env.iter().copied());
        cache_args(&mut cmd, &["doctor", "--json", "--no-probe"], &cache);
        let v = parse(&run(cmd).stdout, "vgpu.doctor.v1");
        v["checks"].as_array().unwrap().clone()
    };
    let named = |checks: &[serde_json::Value], name: &str| {
        checks
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} check: {checks:?}"))
    };
    // Volcano's plugin sets it for core scaling: said, and not an error.
    let c = checks(&[
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/5e0f.cache"),
        ("CUDA_OVERSUBSCRIBE", "true"),
    ]);
    let over = named(&c, "oversubscribe");
    assert_eq!(over["verdict"], "ok", "{over}");
    let detail = over["detail"].as_str().unwrap();
    assert!(
        detail.contains("Volcano")
            && detail.contains("core scaling")
            && detail.contains("stays off"),
        "{detail}"
    );
    // A DRA claim whose indexed limits differ: the smallest, with a warning that says why.
    let c = checks(&[
        (
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "/usr/local/vgpu/claims/c1a1a000-0000-4000-8000-00000000000a/5e0f.cache",
        ),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "8192m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "4096m"),
    ]);
    let env = named(&c, "environment");
    assert_eq!(env["verdict"], "warn", "{env}");
    assert!(
        env["detail"]
            .as_str()
            .unwrap()
            .contains("every GPU is limited to 4096m"),
        "{env}"
    );
    // Limits by UUID are shown as such.
    let c = checks(&[(
        "CUDA_DEVICE_MEMORY_LIMIT_GPU_5a1e5130_0000_4000_8000_0000000c0de0",
        "1g",
    )]);
    let env = named(&c, "environment");
    assert!(
        env["detail"]
            .as_str()
            .unwrap()
            .contains("GPU-5a1e5130-0000-4000-8000-0000000c0de0: 1 GiB"),
        "{env}"
    );
}
