//! The `vgpu` command line tool: run programs under GPU limits, show and change usage,
//! export metrics, diagnose the setup, and demonstrate enforcement.
//!
//! The binary is a thin wrapper over [`dispatch`]; the modules are public so the
//! integration tests and the xtask can reuse them.
//!
//! Layout (`docs/architecture.md`, floor 3, draws it):
//! - The command line: [`cli`] (every subcommand and flag, clap types) and [`dispatch`] below.
//! - One module per command: [`run`], [`status`], [`watch`], [`set_limit`], [`swap_out`],
//!   [`exporter`]
//!   (`pods`: which pod a file is; `render`: the metrics page), [`doctor`], [`demo`],
//!   [`workload`] (the tiny CUDA job `demo` and `doctor` drive, through [`cuda`]) and
//!   [`job_cleanup`] (the hidden watcher that removes a `vgpu run` job's directory).
//! - What commands share: [`report`] (the versioned JSON model of a usage file),
//!   [`usage_table`] (a file read into it, or opened to write limits), [`usage_file`] (which
//!   file a command uses; a `vgpu run` job's table), [`hook_env`] (the environment a program
//!   gets under the hook), [`limits`] (the `--memory`/`--sm` flags), [`locate`] (finding
//!   `libvgpu.so` and the simulator), [`turn_dir`] (the turn directory on a workstation).
//! - Plumbing: [`glob`] (which files a `--cache` pattern names), [`http`] (the exporter's
//!   endpoint), [`untrusted`] (text a tenant controls, made safe to show), [`units`] (sizes,
//!   durations), [`signals`] (Ctrl-C, SIGPIPE), `sys` (the libc calls std does not wrap).
//!
//! Unsafe code lives in three boundary modules, each allowed it below with its reason;
//! the compiler holds every other module to safe Rust.

#![deny(unsafe_code)]

pub mod cli;
#[allow(unsafe_code)] // dlopens the driver and calls it through C function pointers
pub mod cuda;
pub mod demo;
pub mod doctor;
pub mod exporter;
pub mod glob;
pub mod hook_env;
pub mod http;
pub mod job_cleanup;
pub mod limits;
pub mod locate;
pub mod report;
pub mod run;
pub mod set_limit;
#[allow(unsafe_code)] // installs signal handlers (sigaction, signal)
pub mod signals;
pub mod status;
pub mod swap_out;
#[allow(unsafe_code)] // the libc calls std does not wrap, each behind a safe function
mod sys;
pub mod turn_dir;
pub mod units;
pub mod untrusted;
pub mod usage_file;
pub mod usage_table;
pub mod watch;
pub mod workload;

use std::fmt;
use std::process::ExitCode;

/// A private temporary directory (mode 0700, tempfile's unique name `<prefix>…`) in the
/// system temp dir, removed with its contents on drop.
pub fn private_tempdir(prefix: &str) -> std::io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(prefix)
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
}

/// A failed command: the message for stderr and the exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Process exit code (never 0).
    pub code: u8,
    /// What went wrong, in plain words.
    pub message: String,
}

impl Failure {
    /// A runtime failure (exit code 1).
    pub fn msg(message: impl Into<String>) -> Self {
        Self {
            code: 1,
            message: message.into(),
        }
    }

    /// A usage error (exit code 2, as clap uses).
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            code: 2,
            message: message.into(),
        }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Self::msg(message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Run one parsed command line.
pub fn dispatch(cli: cli::Cli) -> Result<ExitCode, Failure> {
    use cli::Command;
    // Commands that only print die quietly on a closed pipe (`vgpu status | head`), like any
    // Unix tool. The others talk to children or sockets and handle EPIPE as an error.
    if matches!(
        cli.command,
        Command::Run(_) | Command::Status(_) | Command::SetLimit(_) | Command::SwapOut(_)
    ) {
        signals::restore_default_sigpipe();
    }
    match cli.command {
        Command::Run(a) => run::run(&a),
        Command::Status(a) => status::status(&a),
        Command::Watch(a) => watch::watch(&a),
        Command::SetLimit(a) => set_limit::set_limit(&a),
        Command::SwapOut(a) => swap_out::swap_out(&a),
        Command::Exporter(a) => exporter::exporter(&a),
        Command::Doctor(a) => doctor::doctor(&a),
        Command::Demo(a) => demo::demo(&a),
        Command::Workload(a) => workload::workload(&a),
        Command::JobCleanup(a) => job_cleanup::job_cleanup(&a),
    }
}
