//! Project automation. `cargo xtask help` lists the tasks.
//!
//! `cargo test` alone does not build cdylibs (`libvgpu.so`, the simulated driver), which the
//! integration tests load into child processes, so `test` builds the workspace first.

mod deploy;
mod dist;
mod prometheus;

use std::env;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let task = args.first().map(String::as_str).unwrap_or("help");
    let rest = &args[args.len().min(1)..];
    let result = match task {
        "build" => build(false),
        "test" => test(rest),
        "demo" => demo(rest),
        "dist" => dist::dist(rest),
        "deploy-check" => deploy::deploy_check(),
        "help" | "--help" | "-h" => {
            println!("{HELP}");
            Ok(())
        }
        other => Err(format!("unknown task `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

const HELP: &str = "\
cargo xtask <task>

tasks:
  build         build the whole workspace, cdylibs included (libvgpu.so, the simulated driver)
  test [ARGS]   build, then run every test of the workspace (extra ARGS go to cargo test);
                the monitoring test's Prometheus comes from PATH or Debian's package, unpacked
                into target/monitoring-tools (apt-get download; without it that test skips)
  demo          the main job: a small workload under a memory limit (simulated driver without a GPU)
  dist [--native] [--install-tools]
                the release tarball (target/dist/): stripped libvgpu.so.<version>, vgpu, the
                simulated driver, LICENSE, SHA-256 sums; glibc >= 2.17 through cargo-zigbuild
                + zig, which it asks for (--install-tools: pinned versions into
                target/dist-tools/); --native: this host's toolchain, no glibc floor
  deploy-check  check deploy/: Dockerfile paths against the release layout and HAMi's/Volcano's,
                manifests against the Kubernetes schemas (installs kubernetes-validate from
                PyPI into target/deploy-check-venv)";

/// The workspace this task runs for: where `cargo xtask` (`cargo run`) says xtask's
/// manifest is now, else where it was built. A build directory copied from another checkout
/// keeps that checkout's path in the binary (cargo does not rebuild it for the move), and the
/// tasks must not build and test that checkout instead of this one.
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest_dir
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// The build's target directory (`$CARGO_TARGET_DIR`, else `target/`).
pub(crate) fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

pub(crate) fn run(mut cmd: Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed: {status}"))
    }
}

fn build(release: bool) -> Result<(), String> {
    let mut cmd = cargo();
    cmd.args(["build", "--workspace"]);
    if release {
        cmd.arg("--release");
    }
    run(cmd)
}

fn test(extra: &[String]) -> Result<(), String> {
    build(false)?;
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--no-fail-fast"])
        .args(extra);
    match prometheus::ensure(&target_dir()) {
        Ok(dir) => {
            cmd.env(prometheus::TOOLS_ENV, dir);
        }
        Err(e) => eprintln!(
            "xtask: no Prometheus for the monitoring test ({e}); it will skip here (under CI it fails)"
        ),
    }
    run(cmd)?;
    loom()?;
    bench_helpers()
}

/// The GPU benches' own arithmetic (their timelines, figures and verdicts) and the compute
/// bench's runner on sleeping tenants, which need no GPU and no package beyond Python's
/// standard library.
fn bench_helpers() -> Result<(), String> {
    for dir in ["gpu-tests/sm_limit", "gpu-tests/compute"] {
        let mut cmd = Command::new("python3");
        cmd.current_dir(workspace_root())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .args(["-m", "unittest", "discover", "-s", dir, "-p", "test_*.py"]);
        run(cmd)?;
    }
    Ok(())
}

/// The loom models of the atomic protocols (the shared table's; the hook's `Published` cells,
/// its background threads' stop handshake and its log rate limit: every test whose name
/// contains `loom`). They need `--cfg loom` for the whole build, so they get their own target
/// directory (switching flags would rebuild everything).
fn loom() -> Result<(), String> {
    let target = target_dir().join("loom");
    let mut cmd = cargo();
    cmd.env("RUSTFLAGS", "--cfg loom")
        .env("CARGO_TARGET_DIR", target)
        .env(
            "LOOM_MAX_PREEMPTIONS",
            env::var("LOOM_MAX_PREEMPTIONS").unwrap_or_else(|_| "3".into()),
        )
        .args([
            "test",
            "-p",
            "vgpu-shm",
            "-p",
            "vgpu-hook",
            "--release",
            "--lib",
            "loom",
        ]);
    run(cmd)
}

fn demo(extra: &[String]) -> Result<(), String> {
    // The demo preloads libvgpu.so and, without a GPU, serves libvgpusim.so as the driver:
    // both are cdylibs that only a workspace build produces.
    build(false)?;
    let mut cmd = cargo();
    cmd.args(["run", "--quiet", "-p", "vgpu-cli", "--", "demo"])
        .args(extra);
    run(cmd)
}
