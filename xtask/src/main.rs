//! Project automation. `cargo xtask help` lists the tasks.
//!
//! `cargo test` alone does not build cdylibs (`libvgpu.so`, the simulated driver), which the
//! integration tests load into child processes, so `test` builds the workspace first.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let task = args.first().map(String::as_str).unwrap_or("help");
    let rest = &args[args.len().min(1)..];
    let result = match task {
        "build" => build(false),
        "test" => test(rest),
        "demo" => demo(rest),
        "dist" => dist(),
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
  test [ARGS]   build, then run every test of the workspace (extra ARGS go to cargo test)
  demo          the main job: a small workload under a memory limit (simulated driver without a GPU)
  dist          release libvgpu.so + vgpu for glibc >= 2.17 (cargo-zigbuild + zig), with symbol/glibc checks";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

fn run(mut cmd: Command) -> Result<(), String> {
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
    run(cmd)?;
    loom()
}

/// The loom models of the atomic protocols (the shared table's; the hook's power-reading seqlock
/// and its `Published` cells: every test whose name contains `loom`). They need `--cfg loom` for the whole
/// build, so they get their own target directory (switching flags would rebuild everything).
fn loom() -> Result<(), String> {
    let target = env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
        .join("loom");
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

/// The oldest glibc the shipped library may need: containers as old as CentOS 7 must load it.
const DIST_GLIBC: (u32, u32) = (2, 17);
const DIST_TARGET: &str = "x86_64-unknown-linux-gnu";

fn have(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn dist() -> Result<(), String> {
    // Both tools come from the package registries: cargo-zigbuild from crates.io, zig from PyPI.
    if !have(cargo().args(["zigbuild", "--version"])) {
        let mut c = cargo();
        c.args(["install", "--locked", "cargo-zigbuild"]);
        run(c)?;
    }
    if !have(Command::new("zig").arg("version"))
        && !have(Command::new("python3").args(["-m", "ziglang", "version"]))
    {
        let mut c = Command::new("python3");
        c.args(["-m", "pip", "install", "ziglang"]);
        run(c)?;
    }
    let target = format!("{DIST_TARGET}.{}.{}", DIST_GLIBC.0, DIST_GLIBC.1);
    let mut c = cargo();
    c.args([
        "zigbuild",
        "--release",
        "-p",
        "vgpu-hook",
        "-p",
        "vgpu-cli",
        "--target",
        &target,
    ]);
    run(c)?;
    let root = workspace_root();
    let target_dir =
        env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let built = target_dir.join(DIST_TARGET).join("release");
    let dist = target_dir.join("dist");
    std::fs::create_dir_all(&dist).map_err(|e| format!("create {}: {e}", dist.display()))?;
    for name in ["libvgpu.so", "vgpu"] {
        std::fs::copy(built.join(name), dist.join(name))
            .map_err(|e| format!("copy {name}: {e}"))?;
    }
    check_glibc(&dist.join("libvgpu.so"))?;
    check_glibc(&dist.join("vgpu"))?;
    check_exports(&dist.join("libvgpu.so"))?;
    println!(
        "dist: {} and {} (glibc >= {}.{})",
        dist.join("libvgpu.so").display(),
        dist.join("vgpu").display(),
        DIST_GLIBC.0,
        DIST_GLIBC.1
    );
    Ok(())
}

fn readelf(args: &[&str], file: &Path) -> Result<String, String> {
    let out = Command::new("readelf")
        .args(args)
        .arg(file)
        .output()
        .map_err(|e| format!("readelf (binutils) is needed for the dist checks: {e}"))?;
    if !out.status.success() {
        return Err(format!("readelf {args:?} {} failed", file.display()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Fails when the file needs a `GLIBC_x.y` symbol version newer than [`DIST_GLIBC`].
fn check_glibc(file: &Path) -> Result<(), String> {
    let text = readelf(&["--version-info", "-W"], file)?;
    let mut newest = (0, 0);
    for word in text.split_whitespace() {
        if let Some(v) = word.strip_prefix("GLIBC_") {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
            let ver = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
            newest = newest.max(ver);
        }
    }
    if newest > DIST_GLIBC {
        return Err(format!(
            "{} needs GLIBC_{}.{}, newer than the {}.{} we promise",
            file.display(),
            newest.0,
            newest.1,
            DIST_GLIBC.0,
            DIST_GLIBC.1
        ));
    }
    println!(
        "dist: {} needs at most GLIBC_{}.{}",
        file.display(),
        newest.0,
        newest.1
    );
    Ok(())
}

/// The library must export the driver entry points programs resolve and nothing of Rust's.
fn check_exports(lib: &Path) -> Result<(), String> {
    let text = readelf(&["--dyn-syms", "-W"], lib)?;
    let exported: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" GLOBAL ") && !l.contains(" UND "))
        .filter_map(|l| l.split_whitespace().nth(7))
        .map(|s| s.split('@').next().unwrap_or(s))
        .collect();
    // The declaration list is the one source of what must be exported.
    let declared = vgpu_cuda_abi::CUDA_HOOKED_SYMBOLS
        .iter()
        .chain(vgpu_cuda_abi::NVML_HOOKED_SYMBOLS)
        .map(|s| s.name)
        .chain(["dlsym"]);
    let missing: Vec<&str> = declared.filter(|name| !exported.contains(name)).collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} does not export declared symbols: {missing:?}",
            lib.display()
        ));
    }
    let stray: Vec<&&str> = exported
        .iter()
        .filter(|s| {
            !(s.starts_with("cu")
                || s.starts_with("nvml")
                || **s == "dlsym"
                || s.starts_with("vgpu_"))
        })
        .collect();
    if !stray.is_empty() {
        return Err(format!(
            "{} exports symbols outside the driver API: {stray:?}",
            lib.display()
        ));
    }
    println!(
        "dist: {} exports {} symbols, all driver/NVML/dlsym entry points",
        lib.display(),
        exported.len()
    );
    Ok(())
}
