//! Plumbing that several crates' integration tests share (unpublished, a dev-dependency only):
//! where the workspace's build put its libraries, compiling the C test programs, and a command
//! environment without the test runner's own limit and preload settings.

#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory holding the workspace's build outputs (`target/<profile>/`), found from the
/// running test executable (`target/<profile>/deps/<test>-<hash>`).
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// A library the workspace build puts next to its binaries (`libvgpu.so`, `libvgpusim.so`), or
/// a failure that says how to build it: `cargo test` alone does not build cdylibs.
pub fn built_library(name: &str) -> PathBuf {
    let p = build_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: `cargo test` does not build cdylibs; run `cargo xtask test` \
         (or `cargo build --workspace` first)",
        p.display()
    );
    p
}

/// The C compiler: `$CC`, else `cc`.
pub fn cc() -> Command {
    Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()))
}

/// Runs a [`cc`] command line, failing the test with the compiler's complaint.
pub fn compile(cc: &mut Command) {
    let out = cc
        .output()
        .expect("cannot run cc: a C compiler is needed for these tests");
    assert!(
        out.status.success(),
        "cc failed ({cc:?}):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Compiles C `source` (written to `dir/name.c`) with `args` and `-ldl` into `dir/name`, which
/// it returns.
pub fn compile_c(
    dir: &Path,
    name: &str,
    source: &str,
    args: impl IntoIterator<Item = impl AsRef<OsStr>>,
) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).expect("write the C source");
    let out = dir.join(name);
    compile(cc().args(args).arg("-o").arg(&out).arg(&src).arg("-ldl"));
    out
}

/// Removes from `cmd` the settings the test runner's own environment may carry (`CUDA_*`,
/// `VGPU_*`, `LD_PRELOAD`, `LIBCUDA_LOG_LEVEL`), so that a test checks only what it sets,
/// and turns the turn board off (`VGPU_TURN_DIR=off`): its default directory is the host's
/// `/tmp/vgpulock`, which a test must neither depend on (whether an earlier run left one) nor
/// create (`vgpu run` with an SM limit would). A test of turns names its own directory.
pub fn clear_runner_settings(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars_os() {
        let runners = k.to_str().is_some_and(|k| {
            k.starts_with("CUDA_")
                || k.starts_with("VGPU_")
                || k == "LD_PRELOAD"
                || k == "LIBCUDA_LOG_LEVEL"
        });
        if runners {
            cmd.env_remove(&k);
        }
    }
    cmd.env("VGPU_TURN_DIR", "off")
}
