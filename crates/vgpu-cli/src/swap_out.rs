//! `vgpu swap-out`: asks the processes of a usage file to swap their movable device memory
//! out to host memory (docs/swap.md).
//!
//! The request is one count in the file (`vgpu_shm::UsageTable::request_swap_out`): it names
//! no process and no size, and reaches only the processes of that file, which are one
//! container's (or one group's). Whoever can write the file (its container, the node's
//! administrator) can ask, and only that container swaps; each process decides for itself
//! under its own rules (the move rule, its memory cgroup), and the next call of its program
//! that can touch device memory brings everything back. So a tenant who writes its own file
//! can swap out only itself.

use std::process::ExitCode;

use serde::Serialize;

use crate::Failure;
use crate::cli::SwapOutArgs;
use crate::usage_table::open_writable;

/// The JSON schema identifier of `swap-out --json` (docs/cli.md).
pub const SCHEMA: &str = "vgpu.swap-out.v1";

/// What `swap-out --json` prints.
#[derive(Debug, Serialize)]
pub struct SwapOutReport {
    /// Always [`SCHEMA`].
    pub schema: &'static str,
    /// The usage file asked.
    pub cache: String,
    /// The file's count of requests, this one included.
    pub request: u32,
    /// Live processes in the file now (only those started with `VGPU_IDLE_SWAP` act on it).
    pub processes: usize,
}

/// `vgpu swap-out`.
pub fn swap_out(args: &SwapOutArgs) -> Result<ExitCode, Failure> {
    let path = args.file.path();
    let table = open_writable(&path)?;
    let before = table.request_swap_out().ok_or_else(|| {
        Failure::msg(format!(
            "{} cannot take a swap-out request (a read-only file, or one of a library without \
             swapping)",
            path.display()
        ))
    })?;
    let processes = table
        .snapshot()
        .processes
        .iter()
        .filter(|p| p.alive)
        .count();
    let report = SwapOutReport {
        schema: SCHEMA,
        cache: path.display().to_string(),
        request: before.wrapping_add(1),
        processes,
    };
    if args.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Failure::msg(format!("cannot encode the report: {e}")))?;
        println!("{}", crate::untrusted::json(text));
    } else {
        println!(
            "asked the {processes} process(es) of {} to swap out (request {}): those started \
             with VGPU_IDLE_SWAP move their movable device memory to host memory within a \
             tick, unless a call is running or their memory cgroup has no room (their log \
             says why); `vgpu status` shows them as swapped",
            crate::untrusted::path(&path),
            report.request
        );
    }
    Ok(ExitCode::SUCCESS)
}
