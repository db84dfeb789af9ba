//! Prometheus and promtool for the monitoring test (`crates/vgpu-cli/tests/monitoring.rs`),
//! which runs the shipped dashboard's queries and alert rules against a real Prometheus.
//!
//! Found on `PATH`, else Debian's `prometheus` package is fetched with `apt-get download` and
//! unpacked into `target/monitoring-tools/` (its two binaries are self-contained): nothing is
//! installed system-wide, no service starts, no user is created. The directory reaches the
//! test through [`TOOLS_ENV`]. Without apt, the test skips with the reason (and fails under CI,
//! which must have them).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::run;

/// The variable that tells the test where `prometheus` and `promtool` are.
pub const TOOLS_ENV: &str = "VGPU_TEST_PROMETHEUS_DIR";

/// The two binaries the test runs.
const TOOLS: [&str; 2] = ["prometheus", "promtool"];

/// The directory holding both tools, fetched if need be.
pub fn ensure(target: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = on_path() {
        return Ok(dir);
    }
    let root = target.join("monitoring-tools");
    let bin = root.join("usr/bin");
    if works(&bin) {
        return Ok(bin);
    }
    let debs = root.join("deb");
    std::fs::create_dir_all(&debs).map_err(|e| format!("{}: {e}", debs.display()))?;
    eprintln!(
        "xtask: fetching Debian's prometheus package into {} (apt-get download; nothing installed)",
        root.display()
    );
    if download(&debs).is_err() {
        // A fresh machine may have no package lists yet (this needs root).
        let mut update = Command::new("apt-get");
        update.args(["update", "-qq"]);
        run(update).map_err(|e| format!("apt-get update: {e}"))?;
        download(&debs)?;
    }
    let deb = std::fs::read_dir(&debs)
        .map_err(|e| format!("{}: {e}", debs.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or("apt-get download left no .deb")?;
    let mut unpack = Command::new("dpkg-deb");
    unpack.arg("-x").arg(&deb).arg(&root);
    run(unpack)?;
    let _ = std::fs::remove_dir_all(&debs);
    if works(&bin) {
        Ok(bin)
    } else {
        Err(format!(
            "the unpacked package has no working {TOOLS:?} in {}",
            bin.display()
        ))
    }
}

fn download(dir: &Path) -> Result<(), String> {
    let mut c = Command::new("apt-get");
    c.current_dir(dir).args(["download", "-qq", "prometheus"]);
    run(c)
}

/// The `PATH` directory holding both tools, if one does.
fn on_path() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|d| works(d))
}

/// Whether both tools in `dir` run.
fn works(dir: &Path) -> bool {
    TOOLS.iter().all(|t| {
        Command::new(dir.join(t))
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}
