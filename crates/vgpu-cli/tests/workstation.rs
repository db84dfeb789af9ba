//! Sharing one GPU on a workstation, driven through the real `vgpu` binary, the real
//! `libvgpu.so` and `vgpu run --driver simulated`: each job has its own table unless it
//! joins a group, a stale table never silently wins, private tables are removed when the
//! job ends, and the turn directory is created like `/tmp`.
//!
//! Every test gives `vgpu` its own `TMPDIR` (where the per-user table directory lives) and
//! `VGPU_TURN_DIR`, so tests never see each other's tables or the machine's.

mod common;
use common::*;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use vgpu_testkit::built_library;

const MIB: u64 = 1 << 20;

struct Box_ {
    tmp: TempDir,
}

impl Box_ {
    fn new() -> Self {
        built_library("libvgpusim.so");
        let tmp = TempDir::new("vgpu-ws").unwrap();
        Self { tmp }
    }

    fn tmpdir(&self) -> PathBuf {
        self.tmp.path().join("tmp")
    }

    fn turn_dir(&self) -> PathBuf {
        self.tmp.path().join("vgpulock")
    }

    /// `vgpu run --driver simulated ARGS` in this box.
    fn run_simulated(&self, args: &[&str]) -> Command {
        let mut cmd = self.vgpu();
        cmd.args(["run", "--driver", "simulated"]).args(args);
        cmd
    }

    fn vgpu(&self) -> Command {
        std::fs::create_dir_all(self.tmpdir()).unwrap();
        let mut cmd = vgpu();
        cmd.env("TMPDIR", self.tmpdir())
            .env("VGPU_TURN_DIR", self.turn_dir())
            .env("VGPU_LIB", built_library("libvgpu.so"))
            .env("VGPU_SIM_TOTAL_MEM", (4u64 << 30).to_string())
            .env("VGPU_SIM_CTX_OVERHEAD", (32 * MIB).to_string());
        cmd
    }

    /// `vgpu run --driver simulated ARGS -- vgpu workload`, talking over stdin/stdout.
    fn job(&self, args: &[&str]) -> Job {
        self.job_with(&[], args)
    }

    /// [`Self::job`] with the variables `vars` in its environment.
    fn job_with(&self, vars: &[(&str, &str)], args: &[&str]) -> Job {
        let mut cmd = self.vgpu();
        cmd.envs(vars.iter().copied())
            .args(["run", "--driver", "simulated"])
            .args(args)
            .arg("--")
            .arg(vgpu_exe())
            .arg("workload")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Job {
            child,
            stdin: Some(stdin),
            stdout,
        }
    }

    /// The user's table directory (`$TMPDIR/vgpu-<uid>`).
    fn user_dir(&self) -> PathBuf {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        self.tmpdir().join(format!("vgpu-{uid}"))
    }
}

struct Job {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Job {
    fn send(&mut self, line: &str) -> String {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let mut reply = String::new();
        self.stdout.read_line(&mut reply).unwrap();
        reply.trim().to_owned()
    }

    /// Ask the job which usage table it got.
    fn finish(mut self) -> Output {
        drop(self.stdin.take());
        let status = wait_bounded(&mut self.child, Duration::from_secs(30));
        let mut stderr = String::new();
        let _ = std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut stderr);
        Output {
            status,
            stdout: String::new(),
            stderr,
        }
    }
}

fn field<'a>(reply: &'a str, key: &str) -> Option<&'a str> {
    reply
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The permission bits of `path` that `mask` keeps.
fn mode_of(path: impl AsRef<Path>, mask: u32) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & mask
}

fn job_dirs(b: &Box_) -> Vec<PathBuf> {
    std::fs::read_dir(b.user_dir())
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("job-"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_jobs_get_separate_tables_by_default_and_share_only_when_asked() {
    let b = Box_::new();
    // Each job holds 700 MiB under a 1 GiB limit: alone that fits, two in one table do not.
    let mut a = b.job(&["--memory", "1g"]);
    assert!(a.send("init").starts_with("ok"));
    assert!(a.send("alloc 700m").starts_with("ok"));
    let mut c = b.job(&["--memory", "1g"]);
    assert!(c.send("init").starts_with("ok"));
    let r = c.send("alloc 700m");
    assert!(
        r.starts_with("ok"),
        "a second private job is limited alone: {r}"
    );
    // Two private tables, mode 0600, each in a 0700 directory of its own.
    let dirs = job_dirs(&b);
    assert_eq!(dirs.len(), 2, "{dirs:?}");
    for d in &dirs {
        let mode = mode_of(d, 0o777);
        assert_eq!(mode, 0o700, "{}", d.display());
        assert_eq!(mode_of(d.join("usage.cache"), 0o777), 0o600);
    }
    let user_mode = mode_of(b.user_dir(), 0o777);
    assert_eq!(user_mode, 0o700);
    assert_eq!(a.finish().code(), Some(0));
    assert_eq!(c.finish().code(), Some(0));
    // Removed when the jobs end.
    wait_until("private tables removed", || job_dirs(&b).is_empty());

    // Asked to share: one table, one limit.
    let mut a = b.job(&["--memory", "1g", "--share", "team"]);
    assert!(a.send("init").starts_with("ok"));
    assert!(a.send("alloc 700m").starts_with("ok"));
    let mut c = b.job(&["--memory", "1g", "--share", "team"]);
    assert!(c.send("init").starts_with("ok"));
    let r = c.send("alloc 700m");
    assert!(
        r.starts_with("err") && r.contains("OUT_OF_MEMORY"),
        "the group shares one limit: {r}"
    );
    // `status --share` finds the group's table.
    let mut cmd = b.vgpu();
    cmd.args(["status", "--json", "--share", "team"]);
    let out = run(cmd);
    out.assert_success();
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["schema"], "vgpu.status.v1");
    assert_eq!(v["processes"].as_array().unwrap().len(), 2);
    let shared = b.user_dir().join("team.cache");
    let mode = mode_of(&shared, 0o777);
    assert_eq!(mode, 0o600, "a group table is not writable by other users");
    a.finish();
    c.finish();
}

#[test]
fn a_stale_table_never_silently_wins() {
    let b = Box_::new();
    let mut a = b.job(&["--memory", "1g", "--share", "g"]);
    assert!(a.send("init").starts_with("ok"));
    // While a live process holds the group under 1 GiB, a job asking 2 GiB is refused.
    let cmd = b.run_simulated(&["--memory", "2g", "--share", "g", "--", "true"]);
    let out = run(cmd);
    assert_fails(
        &out,
        1,
        &[
            "in use by 1 live process",
            "memory limit 1 GiB",
            "2 GiB",
            "set-limit",
        ],
    );
    // The same limit joins.
    let cmd = b.run_simulated(&["--memory", "1g", "--share", "g", "--", "true"]);
    assert_eq!(run(cmd).code(), Some(0));
    assert_eq!(a.finish().code(), Some(0));

    // Nobody uses it now: the new limit replaces the old one, with a note.
    let mut c = b.job(&["--memory", "2g", "--share", "g"]);
    assert!(c.send("init").starts_with("ok"));
    let total = c.send("total");
    assert_eq!(
        field(&total, "bytes"),
        Some((2u64 << 30).to_string().as_str()),
        "{total}"
    );
    let out = c.finish();
    assert!(
        out.stderr.contains("held other limits from an earlier job")
            && out.stderr.contains("1 GiB"),
        "{}",
        out.stderr
    );
}

#[test]
fn a_group_keeps_one_host_memory_policy() {
    let b = Box_::new();
    let group = ["--memory", "1g", "--share", "h"];
    let mut a = b.job_with(&[("VGPU_HOST_SPILL", "64m")], &group);
    assert!(a.send("init").starts_with("ok"));
    // While a live process holds the group with a 64 MiB spill, a job asking for another
    // policy is refused, as one asking for another limit is.
    for (name, value, wanted) in [
        ("VGPU_HOST_SPILL", "10g", "spill 10 GiB, oversubscribe off"),
        ("CUDA_OVERSUBSCRIBE", "true", "spill 0 B, oversubscribe on"),
    ] {
        let mut cmd = b.run_simulated(&[&group[..], &["--", "true"]].concat());
        cmd.env(name, value);
        assert_fails(
            &run(cmd),
            1,
            &[
                "in use by 1 live process",
                "host memory policy spill 64 MiB, oversubscribe off",
                wanted,
            ],
        );
    }
    // The same policy joins, and so does a job that asks for none (it gets the group's).
    let mut cmd = b.run_simulated(&[&group[..], &["--", "true"]].concat());
    cmd.env("VGPU_HOST_SPILL", "64m");
    assert_eq!(run(cmd).code(), Some(0));
    let cmd = b.run_simulated(&[&group[..], &["--", "true"]].concat());
    assert_eq!(run(cmd).code(), Some(0));
    assert_eq!(a.finish().code(), Some(0));
    // Nobody uses it now: the new policy replaces the old one, with a note.
    let mut cmd = b.run_simulated(&[&group[..], &["--", "true"]].concat());
    cmd.env("VGPU_HOST_SPILL", "128m");
    let out = run(cmd);
    out.assert_success();
    out.assert_stderr_has(&["held other limits from an earlier job", "spill 64 MiB"]);
    let mut cmd = b.vgpu();
    cmd.args(["status", "--json", "--share", "h"]);
    let v: serde_json::Value = serde_json::from_str(&run(cmd).stdout).unwrap();
    assert_eq!(v["devices"][0]["host_spill_bytes"], 128 * MIB);
}

#[test]
fn run_on_the_simulated_driver_needs_no_gpu_and_cleans_up() {
    let b = Box_::new();
    let mut cmd = b.run_simulated(&["--memory", "512m", "--"]);
    cmd.arg(vgpu_exe())
        .args(["workload", "--script", "init;total;alloc 600m"]);
    let out = run(cmd);
    // The refused allocation is the program's failure, and `run` passes its exit code on.
    assert_eq!(out.code(), Some(1), "{out:?}");
    out.assert_stdout_has(&[
        "file=",
        "libvgpusim.so",
        &format!("bytes={}", 512 * MIB),
        "err alloc",
        "OUT_OF_MEMORY",
    ]);
    wait_until("the job directory is removed", || job_dirs(&b).is_empty());
    // A pipe reader sees EOF when the program ends: the cleanup watcher holds no pipe.
    let cmd = b.run_simulated(&["--", "sh", "-c", "echo hi"]);
    let start = Instant::now();
    let out = run_bounded(cmd, Duration::from_secs(10));
    assert_eq!(out.stdout.trim(), "hi");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn the_turn_directory_is_created_sticky_for_sm_jobs() {
    let b = Box_::new();
    let cmd = b.run_simulated(&["--sm", "50", "--", "true"]);
    let out = run(cmd);
    out.assert_success();
    let mode = mode_of(b.turn_dir(), 0o7777);
    assert_eq!(mode, 0o1777);
    // A directory that cannot be created is a warning, not a failure.
    let mut cmd = b.run_simulated(&["--sm", "50", "--", "true"]);
    cmd.env("VGPU_TURN_DIR", "/nonexistent/vgpulock");
    let out = run(cmd);
    out.assert_success();
    out.assert_stderr_has(&["warning", "will not see each other's claims"]);
}

#[test]
fn an_explicit_cache_is_created_private_and_never_through_a_symlink() {
    let b = Box_::new();
    let dir = b.tmp.path();
    let cache = dir.join("x.cache");
    let mut cmd = b.run_simulated(&["--memory", "1g", "--cache"]);
    cmd.arg(&cache)
        .arg("--")
        .arg(vgpu_exe())
        .args(["workload", "--script", "init"]);
    assert_eq!(run(cmd).code(), Some(0));
    assert_eq!(mode_of(&cache, 0o777), 0o600);
    let all = dir.join("all.cache");
    let mut cmd = b.vgpu();
    cmd.args(["run", "--all-users", "--cache"])
        .arg(&all)
        .args(["--", "true"]);
    assert_eq!(run(cmd).code(), Some(0));
    assert_eq!(mode_of(&all, 0o777), 0o666);
    let link = dir.join("link.cache");
    std::os::unix::fs::symlink(dir.join("elsewhere"), &link).unwrap();
    let mut cmd = b.vgpu();
    cmd.args(["run", "--cache"]).arg(&link).args(["--", "true"]);
    assert_fails(&run(cmd), 1, &["symlink"]);
    assert!(!Path::new(&dir.join("elsewhere")).exists());
}

#[test]
fn a_table_named_by_the_environment_keeps_its_limits() {
    // Like a HAMi container: the operator's file, with the operator's limit.
    let b = Box_::new();
    let cache = b.tmp.path().join("container.cache");
    let mut cmd = b.vgpu();
    cmd.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache)
        .env("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .args(["run", "--driver", "simulated", "--"])
        .arg(vgpu_exe())
        .args(["workload", "--script", "init"]);
    assert_eq!(run(cmd).code(), Some(0));
    // Nobody uses it now, but it is not this job's to change.
    let mut cmd = b.vgpu();
    cmd.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache).args([
        "run",
        "--driver",
        "simulated",
        "--memory",
        "2g",
        "--",
        "true",
    ]);
    assert_fails(
        &run(cmd),
        1,
        &[
            "named by $CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "1 GiB",
            "2 GiB",
        ],
    );
    let mut cmd = b.vgpu();
    cmd.args(["status", "--json", "--cache"]).arg(&cache);
    let v: serde_json::Value = serde_json::from_str(&run(cmd).stdout).unwrap();
    assert_eq!(v["devices"][0]["memory_limit_bytes"], 1u64 << 30);
}
