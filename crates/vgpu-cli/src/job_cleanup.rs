//! Removing a `vgpu run` job's private directory (its usage table, the simulated driver's
//! links) when the job ends, while `run` still `exec`s the program (same pid, exit code and
//! signals as without vgpu).
//!
//! `run` starts `vgpu job-cleanup --stage 1`, which starts stage 2 in a new session and
//! exits at once: stage 2 is then nobody's child (a program that waits for all its children,
//! like a shell's `wait`, never waits for it), Ctrl-C on the terminal does not reach it, and
//! it holds none of the program's pipes. Stage 2 opens a pidfd of the job before it says
//! `ready` (so a reused pid cannot fool it), waits for the job to exit and for every process
//! still registered alive in the table (children that outlive it) to end, then removes the
//! directory.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use crate::Failure;
use crate::cli::JobCleanupArgs;
use crate::usage_file::PRIVATE_FILE_NAME;

/// How often stage 2 looks at the table while processes are still registered in it.
const POLL: Duration = Duration::from_millis(500);

/// Arrange for `dir` to be removed when the process `pid` (this one, about to exec) and the
/// processes in its table have ended. Returns once the watcher holds the job.
pub fn arrange(pid: u32, dir: &Path) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the vgpu binary: {e}"))?;
    let mut stage1 = Command::new(exe)
        // The watcher uses no GPU: never under the hook, whatever was preloaded here.
        .env_remove("LD_PRELOAD")
        .arg("job-cleanup")
        .arg("--stage=1")
        .arg(format!("--pid={pid}"))
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the cleanup watcher: {e}"))?;
    let stdout = stage1.stdout.take();
    let _ = stage1.wait();
    let mut line = String::new();
    if let Some(out) = stdout {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    if line.trim() == "ready" {
        Ok(())
    } else {
        Err("the cleanup watcher did not start".to_owned())
    }
}

/// `vgpu job-cleanup` (hidden).
pub fn job_cleanup(args: &JobCleanupArgs) -> Result<ExitCode, Failure> {
    if args.stage == 1 {
        let exe = std::env::current_exe().map_err(|e| Failure::msg(e.to_string()))?;
        let mut cmd = Command::new(exe);
        cmd.arg("job-cleanup")
            .arg("--stage=2")
            .arg(format!("--pid={}", args.pid))
            .arg("--dir")
            .arg(&args.dir)
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        crate::sys::detach_on_spawn(&mut cmd);
        // Stdout (the pipe `run` reads) is inherited; stage 2 writes `ready` into it.
        cmd.spawn().map_err(|e| Failure::msg(e.to_string()))?;
        return Ok(ExitCode::SUCCESS);
    }
    let job = JobHandle::open(args.pid);
    println!("ready");
    // Let go of the pipe so `run` sees the end of it, and of the terminal.
    redirect_stdout_to_null();
    job.wait_exit();
    let table = args.dir.join(PRIVATE_FILE_NAME);
    while registered_alive(&table) {
        std::thread::sleep(POLL);
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    Ok(ExitCode::SUCCESS)
}

fn redirect_stdout_to_null() {
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        use std::os::fd::AsFd;
        let _ = crate::sys::redirect_stdout(null.as_fd());
    }
}

/// Whether the table lists a live process (a missing or unreadable table lists none).
fn registered_alive(table: &Path) -> bool {
    crate::usage_table::read(table).is_ok_and(|r| r.processes.iter().any(|p| p.alive))
}

/// The job's process: a pidfd where the kernel has them (Linux 5.3), else its pid.
struct JobHandle {
    pid: i32,
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl JobHandle {
    fn open(pid: i32) -> Self {
        Self {
            pid,
            pidfd: crate::sys::pidfd_open(pid),
        }
    }

    /// Block until the process has exited.
    fn wait_exit(&self) {
        // A failed poll falls back to asking by pid.
        if self.pidfd.as_ref().is_some_and(crate::sys::wait_readable) {
            return;
        }
        while crate::sys::process_exists(self.pid) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
