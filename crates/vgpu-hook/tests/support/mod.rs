//! Shared plumbing of the end-to-end tests: find `libvgpu.so` and the simulated driver, build
//! the C test programs with `cc`, run them as children under the hook with a fresh shared
//! file each, and parse their `key=value` output.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use vgpu_testkit::{built_library, cc, clear_runner_settings, compile, compile_c};

pub const MIB: u64 = 1 << 20;

/// Where the built libraries and the compiled programs are.
pub struct Env {
    /// `libvgpu.so`.
    pub hook: PathBuf,
    /// Directory holding `libcuda.so(.1)` and `libnvidia-ml.so(.1)` → `libvgpusim.so`.
    pub simlib: PathBuf,
    /// The compiled `probe` program.
    pub probe: PathBuf,
    /// Scratch directory of this test binary.
    pub scratch: PathBuf,
    /// `interposer.so`: defines `cuMemAlloc_v2` (returning 777) and nothing else.
    pub interposer: PathBuf,
}

/// `libvgpu.so` and `libvgpusim.so` as the workspace build left them.
fn built_libraries() -> (PathBuf, PathBuf) {
    (built_library("libvgpu.so"), built_library("libvgpusim.so"))
}

fn programs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs")
}

/// Builds (once per test binary) the environment every test needs.
pub fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let (hook, sim) = built_libraries();
        let scratch = scratch_root().to_path_buf();
        let simlib = scratch.join("simlib");
        std::fs::create_dir_all(&simlib).expect("simlib dir");
        for name in [
            "libcuda.so",
            "libcuda.so.1",
            "libnvidia-ml.so",
            "libnvidia-ml.so.1",
        ] {
            std::os::unix::fs::symlink(&sim, simlib.join(name)).expect("symlink");
        }
        let probe = scratch.join("probe");
        compile(
            cc().args(["-O1", "-Wall", "-o"])
                .arg(&probe)
                .arg(programs_dir().join("probe.c"))
                .arg("-I")
                .arg(programs_dir())
                .arg("-L")
                .arg(&simlib)
                .args(["-lcuda", "-ldl", "-lpthread"]),
        );
        let interposer = scratch.join("interposer.so");
        compile(
            cc().args(["-shared", "-fPIC", "-o"])
                .arg(&interposer)
                .arg(programs_dir().join("interposer.c")),
        );
        Env {
            hook,
            simlib,
            probe,
            scratch,
            interposer,
        }
    })
}

/// This test binary's scratch directory, `$TMPDIR/vgpu-hook-tests-<pid>`, made empty on first
/// use (after removing those of earlier runs whose process is gone): everything the tests
/// write goes under it.
fn scratch_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        remove_stale_scratch();
        let root = std::env::temp_dir().join(format!("vgpu-hook-tests-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("scratch dir");
        root
    })
}

/// A standalone C test program: its own source (which loads the driver with `dlopen`; it
/// may include `tests/programs/standalone.h`), compiled with `-ldl` into a fresh directory
/// `dir` of this binary's scratch directory that also holds the simulated driver as
/// `libcuda.so.1` and `libnvidia-ml.so.1` (run it with `LD_LIBRARY_PATH=dir`).
pub struct Standalone {
    /// The directory of the program and the driver links.
    pub dir: PathBuf,
    /// The compiled program.
    pub program: PathBuf,
    /// `libvgpu.so`.
    pub hook: PathBuf,
}

/// Builds a [`Standalone`] program named `name` from `source` in a directory tagged `tag`.
pub fn standalone(tag: &str, name: &str, source: &str) -> Standalone {
    let (hook, sim) = built_libraries();
    let dir = scratch_root().join(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    for lib in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::os::unix::fs::symlink(&sim, dir.join(lib)).expect("symlink");
    }
    let includes = format!("-I{}", programs_dir().display());
    let program = compile_c(&dir, name, source, ["-O2", &includes]);
    Standalone { dir, program, hook }
}

impl Standalone {
    /// The program with `args` under the hook, counting into the usage file `cache`, stdout
    /// and stderr piped, and no limit, policy or turn directory inherited from the test
    /// runner or the host ([`clear_runner_settings`]; callers set the ones they test).
    pub fn hooked(&self, args: &[&str], cache: &Path) -> Command {
        let mut cmd = Command::new(&self.program);
        clear_runner_settings(&mut cmd);
        cmd.args(args)
            .env("LD_PRELOAD", &self.hook)
            .env("LD_LIBRARY_PATH", &self.dir)
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache)
            .env_remove("GPU_CORE_UTILIZATION_POLICY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// The path of usage file `name` in [`Self::dir`], removed so that a run starts a fresh
    /// one.
    pub fn fresh_cache(&self, name: &str) -> PathBuf {
        let cache = self.dir.join(name);
        let _ = std::fs::remove_file(&cache);
        cache
    }

    /// Directory `name` in [`Self::dir`], made empty.
    pub fn fresh_dir(&self, name: &str) -> PathBuf {
        let d = self.dir.join(name);
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}

/// Scratch directories of earlier test runs whose process is gone (nothing runs at exit to
/// remove them).
fn remove_stale_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("vgpu-hook-tests-")
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A fresh shared-cache path for one test.
pub fn fresh_cache(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    env().scratch.join(format!("{tag}-{n}.cache"))
}

/// The `key=value` lines a program printed (repeated keys keep every value).
#[derive(Debug, Default, Clone)]
pub struct Out {
    pub map: HashMap<String, Vec<String>>,
    pub stdout: String,
    pub stderr: String,
    pub status: Option<i32>,
}

impl Out {
    pub fn parse(stdout: &str, stderr: &str, status: Option<i32>) -> Out {
        let mut map: HashMap<String, Vec<String>> = HashMap::new();
        for line in stdout.lines() {
            if let Some((k, v)) = line.split_once('=') {
                map.entry(k.trim().to_string())
                    .or_default()
                    .push(v.trim().to_string());
            }
        }
        Out {
            map,
            stdout: stdout.into(),
            stderr: stderr.into(),
            status,
        }
    }

    /// The (last) value of `key`; panics with the whole output when absent.
    pub fn get(&self, key: &str) -> &str {
        match self.map.get(key).and_then(|v| v.last()) {
            Some(v) => v,
            None => panic!("no `{key}` in the output:\n{self}"),
        }
    }

    pub fn num(&self, key: &str) -> i64 {
        let v = self.get(key);
        v.parse()
            .unwrap_or_else(|_| panic!("`{key}={v}` is not a number:\n{}", self.stdout))
    }

    pub fn u(&self, key: &str) -> u64 {
        self.num(key) as u64
    }
}

/// What the program printed, for a failure message: stdout, then stderr.
impl std::fmt::Display for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}\nstderr:\n{}", self.stdout, self.stderr)
    }
}

/// Every way the probe reaches the driver ([`Run::via`], `VGPU_VIA` in `probe.c`): linked
/// symbols, `dlopen`+`dlsym`, `cuGetProcAddress`, and `cuGetProcAddress` with the
/// per-thread-default-stream flag.
pub const VIAS: [&str; 4] = ["link", "dlsym", "procaddr", "ptsz"];

/// One run of the probe under the hook (or not), with the environment of a container.
#[derive(Debug, Clone)]
pub struct Run {
    pub vars: Vec<(String, String)>,
    pub hooked: bool,
    pub via: String,
    /// Preload this library instead of the hook.
    pub preload: Option<PathBuf>,
}

impl Run {
    /// Under the hook, with `limit` on every device, a fresh shared file, and a simulated
    /// 1 GiB device with no context or module overhead unless a test says otherwise.
    pub fn hooked(limit: &str) -> Run {
        let cache = fresh_cache("t");
        Run {
            vars: vec![
                ("CUDA_DEVICE_MEMORY_LIMIT".into(), limit.into()),
                (
                    "CUDA_DEVICE_MEMORY_SHARED_CACHE".into(),
                    cache.display().to_string(),
                ),
                ("VGPU_SIM_TOTAL_MEM".into(), "1g".into()),
                ("VGPU_SIM_CTX_OVERHEAD".into(), "0".into()),
                ("VGPU_SIM_MODULE_OVERHEAD".into(), "0".into()),
            ],
            hooked: true,
            via: "link".into(),
            preload: None,
        }
    }

    /// The same environment without the hook (to show a test can fail).
    pub fn bare(mut self) -> Run {
        self.hooked = false;
        self
    }

    pub fn var(mut self, k: &str, v: &str) -> Run {
        self.vars.retain(|(x, _)| x != k);
        self.vars.push((k.into(), v.into()));
        self
    }

    pub fn via(mut self, via: &str) -> Run {
        self.via = via.into();
        self
    }

    pub fn cache(&self) -> String {
        self.vars
            .iter()
            .find(|(k, _)| k == "CUDA_DEVICE_MEMORY_SHARED_CACHE")
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let e = env();
        let mut c = Command::new(&e.probe);
        c.args(args);
        clear_runner_settings(&mut c);
        c.env("LD_LIBRARY_PATH", &e.simlib);
        c.env("VGPU_VIA", &self.via);
        if self.hooked {
            c.env("LD_PRELOAD", &e.hook);
        }
        if let Some(p) = &self.preload {
            c.env("LD_PRELOAD", p);
        }
        for (k, v) in &self.vars {
            c.env(k, v);
        }
        c
    }

    /// Starts the probe with `stdin` and `stderr` as given and stdout piped.
    fn start(&self, args: &[&str], stdin: Stdio, stderr: Stdio) -> Child {
        self.command(args)
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn probe")
    }

    /// Runs the probe to completion (60 s at most).
    pub fn run(&self, args: &[&str]) -> Out {
        let mut child = self.start(args, Stdio::null(), Stdio::piped());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            if child.try_wait().expect("wait").is_some() {
                break;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("probe {args:?} did not finish in 60 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let o = child.wait_with_output().expect("output");
        let out = Out::parse(
            &String::from_utf8_lossy(&o.stdout),
            &String::from_utf8_lossy(&o.stderr),
            o.status.code(),
        );
        assert!(
            o.status.success(),
            "probe {args:?} failed ({:?}) under {:?}:\n{}\nstderr:\n{}",
            o.status,
            self,
            out.stdout,
            out.stderr
        );
        out
    }

    /// Starts a probe that keeps running (for `hold`), with stdin and stdout piped.
    pub fn spawn(&self, args: &[&str]) -> Held {
        let mut child = self.start(args, Stdio::piped(), Stdio::inherit());
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Held {
            child,
            stdin,
            stdout,
        }
    }
}

/// A running probe.
pub struct Held {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Held {
    /// Reads lines until one starts with `prefix`; returns it.
    pub fn wait_for(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("read");
            assert!(n > 0, "probe exited before printing `{prefix}`");
            if line.starts_with(prefix) {
                return line.trim().to_string();
            }
        }
    }

    /// Reads lines until one starts with `prefix`; returns every line read, that one included.
    pub fn read_until(&mut self, prefix: &str) -> String {
        let mut all = String::new();
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).expect("read");
            assert!(n > 0, "probe exited before printing `{prefix}`:\n{all}");
            all.push_str(&line);
            if line.starts_with(prefix) {
                return all;
            }
        }
    }

    /// Sends one line to the probe's stdin (it goes on from a `hold_here`).
    pub fn send(&mut self, line: &str) {
        if let Some(i) = self.stdin.as_mut() {
            let _ = i.write_all(format!("{line}\n").as_bytes());
            let _ = i.flush();
        }
    }

    /// Tells a `hold` probe to let go, and waits for it to exit.
    pub fn finish(mut self) -> String {
        if let Some(mut i) = self.stdin.take() {
            let _ = i.write_all(b"go\n");
        }
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut self.stdout, &mut rest);
        let st = self.child.wait().expect("wait");
        assert!(st.success(), "held probe failed: {st:?}");
        rest
    }

    /// The probe's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the probe (SIGKILL) and reaps it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The setting of the move and swap tests: a 128 MiB simulated device (16 MiB per context,
/// modules free) under a 256 MiB limit with oversubscription, so that a program that fills it
/// gets host-backed memory; nothing else inherited that changes where memory goes.
pub fn small_oversubscribed_device(cmd: &mut Command) {
    cmd.env("CUDA_DEVICE_MEMORY_LIMIT", "256m")
        .env("CUDA_OVERSUBSCRIBE", "true")
        .env("VGPU_SIM_TOTAL_MEM", "128m")
        .env("VGPU_SIM_CTX_OVERHEAD", "16m")
        .env("VGPU_SIM_MODULE_OVERHEAD", "0")
        .env("VGPU_SIM_HOST_PINNED_LIMIT", "1g")
        .env("VGPU_RECONCILE_MS", "off")
        .env("CUDA_MODULE_LOADING", "EAGER")
        .env_remove("VGPU_HOST_SPILL")
        .env_remove("VGPU_DEVICE_RESERVE")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("VGPU_SUBALLOC");
}

/// A program that stops at its pauses: it prints `pause=<step>` and waits for a line on its
/// stdin. What it printed is kept, for its `key=value` lines.
pub struct Paused {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Everything it printed so far.
    pub out: String,
}

impl Paused {
    /// Starts `cmd` with stdin and stdout piped (stderr as `cmd` says).
    pub fn spawn(mut cmd: Command) -> Paused {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the program");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Paused {
            child,
            stdin,
            stdout,
            out: String::new(),
        }
    }

    /// Runs to pause `step` (the program waits there until [`Paused::go`]).
    pub fn reach(&mut self, step: &str) {
        self.line(&format!("pause={step}"));
    }

    /// Reads its output up to a line that is `text`.
    pub fn line(&mut self, text: &str) {
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the program ended before `{text}`:\n{}", self.out);
            self.out.push_str(&line);
            if line.trim() == text {
                return;
            }
        }
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Reads the rest of its output and waits for it to end.
    pub fn end(&mut self) -> std::process::ExitStatus {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        self.out.push_str(&rest);
        self.child.wait().unwrap()
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Lets it go on from its pause.
    pub fn go(&mut self) {
        writeln!(self.stdin, "go").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The number it printed as `key=<n>`.
    pub fn value(&self, key: &str) -> i64 {
        self.out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in\n{}", self.out))
            .trim()
            .parse()
            .unwrap()
    }

    /// Waits for it to end, successfully and after printing `end`.
    pub fn finish(mut self) {
        let st = self.end();
        assert!(
            st.success() && self.out.contains("end"),
            "{st:?}\n{}",
            self.out
        );
    }
}
