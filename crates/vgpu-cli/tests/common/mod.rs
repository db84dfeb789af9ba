//! Helpers shared by the CLI's integration tests: run `vgpu` as a user would, bounded in time.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use vgpu_testkit::{built_library, clear_runner_settings};

/// A child process killed and reaped when dropped, so that a failing test leaves none
/// running.
#[derive(Debug)]
pub struct Reaped(pub Child);

impl Reaped {
    /// Kills it now (it must still be there to kill) and reaps it.
    pub fn kill(&mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The lines `child` prints on its (piped) stdout, read on a thread of their own so that a
/// test can wait for one with a timeout.
pub fn stdout_lines(child: &mut Child) -> Receiver<String> {
    let (tx, lines) = channel();
    let out = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || {
        for l in out.lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    lines
}

/// The start of every end-to-end run on the simulator: a private scratch directory whose
/// `driver/` holds the built simulator under the driver's names (what the NVIDIA container
/// runtime would mount from the host), and the built hook.
pub struct SimNode {
    pub dir: TempDir,
    /// `libvgpu.so`.
    pub hook: PathBuf,
}

impl SimNode {
    pub fn new(prefix: &str) -> Self {
        let hook = built_library("libvgpu.so");
        let dir = TempDir::new(prefix).unwrap();
        let sim = built_library("libvgpusim.so");
        vgpu_cli::hook_env::make_sim_link_dir(&sim, &dir.path().join("driver")).unwrap();
        SimNode { dir, hook }
    }

    /// `p` inside the scratch directory.
    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// The simulated driver's directory (for `LD_LIBRARY_PATH`).
    pub fn driver(&self) -> PathBuf {
        self.path("driver")
    }
}

/// A private temporary directory (tempfile's, mode 0700) removed on drop, named after its test.
#[derive(Debug)]
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    pub fn new(prefix: &str) -> std::io::Result<Self> {
        vgpu_cli::private_tempdir(prefix).map(Self)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// The `vgpu` binary under test.
pub fn vgpu_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vgpu"))
}

/// A `vgpu` command with a clean limit/preload environment (the test runner's own
/// environment must not leak into what is checked).
pub fn vgpu() -> Command {
    let mut cmd = Command::new(vgpu_exe());
    clear_runner_settings(&mut cmd);
    cmd
}

/// What a finished command printed.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Assert the command exited 0 (showing what it printed otherwise).
    #[track_caller]
    pub fn assert_success(&self) {
        assert_eq!(
            self.code(),
            Some(0),
            "stdout:\n{}\nstderr:\n{}",
            self.stdout,
            self.stderr
        );
    }

    /// Assert stdout contains each of `needles`.
    #[track_caller]
    pub fn assert_stdout_has(&self, needles: &[&str]) {
        assert_has("stdout", &self.stdout, needles);
    }

    /// Assert stderr contains each of `needles`.
    #[track_caller]
    pub fn assert_stderr_has(&self, needles: &[&str]) {
        assert_has("stderr", &self.stderr, needles);
    }
}

#[track_caller]
fn assert_has(which: &str, text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "{which} lacks {n:?}:\n{text}");
    }
}

fn drain(r: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(mut r) = r {
            let _ = r.read_to_string(&mut s);
        }
        s
    })
}

/// Spawns `cmd`. A program a test has just copied can be "busy" for an instant: another test
/// thread forking meanwhile holds the copy's write descriptor until its child execs
/// (ETXTBSY), so that is tried again.
fn spawn(cmd: &mut Command) -> Child {
    for _ in 0..100 {
        match cmd.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(Duration::from_millis(10));
            }
            spawned => return spawned.expect("spawn vgpu"),
        }
    }
    cmd.spawn().expect("spawn vgpu")
}

/// Run to completion, killing it after `limit`.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdin(Stdio::null());
    finish_with(cmd, limit, |_| ())
}

/// Run to completion with `input` on its stdin (then closed), killing it after 30 s.
pub fn run_with_stdin(mut cmd: Command, input: &'static [u8]) -> Output {
    use std::io::Write as _;
    cmd.stdin(Stdio::piped());
    finish_with(cmd, Duration::from_secs(30), |child| {
        let mut stdin = child.stdin.take().unwrap();
        std::thread::spawn(move || {
            let _ = stdin.write_all(input);
        });
    })
}

/// Spawns `cmd` with its output piped, lets `started` feed it, and waits at most `limit`.
fn finish_with(mut cmd: Command, limit: Duration, started: impl FnOnce(&mut Child)) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = spawn(&mut cmd);
    started(&mut child);
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let status = wait_bounded(&mut child, limit);
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Wait for `child`, killing it (and failing the test) after `limit`.
pub fn wait_bounded(child: &mut Child, limit: Duration) -> ExitStatus {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("command did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Adds `ARGS --cache CACHE` to `cmd`: most subcommands are pointed at one usage file.
pub fn cache_args(cmd: &mut Command, args: &[&str], cache: &Path) {
    cmd.args(args).arg("--cache").arg(cache);
}

/// A running `vgpu exporter`, killed on drop.
#[derive(Debug)]
pub struct Exporter {
    _child: Reaped,
    /// The `host:port` it listens on.
    pub addr: String,
    /// The first line it printed (the address and the files it serves).
    pub banner: String,
}

impl Exporter {
    /// `vgpu exporter --listen 127.0.0.1:0` with `args` (a `--cache` among them, or the
    /// environment's file) and the environment of `cmd`, a `vgpu()` command; waits for the
    /// line with its address.
    pub fn start(mut cmd: Command, args: &[&str]) -> Exporter {
        cmd.args(["exporter", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let banner = stdout_lines(&mut child)
            .recv_timeout(Duration::from_secs(5))
            .expect("the exporter printed its address");
        let addr = banner
            .split("http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .unwrap_or_else(|| panic!("no address in {banner:?}"))
            .to_owned();
        Exporter {
            _child: Reaped(child),
            addr,
            banner,
        }
    }
}

/// Run with a 30 s bound.
pub fn run(cmd: Command) -> Output {
    run_bounded(cmd, Duration::from_secs(30))
}

/// Assert a command failed with `code` and said something containing each of `needles` on stderr.
#[track_caller]
pub fn assert_fails(out: &Output, code: i32, needles: &[&str]) {
    assert_eq!(
        out.code(),
        Some(code),
        "stdout: {}\nstderr: {}",
        out.stdout,
        out.stderr
    );
    for n in needles {
        assert!(
            out.stderr.contains(n),
            "stderr lacks {n:?}:\n{}",
            out.stderr
        );
    }
}

/// Whether this machine lets us make PID and mount namespaces with mounts in them.
pub fn namespaces_permitted() -> bool {
    Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--propagation",
            "private",
            "--mount-proc",
        ])
        .args(["sh", "-c", "mount -t tmpfs tmpfs /mnt"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn parse_metrics(body: &str) -> Vec<prometheus_parse::Sample> {
    let lines = body.lines().map(|l| Ok(l.to_owned()));
    prometheus_parse::Scrape::parse(lines).unwrap().samples
}

/// The value of the one sample of `metric` with `labels`.
pub fn metric_value(
    samples: &[prometheus_parse::Sample],
    metric: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    let hits: Vec<f64> = samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .filter_map(|s| match s.value {
            prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Counter(v) => Some(v),
            _ => None,
        })
        .collect();
    assert!(
        hits.len() <= 1,
        "{metric} {labels:?}: {} series",
        hits.len()
    );
    hits.first().copied()
}
