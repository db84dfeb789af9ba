//! A tiny CUDA workload (`vgpu workload`) driven by one command per line, and the client that
//! drives it from `demo`, `doctor` and the tests.
//!
//! Protocol: each command gets exactly one reply line, `ok <what> key=value...` or
//! `err <what> key=value... msg=<text>`. Commands (documented in its `--help`, in cli.rs):
//! `init` (cuInit, device, primary context), `count`, `total`, `info`, `alloc SIZE`,
//! `free ID`, `sleep MS`, `pid`, `quit`. The exit code is 1 when any command failed.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use vgpu_cuda_abi::CUdeviceptr;

use crate::Failure;
use crate::cli::WorkloadArgs;
use crate::cuda::{CuError, Driver};
use crate::limits::parse_memory_value;

/// The driver library every CUDA program opens.
pub const DRIVER_NAME: &str = "libcuda.so.1";

struct State {
    device: i32,
    driver: Option<Driver>,
    allocations: HashMap<u64, (CUdeviceptr, u64)>,
    next_id: u64,
}

fn cu_err(what: &str, e: &CuError) -> String {
    format!(
        "err {what} code={} name={} msg={}",
        e.code.0, e.name, e.call
    )
}

impl State {
    fn driver(&mut self) -> Result<&Driver, String> {
        if self.driver.is_none() {
            let d = Driver::open(DRIVER_NAME)
                .map_err(|e| format!("err open msg={}", e.replace('\n', " ")))?;
            self.driver = Some(d);
        }
        Ok(self.driver.as_ref().expect("set above"))
    }

    fn execute(&mut self, line: &str) -> Option<String> {
        let mut words = line.split_whitespace();
        let cmd = words.next()?;
        let arg = words.next();
        let device = self.device;
        let reply = match (cmd, arg) {
            ("quit", None) => return None,
            ("pid", None) => Ok(format!("ok pid pid={}", std::process::id())),
            ("sleep", Some(ms)) => match ms.parse::<u64>() {
                Ok(ms) => {
                    std::thread::sleep(Duration::from_millis(ms));
                    Ok("ok sleep".to_owned())
                }
                Err(_) => Err(format!("err sleep msg=not-a-number:{ms}")),
            },
            ("init", None) => self.driver().and_then(|d| {
                d.init().map_err(|e| cu_err("init", &e))?;
                let dev = d.device(device).map_err(|e| cu_err("init", &e))?;
                d.use_primary_context(dev).map_err(|e| cu_err("init", &e))?;
                let version = d.driver_version().map_err(|e| cu_err("init", &e))?;
                let name = d.device_name(dev).unwrap_or_default().replace(' ', "_");
                // Which file was loaded as the driver, and which file answers for cuMemAlloc_v2
                // (libvgpu.so when the hook intercepts dlsym).
                let file = d.library().path().map(|p| p.display().to_string()).unwrap_or_default();
                let alloc_from =
                    d.library().file_of("cuMemAlloc_v2").map(|p| p.display().to_string()).unwrap_or_default();
                Ok(format!("ok init driver={version} device={device} name={name} file={file} alloc_from={alloc_from}"))
            }),
            ("count", None) => self.driver().and_then(|d| {
                d.init().map_err(|e| cu_err("count", &e))?;
                let n = d.device_count().map_err(|e| cu_err("count", &e))?;
                Ok(format!("ok count devices={n}"))
            }),
            ("total", None) => self.driver().and_then(|d| {
                let dev = d.device(device).map_err(|e| cu_err("total", &e))?;
                let total = d.device_total_mem(dev).map_err(|e| cu_err("total", &e))?;
                Ok(format!("ok total bytes={total}"))
            }),
            ("info", None) => self.driver().and_then(|d| {
                let (free, total) = d.mem_get_info().map_err(|e| cu_err("info", &e))?;
                Ok(format!("ok info free={free} total={total}"))
            }),
            ("alloc", Some(size)) => match parse_memory_value(size) {
                Err(e) => Err(format!("err alloc msg={}", e.replace(' ', "_"))),
                Ok(bytes) => {
                    let id = self.next_id;
                    let result = self.driver().and_then(|d| {
                        d.mem_alloc(bytes).map_err(|e| format!("{} bytes={bytes}", cu_err("alloc", &e)))
                    });
                    result.map(|ptr| {
                        self.next_id += 1;
                        self.allocations.insert(id, (ptr, bytes));
                        format!("ok alloc id={id} bytes={bytes} ptr={:#x}", ptr.0)
                    })
                }
            },
            ("free", Some(id)) => match id.parse::<u64>().ok().and_then(|id| self.allocations.remove(&id).map(|a| (id, a))) {
                None => Err(format!("err free msg=no-allocation-{id}")),
                Some((id, (ptr, bytes))) => self
                    .driver()
                    .and_then(|d| d.mem_free(ptr).map_err(|e| cu_err("free", &e)))
                    .map(|()| format!("ok free id={id} bytes={bytes}")),
            },
            _ => Err(format!("err syntax msg=unknown-command:{}", line.trim().replace(' ', "_"))),
        };
        Some(reply.unwrap_or_else(|e| e))
    }
}

/// `vgpu workload`: answer commands from `--script` or stdin until `quit` or end of input.
pub fn workload(args: &WorkloadArgs) -> Result<ExitCode, Failure> {
    let mut state = State {
        device: args.device,
        driver: None,
        allocations: HashMap::new(),
        next_id: 0,
    };
    let mut out = std::io::stdout().lock();
    let mut failed = false;
    let mut answer = |line: &str| -> Result<bool, Failure> {
        if line.trim().is_empty() {
            return Ok(true);
        }
        match state.execute(line) {
            None => Ok(false),
            Some(reply) => {
                failed |= !Reply::is_ok(&reply);
                writeln!(out, "{reply}")
                    .and_then(|()| out.flush())
                    .map_err(|e| Failure::msg(format!("stdout: {e}")))?;
                Ok(true)
            }
        }
    };
    if let Some(script) = &args.script {
        for cmd in script.split(';') {
            if !answer(cmd)? {
                break;
            }
        }
    } else {
        for line in std::io::stdin().lock().lines() {
            let line = line.map_err(|e| Failure::msg(format!("stdin: {e}")))?;
            if !answer(&line)? {
                break;
            }
        }
    }
    // Allocations are left for process exit to release: the hook must account for that too.
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// One reply of the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The whole line.
    pub line: String,
}

impl Reply {
    /// Whether the command succeeded.
    pub fn ok(&self) -> bool {
        Self::is_ok(&self.line)
    }

    /// Whether a reply line says its command succeeded.
    fn is_ok(line: &str) -> bool {
        line.starts_with("ok ")
    }

    /// The value of `key=` in the reply.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.line
            .split(' ')
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    }

    /// The value of `key=` as a number.
    pub fn num(&self, key: &str) -> Option<u64> {
        self.get(key)?.parse().ok()
    }
}

/// A running workload process.
#[derive(Debug)]
pub struct WorkloadProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    replies: mpsc::Receiver<String>,
    timeout: Duration,
}

impl WorkloadProcess {
    /// Start `vgpu workload` from the binary `vgpu_exe`, with `configure` setting its
    /// environment (the hook, limits, driver path). Stderr is inherited or discarded.
    pub fn spawn(
        vgpu_exe: &Path,
        configure: impl FnOnce(&mut Command),
        show_stderr: bool,
    ) -> Result<Self, String> {
        let mut cmd = Command::new(vgpu_exe);
        cmd.arg("workload");
        configure(&mut cmd);
        Self::spawn_command(cmd, show_stderr)
    }

    /// Start a command that ends up running `vgpu workload` (e.g. `vgpu run ... -- vgpu
    /// workload`), talking to it over its stdin and stdout.
    pub fn spawn_command(mut cmd: Command, show_stderr: bool) -> Result<Self, String> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(if show_stderr {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("no stdout pipe")?;
        let (tx, rx) = mpsc::channel();
        // A reader thread, so a hung child turns into a timeout instead of a hang here.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            replies: rx,
            timeout: Duration::from_secs(30),
        })
    }

    /// Send one command and wait for its reply.
    pub fn send(&mut self, command: &str) -> Result<Reply, String> {
        let stdin = self.stdin.as_mut().ok_or("workload input already closed")?;
        writeln!(stdin, "{command}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("workload stopped before `{command}`: {e}"))?;
        match self.replies.recv_timeout(self.timeout) {
            Ok(line) => Ok(Reply { line }),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
                "workload did not answer `{command}` within {:?}",
                self.timeout
            )),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!(
                    "workload exited ({status}) without answering `{command}`"
                ))
            }
        }
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send `quit` and wait for the exit (killing it after the timeout).
    pub fn finish(mut self) -> Result<ExitStatus, String> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "quit");
        }
        let deadline = std::time::Instant::now() + self.timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Ok(status),
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err("workload did not exit; killed".into());
                }
                Err(e) => return Err(format!("waiting for the workload: {e}")),
            }
        }
    }
}

impl Drop for WorkloadProcess {
    fn drop(&mut self) {
        // Never leave a child behind on an error path.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
