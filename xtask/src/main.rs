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
  demo          the main job: a small workload under a memory limit (simulated driver without a GPU)";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

fn cargo() -> Command {
    let mut cmd = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

fn run(mut cmd: Command) -> Result<(), String> {
    eprintln!("xtask: running {cmd:?}");
    let status = cmd.status().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} failed: {status}")) }
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
    cmd.args(["test", "--workspace"]).args(extra);
    run(cmd)
}

fn demo(extra: &[String]) -> Result<(), String> {
    let mut cmd = cargo();
    cmd.args(["run", "--quiet", "-p", "vgpu-alloc-core", "--example", "demo", "--"]).args(extra);
    run(cmd)
}
