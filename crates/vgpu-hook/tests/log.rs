//! End to end: the hook's log never kills, hangs or changes its host program, whatever its
//! stderr is (a pipe or socket whose reader has gone, one nobody drains), and each kind of
//! line is rate-limited with every suppressed line counted.
//!
//! The program makes N allocations the limit refuses (one log line each without a rate
//! limit), then reports on stdout what it can see of its own state.

mod support;

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use support::Standalone;

/// `refusals N BYTES [block|write]`: N allocations of BYTES (each over the limit), then one
/// line: the refusals, whether stderr's status flags are as they were, and whether SIGPIPE
/// is blocked or pending. `block`: the program blocks SIGPIPE itself first. `write`: then it
/// writes to its stderr itself (a pipe whose reader has gone kills it, as without the hook).
/// A failed driver call is reported on stdout: on a stderr whose reader has gone, the
/// program's own message would kill it with a SIGPIPE that looks like the log's.
const PROGRAM: &str = r#"
#include "standalone.h"
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#undef CHECK
#define CHECK(x) do { CUresult r_ = (x); if (r_) { printf("%s = %d\n", #x, r_); return 2; } } while (0)
int main(int argc, char **argv) {
  if (argc < 3) return 1;
  long n = atol(argv[1]);
  unsigned long long bytes = strtoull(argv[2], 0, 10), p;
  const char *mode = argc > 3 ? argv[3] : "";
  sigset_t pipe_set, mask, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  if (!strcmp(mode, "block")) sigprocmask(SIG_BLOCK, &pipe_set, 0);
  int flags = fcntl(2, F_GETFL);
  if (load_driver()) return 3;
  CUresult (*cuMemAlloc_v2)(unsigned long long *, size_t);
  NEED(cuMemAlloc_v2)
  int dev; H ctx;
  CHECK(cuInit(0)); CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev)); CHECK(cuCtxSetCurrent(ctx));
  long refused = 0;
  for (long i = 0; i < n; i++) refused += cuMemAlloc_v2(&p, bytes) == 2;
  sigprocmask(SIG_BLOCK, 0, &mask);
  sigpending(&pending);
  printf("refused=%ld flags_kept=%d sigpipe_blocked=%d sigpipe_pending=%d\n", refused,
         fcntl(2, F_GETFL) == flags, sigismember(&mask, SIGPIPE), sigismember(&pending, SIGPIPE));
  fflush(stdout);
  if (!strcmp(mode, "write")) {
    if (write(2, "mine\n", 5) < 0) perror("write");
    printf("survived its own write\n");
  }
  return 0;
}
"#;

const MIB: u64 = 1 << 20;
/// Over the 64 MiB limit: every allocation is refused, with a line at the default level.
const OVER: u64 = 128 * MIB;

fn program() -> &'static Standalone {
    static P: OnceLock<Standalone> = OnceLock::new();
    P.get_or_init(|| support::standalone("log", "refusals", PROGRAM))
}

/// The program making `n` refusals, its stderr `stderr`, stdout piped. Each run counts in
/// a usage file of its own: the tests run at once, and a fresh file that another test's
/// program is joining would be removed under it (the hook then refuses every allocation).
fn start(tag: &str, n: u64, mode: &str, stderr: Stdio) -> Child {
    static RUNS: AtomicU32 = AtomicU32::new(0);
    let p = program();
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let cache = p.fresh_cache(&format!("{tag}-{run}.cache"));
    let n = n.to_string();
    let over = OVER.to_string();
    let mut cmd = p.hooked(&[&n, &over, mode], &cache);
    cmd.env("CUDA_DEVICE_MEMORY_LIMIT", "64m")
        .env("VGPU_SIM_TOTAL_MEM", "1g")
        .env("VGPU_SIM_CTX_OVERHEAD", "0")
        .stdin(Stdio::null())
        .stderr(stderr);
    cmd.spawn().expect("start the program")
}

/// Waits for `child` at most `bound` (killing it then: a hang is a failure, not a wait);
/// its status and stdout.
fn finish(mut child: Child, bound: Duration) -> (ExitStatus, String) {
    let end = Instant::now() + bound;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the program did not finish in {bound:?}: blocked writing its stderr");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    (status, out)
}

/// A pipe: (read end, write end).
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: a valid array of two descriptors.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both were just created and are owned here.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// The two kinds of stderr that can raise SIGPIPE or block: (name, the end the program
/// writes, the end a reader holds).
fn streams() -> [(&'static str, OwnedFd, OwnedFd); 2] {
    let (r, w) = pipe();
    let (ours, theirs) = UnixStream::pair().unwrap();
    [("pipe", w, r), ("socket", theirs.into(), ours.into())]
}

#[test]
fn a_program_whose_stderr_reader_has_gone_is_not_killed_by_the_log() {
    for (kind, writer, reader) in streams() {
        drop(reader);
        let (status, out) = finish(
            start(kind, 100, "", Stdio::from(writer)),
            Duration::from_secs(60),
        );
        assert_eq!(
            status.code(),
            Some(0),
            "{kind}: {status:?} (signal 13 = SIGPIPE)\n{out}"
        );
        assert_eq!(
            out, "refused=100 flags_kept=1 sigpipe_blocked=0 sigpipe_pending=0\n",
            "{kind}"
        );
    }
    // The program's own SIGPIPE is as it was: its own write to the pipe still kills it.
    let (r, w) = pipe();
    drop(r);
    let (status, out) = finish(
        start("own", 100, "write", w.into()),
        Duration::from_secs(60),
    );
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}\n{out}");
    assert!(
        out.starts_with("refused=100 ") && !out.contains("survived"),
        "{out}"
    );
    // A program that blocks SIGPIPE itself finds none pending: the log took back its own.
    let (r, w) = pipe();
    drop(r);
    let (status, out) = finish(
        start("block", 100, "block", w.into()),
        Duration::from_secs(60),
    );
    assert_eq!(status.code(), Some(0), "{status:?}\n{out}");
    assert_eq!(
        out,
        "refused=100 flags_kept=1 sigpipe_blocked=1 sigpipe_pending=0\n"
    );
}

#[test]
fn a_program_whose_stderr_nobody_drains_never_waits_for_the_log() {
    // 5000 refusals: unlimited, their lines fill a 64 KiB pipe after a few hundred and the
    // next write blocks until someone reads, which nobody does. The bound only tells a
    // hang from a finish (5000 refusals take milliseconds).
    for (kind, writer, reader) in streams() {
        let (status, out) = finish(
            start(kind, 5000, "", Stdio::from(writer)),
            Duration::from_secs(60),
        );
        assert_eq!(status.code(), Some(0), "{kind}: {status:?}\n{out}");
        assert!(
            out.starts_with("refused=5000 flags_kept=1 "),
            "{kind}: {out}"
        );
        drop(reader);
    }
}

/// The number after `prefix` in `text`, if any.
fn number_after(text: &str, prefix: &str) -> Option<u64> {
    let rest = &text[text.find(prefix)? + prefix.len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[test]
fn refusal_lines_are_rate_limited_and_every_suppressed_one_is_counted() {
    let t0 = Instant::now();
    let child = start("rate", 5000, "", Stdio::piped());
    let out = child.wait_with_output().unwrap();
    let elapsed = t0.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let refusals: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("out of memory on device 0"))
        .collect();
    // A burst of 10, then 2 a second (docs/hook.md, "Log").
    let most = 10 + 2 * elapsed.as_secs() + 2;
    assert!(
        !refusals.is_empty() && refusals.len() as u64 <= most,
        "{} refusal lines in {elapsed:?}:\n{stderr}",
        refusals.len()
    );
    // Each suppressed line is counted once: on a later line of its kind, or at exit.
    let noted: u64 = refusals
        .iter()
        .filter(|l| l.contains(" more lines like this were suppressed"))
        .filter_map(|l| number_after(l, " ("))
        .sum();
    let at_exit = stderr
        .lines()
        .find(|l| l.contains("log lines were suppressed by the rate limit"))
        .and_then(|l| number_after(l, "MSG] "))
        .unwrap_or(0);
    assert_eq!(
        refusals.len() as u64 + noted + at_exit,
        5000,
        "written + noted + said at exit:\n{stderr}"
    );
    assert!(
        at_exit > 0,
        "the count of the last ones is said at exit:\n{stderr}"
    );
}
