//! End to end: the SM limiter of `libvgpu.so` over the simulated driver.
//!
//! A small C program (built here with `cc`) reaches the driver through `dlopen` +
//! `dlsym` and launches the simulator's `spin` kernel (it keeps its stream busy for the
//! given time) back to back; its throughput under `CUDA_DEVICE_SM_LIMIT` is compared with an
//! unlimited run of the same program in the same test. Needs `libvgpu.so` and
//! `libvgpusim.so` built in the target directory (`cargo xtask test` does that).

use std::process::Output;

use support::Standalone;

mod support;
use std::sync::{Mutex, MutexGuard, OnceLock};

const PROGRAM: &str = r#"
#include "standalone.h"
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
  if (argc < 4) return 1;
  double seconds = atof(argv[1]);
  double warmup = argc > 4 ? atof(argv[4]) : 0.3;
  unsigned long long ns = strtoull(argv[2], 0, 10);
  char mode = argv[3][0]; /* k: cuLaunchKernel, p: cuLaunchKernel_ptsz on stream 0,
                             c: cuLaunchCooperativeKernel, g: cuGraphLaunch of 4 kernels */
  int loaded = load_driver();
  if (loaded) return loaded;
  CUresult (*cuLaunchKernel_ptsz)(H, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, H, void **, void **);
  CUresult (*cuLaunchCooperativeKernel)(H, unsigned, unsigned, unsigned, unsigned, unsigned,
                                        unsigned, unsigned, H, void **);
  CUresult (*cuStreamBeginCapture_v2)(H, unsigned);
  CUresult (*cuStreamEndCapture)(H, H *);
  CUresult (*cuGraphInstantiateWithFlags)(H *, H, unsigned long long);
  CUresult (*cuGraphLaunch)(H, H);
  NEED(cuLaunchKernel_ptsz) NEED(cuLaunchCooperativeKernel)
  NEED(cuStreamBeginCapture_v2) NEED(cuStreamEndCapture) NEED(cuGraphInstantiateWithFlags)
  NEED(cuGraphLaunch)
  int dev; H ctx, mod, f, s, g, exec, ring[4];
  CHECK(cuInit(0));
  const char *spin_device = getenv("SPIN_DEVICE"); /* the ordinal to launch on; 0 unset */
  CHECK(cuDeviceGet(&dev, spin_device ? atoi(spin_device) : 0));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cuCtxSetCurrent(ctx));
  CHECK(cuModuleLoadData(&mod, "vgpusim-module: spin tick"));
  CHECK(cuModuleGetFunction(&f, mod, "spin"));
  /* TICK: after warm-up, every 8th iteration also launches a second function ("tick", a
     no-op), right behind the spin: its first launch comes while the stream holds work,
     which under lazy loading waits for the context inside the launch call. */
  H tick;
  CHECK(cuModuleGetFunction(&tick, mod, "tick"));
  int with_tick = getenv("TICK") != 0;
  CHECK(cuStreamCreate(&s, 0));
  void *args[] = {&ns};
  for (int i = 0; i < 4; ++i) CHECK(cuEventCreate(&ring[i], 0));
  int per_launch = 1;
  if (mode == 'p') s = 0;
  if (mode == 'g') {
    per_launch = 4;
    CHECK(cuStreamBeginCapture_v2(s, 0));
    for (int i = 0; i < per_launch; ++i) CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, 0));
    CHECK(cuStreamEndCapture(s, &g));
    CHECK(cuGraphInstantiateWithFlags(&exec, g, 0));
  }
  long n = 0;
  double t0 = 0, start = now();
  for (;;) {
    double t = now();
    if (t0 == 0 && t - start >= warmup) {  /* warm-up done: count from here */
      CHECK(mode == 'p' ? cuStreamSynchronize((H)2) : cuStreamSynchronize(s));
      t0 = now();
      n = 0;
    }
    if (t0 != 0 && t - t0 >= seconds) break;
    switch (mode) {
      case 'p': CHECK(cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, 0, args, 0)); break;
      case 'c': CHECK(cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args)); break;
      case 'g': CHECK(cuGraphLaunch(exec, s)); break;
      default: CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, 0));
    }
    if (with_tick && t0 != 0 && n % 8 == 0) {
      if (mode == 'p') CHECK(cuLaunchKernel_ptsz(tick, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0));
      else CHECK(cuLaunchKernel(tick, 1, 1, 1, 1, 1, 1, 0, s, 0, 0));
    }
    /* The simulator's queues are unbounded (a real driver blocks a launch when its queue
       is full): keep at most 4 launches in flight, waiting on the one 4 launches back. */
    H ev = ring[n % 4];
    CHECK(cuEventRecord(ev, mode == 'p' ? (H)2 : s));
    ++n;
    CHECK(cuEventSynchronize(ring[n % 4]));
  }
  /* The simulator's NVML reports the share of its window (VGPU_SIM_UTIL_WINDOW_MS, set to
     the measured span) during which a kernel ran: the GPU busy fraction itself. */
  double wall = now() - t0;
  int busy = nvml_busy_pct();
  if (busy < 0) return 3;
  CHECK(mode == 'p' ? cuStreamSynchronize((H)2) : cuStreamSynchronize(s));
  printf("RESULT kernels_per_s=%f busy_pct=%d\n", n * per_launch / wall, busy);
  fflush(stdout);
  /* RESET_THEN: reset the primary context (everything made in it goes, registrations and
     pinned memory included), then launch again in the new one. */
  if (getenv("RESET_THEN")) {
    CUresult (*cuDevicePrimaryCtxReset_v2)(int);
    NEED(cuDevicePrimaryCtxReset_v2)
    CHECK(cuDevicePrimaryCtxReset_v2(dev));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuModuleLoadData(&mod, "vgpusim-module: spin tick"));
    CHECK(cuModuleGetFunction(&f, mod, "spin"));
    CHECK(cuStreamCreate(&s, 0));
    for (int i = 0; i < 400; ++i) {
      CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, 0));
      if (i % 4 == 3) CHECK(cuStreamSynchronize(s));
    }
    CHECK(cuStreamSynchronize(s));
    printf("after_reset=ok\n");
    fflush(stdout);
  }
  /* FORK_IDLE: fork a child that exits normally (its exit handlers run) at once, beside the
     parent's threads; the parent reports how it ended, then lingers. */
  if (getenv("FORK_IDLE")) {
    pid_t c = fork();
    if (c == 0) exit(0);
    int st = 0;
    waitpid(c, &st, 0);
    printf("child_exit=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
    fflush(stdout);
  }
  /* Optionally stay alive without launching (a peer whose last published share goes stale). */
  if (argc > 5) {
    double linger = atof(argv[5]);
    struct timespec d = {(time_t)linger, (long)((linger - (time_t)linger) * 1e9)};
    nanosleep(&d, 0);
  }
  return 0;
}
"#;

fn env() -> &'static Standalone {
    static ENV: OnceLock<Standalone> = OnceLock::new();
    ENV.get_or_init(|| support::standalone("sm-limit", "spin", PROGRAM))
}

/// Runs the program; returns kernels per second. `limit` None = no SM limit.
fn run(limit: Option<u32>, cache: &str, seconds: f64, kernel_us: u64, mode: char) -> Measured {
    let out = spawn(limit, cache, seconds, kernel_us, mode)
        .wait_with_output()
        .unwrap();
    parse(&out)
}

fn spawn(
    limit: Option<u32>,
    cache: &str,
    seconds: f64,
    kernel_us: u64,
    mode: char,
) -> std::process::Child {
    let e = env();
    let args = [
        seconds.to_string(),
        (kernel_us * 1000).to_string(),
        mode.to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = e.hooked(&args, &e.dir.join(cache));
    cmd.env(
        "VGPU_SIM_UTIL_WINDOW_MS",
        ((seconds * 1000.0) as u64).to_string(),
    );
    if let Some(l) = limit {
        cmd.env("CUDA_DEVICE_SM_LIMIT", l.to_string());
    }
    cmd.spawn().expect("spawn the test program")
}

/// What one run of the program measured.
#[derive(Debug, Clone, Copy)]
struct Measured {
    kernels_per_s: f64,
    /// Share of the measured span during which the simulated GPU ran a kernel.
    busy_pct: f64,
}

fn parse(out: &Output) -> Measured {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "program failed ({}): {stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |name: &str| -> f64 {
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix("RESULT "))
            .flat_map(str::split_whitespace)
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {stdout:?}"))
    };
    Measured {
        kernels_per_s: field("kernels_per_s"),
        busy_pct: field("busy_pct"),
    }
}

/// Waits for a run of the program and reads what it measured.
fn measured(child: std::process::Child) -> Measured {
    parse(&child.wait_with_output().unwrap())
}

/// The usage file `cache` as it is now.
fn snapshot(cache: &std::path::Path) -> vgpu_shm::TableSnapshot {
    vgpu_shm::UsageTable::open_read_only(cache)
        .expect("open the shared file")
        .snapshot()
}

/// The throughput, in percent of an unlimited run's, that a GPU held busy `target`% should
/// reach (the unlimited run kept it busy `unlimited.busy_pct`%).
fn expected_ratio(target: f64, unlimited: Measured) -> f64 {
    target * 100.0 / unlimited.busy_pct.max(1.0)
}

/// Whether `ratio` is within a factor `factor` of `expected` either way (throughput on a
/// loaded test machine is noisy: only a coarse check).
fn near(ratio: f64, expected: f64, factor: f64) -> bool {
    ratio < expected * factor && ratio > expected / factor
}

/// The limit holds if the GPU was busy `target`% of the time (± `tol` points), and the
/// program made progress at the matching rate compared with an unlimited run.
fn check_held(
    what: &str,
    limited: Measured,
    unlimited: Measured,
    target: f64,
    tol: f64,
) -> Result<(), String> {
    let ratio = 100.0 * limited.kernels_per_s / unlimited.kernels_per_s;
    eprintln!(
        "{what}: GPU busy {}% (unlimited {}%), throughput {ratio:.1}% of unlimited",
        limited.busy_pct, unlimited.busy_pct
    );
    if (limited.busy_pct - target).abs() > tol {
        return Err(format!(
            "{what}: GPU busy {}% for a limit of {target}% (± {tol}); {limited:?} vs unlimited {unlimited:?}",
            limited.busy_pct
        ));
    }
    let expected = expected_ratio(target, unlimited);
    if !near(ratio, expected, 1.6) {
        return Err(format!(
            "{what}: throughput {ratio:.1}% of unlimited, expected about {expected:.1}%"
        ));
    }
    Ok(())
}

/// Measures an unlimited and a limited run of `mode` and checks the limit held. The simulated
/// GPU's kernels are CPU threads, so a burst of load from elsewhere on a 2-core machine can
/// stretch one measurement: a failed check is measured once more, and both must fail for the
/// test to fail (a real regression fails every time). Takes the [`serial`] lock.
fn assert_held(what: &str, mode: char, kernel_us: u64, limit: u32, tol: f64) {
    let _one = serial();
    let mut failures = Vec::new();
    for attempt in 0..2 {
        let base = baseline(mode, kernel_us);
        let got = run(
            Some(limit),
            &format!("{mode}{limit}-{attempt}.cache"),
            1.5,
            kernel_us,
            mode,
        );
        match check_held(what, got, base, f64::from(limit), tol) {
            Ok(()) => return,
            Err(e) => failures.push(e),
        }
    }
    panic!("{}", failures.join("\n"));
}

/// Timing tests run one at a time (the machine may have few cores).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Unlimited throughput of `mode`.
fn baseline(mode: char, kernel_us: u64) -> Measured {
    run(
        None,
        &format!("base-{mode}-{kernel_us}.cache"),
        1.0,
        kernel_us,
        mode,
    )
}

#[test]
fn kernel_launches_are_held_to_the_limit() {
    assert_held("cuLaunchKernel at 30%", 'k', 2_000, 30, 5.0);
}

#[test]
fn cooperative_launches_are_held_to_the_limit() {
    assert_held("cuLaunchCooperativeKernel at 50%", 'c', 2_000, 50, 5.0);
}

#[test]
fn graph_launches_are_measured_and_held() {
    // Capturing goes through the hooked launch too: it must not be throttled or measured
    // (the simulator rejects events on a capturing stream), and the graph's launches are.
    assert_held("cuGraphLaunch at 25%", 'g', 1_000, 25, 5.0);
}

/// The program for 2 s of 2 ms kernels after a 1 s warm-up on file `cache` under
/// `CUDA_DEVICE_SM_LIMIT=limit`, NVML's window the measured span: a run that contends.
fn two_seconds_limited(cache: &std::path::Path, limit: &str) -> std::process::Command {
    let mut cmd = env().hooked(&["2", "2000000", "k", "1.0"], cache);
    cmd.env("CUDA_DEVICE_SM_LIMIT", limit)
        .env("VGPU_SIM_UTIL_WINDOW_MS", "2000");
    cmd
}

#[test]
fn two_processes_share_one_container_limit() {
    let _one = serial();
    let cache = env().fresh_cache("shared50.cache");
    let spawn_one = || two_seconds_limited(&cache, "50").spawn().expect("spawn");
    let (a, b) = (spawn_one(), spawn_one());
    let (a, b) = (measured(a), measured(b));
    eprintln!(
        "two processes at one 50% limit: {}% + {}%",
        a.busy_pct, b.busy_pct
    );
    // Each simulated process has its own simulated GPU; the limit is the container's.
    let total = a.busy_pct + b.busy_pct;
    assert!(
        (total - 50.0).abs() <= 7.0,
        "container total {total}% for 50%: {a:?} {b:?}"
    );
    assert!(
        a.busy_pct >= 10.0 && b.busy_pct >= 10.0,
        "one starved: {a:?} {b:?}"
    );
}

#[test]
fn per_thread_stream_launches_are_held() {
    assert_held("cuLaunchKernel_ptsz at 40%", 'p', 2_000, 40, 5.0);
}

#[test]
fn two_containers_meet_on_the_board_and_hold_their_caps() {
    // Two containers (two shared files) at 30% and 70% on one GPU, with a turn board
    // directory: both keep a record there while they run (with their parts, 30 and 70) and
    // still hold their own caps; each takes its record off the board at exit. (Each
    // simulated process has its own simulated GPU, so this checks the plumbing; how they
    // share one GPU is modelled in vgpu-limiter's tests and measured on the H200.)
    let _one = serial();
    let turns = env().fresh_dir("turns");
    let spawn_one = |name: &str, pct: &str| {
        two_seconds_limited(&env().fresh_cache(name), pct)
            .env("VGPU_TURN_DIR", &turns)
            .spawn()
            .expect("spawn")
    };
    let (a, b) = (
        spawn_one("turn30.cache", "30"),
        spawn_one("turn70.cache", "70"),
    );
    std::thread::sleep(std::time::Duration::from_millis(1_000));
    let boards: Vec<_> = std::fs::read_dir(&turns)
        .unwrap()
        .map(|d| d.unwrap().path())
        .collect();
    assert_eq!(boards.len(), 1, "one board per GPU: {boards:?}");
    let board = vgpu_shm::TurnBoard::open_or_create(&boards[0]).unwrap();
    let mut parts: Vec<u32> = board
        .tenants(vgpu_shm::monotonic_ns(), 300_000_000)
        .iter()
        .map(|t| t.limit_pct)
        .collect();
    parts.sort_unstable();
    let (a, b) = (measured(a), measured(b));
    eprintln!(
        "containers at 30% and 70% on one board: {}% and {}%",
        a.busy_pct, b.busy_pct
    );
    assert_eq!(parts, [30, 70], "both containers with their parts");
    assert!((a.busy_pct - 30.0).abs() <= 7.0, "30% container: {a:?}");
    assert!((b.busy_pct - 70.0).abs() <= 7.0, "70% container: {b:?}");
    let after = board.tenants(vgpu_shm::monotonic_ns(), 300_000_000);
    assert!(after.is_empty(), "both left the board at exit: {after:?}");
}

#[test]
fn limited_launches_mark_recent_kernel_for_the_monitor() {
    let _one = serial();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // With a limit, launching marks the task active (HAMi-core's `recent_kernel = 2`) and
    // records the launch time.
    let cache = env().fresh_cache("rk-limited.cache");
    run(Some(50), "rk-limited.cache", 0.3, 1_000, 'k');
    let limited = snapshot(&cache);
    assert_eq!(limited.recent_kernel, vgpu_shm::RECENT_KERNEL_ACTIVE);
    assert!(
        limited.last_kernel_time.abs_diff(now) <= 5,
        "last_kernel_time {} vs now {now}",
        limited.last_kernel_time
    );
    // Without one the launch path writes nothing to the file.
    let cache = env().fresh_cache("rk-unlimited.cache");
    run(None, "rk-unlimited.cache", 0.3, 1_000, 'k');
    let unlimited = snapshot(&cache);
    assert_eq!(
        (unlimited.recent_kernel, unlimited.last_kernel_time),
        (0, 0)
    );
}

#[test]
fn a_peer_that_stopped_launching_no_longer_holds_back_the_other() {
    let _one = serial();
    let cache = env().fresh_cache("stale-peer.cache");
    let command = |args: &[&str]| {
        let mut cmd = env().hooked(args, &cache);
        cmd.env("CUDA_DEVICE_SM_LIMIT", "50")
            .env("VGPU_SIM_UTIL_WINDOW_MS", "1500");
        cmd
    };
    // B launches for 0.6 s (publishing its share, about 50%), then stays alive for 5 s
    // without launching.
    let mut b = command(&["0.6", "2000000", "k", "0.1", "5"])
        .spawn()
        .expect("spawn");
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let snap = snapshot(&cache);
    let published = snap.processes.iter().map(|p| p.devices[0].sm_util).max();
    assert!(
        published.is_some_and(|u| u >= 20),
        "B published no share: {:?}",
        snap.processes
    );
    // A, started after B stopped launching, gets the whole container limit: B's share is
    // older than a few publish periods by the end of A's warm-up.
    let a = parse(
        &command(&["1.5", "2000000", "k", "0.6"])
            .output()
            .expect("run A"),
    );
    let _ = b.kill();
    let _ = b.wait();
    eprintln!("A next to a stopped peer: GPU busy {}%", a.busy_pct);
    assert!(
        (a.busy_pct - 50.0).abs() <= 7.0,
        "A held back by a peer that stopped launching: busy {}% for 50%",
        a.busy_pct
    );
}

/// The program in a container of two simulated GPUs (file `cache`) whose second has a 30%
/// SM limit (`CUDA_DEVICE_SM_LIMIT_1`, the container's device 1).
fn two_gpu_container(cache: &std::path::Path, args: &[&str]) -> std::process::Command {
    let mut cmd = env().hooked(args, cache);
    cmd.env("VGPU_SIM_DEVICE_COUNT", "2")
        .env("CUDA_DEVICE_SM_LIMIT_1", "30")
        .env("VGPU_SIM_UTIL_WINDOW_MS", "1500")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("SPIN_DEVICE");
    cmd
}

#[test]
fn a_process_seeing_one_gpu_of_two_is_limited_and_reported_on_that_gpu() {
    // Issue 12, defect 2: the shared file's index is the GPU. A container of two GPUs whose
    // second has a 30% limit; a rank that sees only GPU 1 (its device 0) must be held to GPU
    // 1's limit and publish its utilization on GPU 1's index, where HAMi's monitor reads it.
    let _one = serial();
    let cache = env().fresh_cache("narrowed.cache");
    let command = |args: &[&str]| two_gpu_container(&cache, args);
    // The container's first process sees both GPUs and makes the file.
    parse(&command(&["0.1", "1000000", "k"]).output().unwrap());
    let base = baseline('k', 2_000);
    let mut rank = command(&["1.5", "2000000", "k", "0.3", "1.5"])
        .env("CUDA_VISIBLE_DEVICES", "1")
        .spawn()
        .expect("spawn");
    // Read the file while the rank lingers after its measurement.
    let mut stdout = std::io::BufReader::new(rank.stdout.take().unwrap());
    let mut result = String::new();
    while !result.starts_with("RESULT") {
        result.clear();
        let n = std::io::BufRead::read_line(&mut stdout, &mut result).unwrap();
        assert!(n > 0, "the rank ended without a result");
    }
    let snap = snapshot(&cache);
    let out = rank.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(snap.devices[1].uuid.ends_with("d001"), "{snap:?}");
    let me = snap
        .processes
        .iter()
        .find(|p| p.alive)
        .unwrap_or_else(|| panic!("the rank's slot: {snap:?}"));
    assert_eq!(
        me.devices[0].sm_util, 0,
        "nothing reported on GPU 0, which the rank does not use: {me:?}"
    );
    assert!(
        me.devices[1].sm_util > 0,
        "its utilization is on GPU 1's index: {me:?}"
    );
    let kps: f64 = result
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("kernels_per_s=")?.parse().ok())
        .expect("kernels_per_s");
    let ratio = 100.0 * kps / base.kernels_per_s;
    eprintln!("rank on GPU 1 under its 30% limit: {ratio:.1}% of unlimited throughput");
    // The busy figure is NVML index 0's (GPU 0): throughput tells the limit instead.
    let expected = expected_ratio(30.0, base);
    assert!(
        near(ratio, expected, 1.6),
        "held to GPU 1's 30%: {ratio:.1}% of unlimited, expected about {expected:.1}%"
    );
}

#[test]
fn ranks_seeing_one_gpu_under_different_ordinals_share_its_limit() {
    // Issue 12, defect 2: peers' utilization is read on the GPU's file index. Two ranks on
    // GPU 1 of the container, one seeing it as its device 0 (`CUDA_VISIBLE_DEVICES=1`), one
    // as its device 1 (both GPUs): together they are held to GPU 1's 30%.
    let _one = serial();
    let cache = env().fresh_cache("narrowed-peers.cache");
    parse(
        &two_gpu_container(&cache, &["0.1", "1000000", "k"])
            .output()
            .unwrap(),
    );
    let base = baseline('k', 2_000);
    let args = ["2", "2000000", "k", "1.0"];
    let narrowed = two_gpu_container(&cache, &args)
        .env("CUDA_VISIBLE_DEVICES", "1")
        .spawn()
        .expect("spawn");
    let full = two_gpu_container(&cache, &args)
        .env("SPIN_DEVICE", "1")
        .spawn()
        .expect("spawn");
    let (a, b) = (
        parse(&narrowed.wait_with_output().unwrap()),
        parse(&full.wait_with_output().unwrap()),
    );
    // Each simulated process has its own simulated GPU; the limit is the container's. The
    // busy figure is NVML index 0's (GPU 0): throughput tells the limit instead.
    let total = 100.0 * (a.kernels_per_s + b.kernels_per_s) / base.kernels_per_s;
    let expected = expected_ratio(30.0, base);
    eprintln!("two ranks on GPU 1 at its 30%: together {total:.1}% of unlimited throughput");
    assert!(
        near(total, expected, 1.3),
        "together held to GPU 1's 30%: {total:.1}% of unlimited, expected about {expected:.1}%"
    );
}

/// Spawns the program (0.5 ms kernels for `seconds`) as one share-mode container with its
/// own file, on the turn directory `turns`, with extra variables.
fn spawn_sharing(
    cache: &str,
    turns: &std::path::Path,
    seconds: f64,
    vars: &[(&str, &str)],
) -> std::process::Child {
    spawn_sharing_then_idle(cache, turns, seconds, 0.0, vars)
}

/// [`spawn_sharing`], the program then staying alive without launching for `linger` s.
fn spawn_sharing_then_idle(
    cache: &str,
    turns: &std::path::Path,
    seconds: f64,
    linger: f64,
    vars: &[(&str, &str)],
) -> std::process::Child {
    let cache = env().fresh_cache(cache);
    let (run, idle) = (seconds.to_string(), linger.to_string());
    let mut cmd = env().hooked(&[&run, "500000", "k", "0.3", &idle], &cache);
    cmd.env("VGPU_TURN_DIR", turns)
        .env("VGPU_SM_MODE", "share")
        .env(
            "VGPU_SIM_UTIL_WINDOW_MS",
            ((seconds * 1000.0) as u64).to_string(),
        )
        .env_remove("CUDA_TASK_PRIORITY");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn")
}

#[test]
fn share_mode_alone_borrows_up_to_its_ceiling_and_publishes_its_record() {
    // A 30% guarantee with a 60% ceiling, alone on the GPU: it borrows up to 60%, and its
    // record on the board says so (what `vgpu status` reads).
    let _one = serial();
    let turns = env().fresh_dir("share-alone");
    let child = spawn_sharing(
        "share-alone.cache",
        &turns,
        1.0,
        &[
            ("CUDA_DEVICE_SM_LIMIT", "30"),
            ("VGPU_SM_CEILING", "60"),
            ("CUDA_TASK_PRIORITY", "0"),
        ],
    );
    let m = measured(child);
    eprintln!(
        "share mode alone, 30% guarantee, 60% ceiling: busy {}%",
        m.busy_pct
    );
    assert!((m.busy_pct - 60.0).abs() <= 7.0, "{m:?}");
    let board = std::fs::read_dir(&turns)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let records = vgpu_shm::NodeReader::default()
        .share_records(&board)
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    let r = records[0];
    assert_eq!((r.share_pct, r.ceiling_pct, r.priority), (30, 60, 0));
    assert!(
        r.borrowed_ns > 100_000_000,
        "borrowed above the guarantee: {r:?}"
    );
    assert!(r.heartbeat > 0 && r.busy_until >= r.heartbeat);
}

#[test]
fn a_best_effort_container_runs_one_kernel_at_a_time_while_a_more_urgent_one_has_work() {
    // Two share-mode containers without guarantees: priority 0 (high, as in HAMi) runs 2 s
    // after its 0.3 s warm-up; priority 1 starts once the first is on the board and runs
    // 0.3 + 0.5 s. While the urgent one has work, the best-effort one keeps one kernel at a
    // time queued (its queue waits), so that each of the urgent one's kernels waits at most
    // that one; it is not held (a held container leaves the GPU idle in the urgent one's
    // host time). (Each simulated process has its own simulated GPU: this shows the rule.)
    let _one = serial();
    let turns = env().fresh_dir("share-priority");
    let t0 = std::time::Instant::now();
    let high = spawn_sharing(
        "share-high.cache",
        &turns,
        2.0,
        &[("CUDA_TASK_PRIORITY", "0")],
    );
    // A loaded machine may start the urgent one late: wait for its record.
    let on_board = || {
        let board = std::fs::read_dir(&turns).ok()?.next()?.ok()?.path();
        let records = vgpu_shm::NodeReader::default().share_records(board).ok()?;
        records.iter().any(|r| r.priority == 0).then_some(())
    };
    while on_board().is_none() && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let low = spawn_sharing(
        "share-low.cache",
        &turns,
        0.5,
        &[("CUDA_TASK_PRIORITY", "1"), ("LIBCUDA_LOG_LEVEL", "3")],
    );
    let low = std::thread::spawn(move || low.wait_with_output().unwrap());
    let h = measured(high);
    let out = low.join().unwrap();
    let l = parse(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stats = stderr
        .lines()
        .find(|l| l.contains("limiter stats"))
        .unwrap_or_else(|| panic!("no limiter stats line: {stderr}"));
    let queue_waits: u64 = stats
        .split("queue ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no queue waits in {stats}"));
    eprintln!(
        "priority 0: busy {}%; priority 1: busy {}%, {queue_waits} queue waits",
        h.busy_pct, l.busy_pct
    );
    assert!(h.busy_pct >= 80.0, "the urgent one runs: {h:?}");
    assert!(queue_waits > 0, "one kernel at a time: {stats}");
    assert!(l.busy_pct >= 30.0, "the best-effort one still runs: {l:?}");
}

/// The one turn board in `turns`.
fn the_board(turns: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(turns)
        .unwrap()
        .next()
        .expect("a board")
        .unwrap()
        .path()
}

/// Reads the program's output until a line starting with `prefix`; returns that line.
fn read_until(out: &mut impl std::io::BufRead, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the program ended before printing {prefix}"
        );
        if line.starts_with(prefix) {
            return line.trim().to_owned();
        }
    }
}

/// How the board shows the container `turns` holds, `at` (monotonic ns): its turn entry (as
/// `vgpu status` reads it: within the last second) and its share record.
fn on_the_board(
    board: &std::path::Path,
    at: u64,
) -> (Vec<vgpu_shm::Tenant>, Vec<vgpu_shm::shares::ShareRecord>) {
    let reader = vgpu_shm::NodeReader::default();
    (
        reader.turn_tenants(board, at, 1_000_000_000).unwrap(),
        reader.share_records(board).unwrap(),
    )
}

/// What a share-mode reader counts as live (`ShareRules::max_age`, the hook's turn age).
const MAX_AGE_NS: u64 = 300_000_000;

#[test]
fn an_idle_share_container_stays_on_the_board_until_killed() {
    // A share-mode container launches for 0.5 s, then stays alive without launching (an
    // inference service between requests). Two seconds into that, its turn entry and record
    // are still fresh (its heartbeat thread), not busy and marked idle (limit 0: no window
    // for cap-mode neighbours). Killed, it stops heartbeating: its claim expires within the
    // usual age, and `vgpu status` (1 s) drops it.
    let _one = serial();
    let turns = env().fresh_dir("share-idle");
    let mut child = spawn_sharing_then_idle(
        "share-idle.cache",
        &turns,
        0.5,
        30.0,
        &[("CUDA_DEVICE_SM_LIMIT", "30"), ("CUDA_TASK_PRIORITY", "0")],
    );
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    read_until(&mut out, "RESULT");
    std::thread::sleep(std::time::Duration::from_secs(2));
    let board = the_board(&turns);
    let now = vgpu_shm::monotonic_ns();
    let (tenants, records) = on_the_board(&board, now);
    eprintln!("idle for 2 s: entries {tenants:?}, records {records:?}");
    let _ = child.kill();
    let killed = vgpu_shm::monotonic_ns();
    let _ = child.wait();
    assert_eq!(tenants.len(), 1, "still listed: {tenants:?}");
    let t = tenants[0];
    assert!(
        now - t.heartbeat_ns <= MAX_AGE_NS,
        "entry fresh: {t:?} at {now}"
    );
    assert_eq!(t.limit_pct, 0, "marked idle: {t:?}");
    assert_eq!(records.len(), 1, "{records:?}");
    let r = records[0];
    assert_eq!((r.key, r.share_pct, r.priority), (t.key, 30, 0));
    assert!(
        now - r.heartbeat <= MAX_AGE_NS,
        "record fresh: {r:?} at {now}"
    );
    assert!(r.busy_until < now, "not busy: {r:?}");
    assert_eq!(r.allot_pct, 0, "no part while idle: {r:?}");
    // Killed: the heartbeat stops, the claim ages out.
    std::thread::sleep(std::time::Duration::from_millis(400));
    let later = vgpu_shm::monotonic_ns();
    let (_, records) = on_the_board(&board, later);
    assert!(
        records
            .iter()
            .all(|r| later - r.heartbeat > MAX_AGE_NS && r.heartbeat < killed),
        "no heartbeat after the kill: {records:?}"
    );
    let live = vgpu_shm::NodeReader::default()
        .turn_tenants(&board, later, MAX_AGE_NS)
        .unwrap();
    assert!(live.is_empty(), "no tenant to its neighbours: {live:?}");
    std::thread::sleep(std::time::Duration::from_millis(800));
    let (tenants, _) = on_the_board(&board, vgpu_shm::monotonic_ns());
    assert!(
        tenants.is_empty(),
        "vgpu status no longer lists it: {tenants:?}"
    );
}

#[test]
fn a_child_forked_beside_the_heartbeat_exits_and_the_parent_stays_then_leaves() {
    // The parent's heartbeat thread runs (share mode, idle) when it forks a child that exits
    // normally: the child's exit handlers do not hang on the thread, which it does not have,
    // nor take the parent off the board; the parent keeps beating, and its own normal exit
    // (heartbeat stopped first) withdraws its entry.
    let _one = serial();
    let turns = env().fresh_dir("share-fork");
    let t0 = std::time::Instant::now();
    let mut child = spawn_sharing_then_idle(
        "share-fork.cache",
        &turns,
        0.3,
        1.5,
        &[("CUDA_DEVICE_SM_LIMIT", "30"), ("FORK_IDLE", "1")],
    );
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    read_until(&mut out, "RESULT");
    let forked = read_until(&mut out, "child_exit=");
    assert_eq!(forked, "child_exit=0");
    std::thread::sleep(std::time::Duration::from_millis(800));
    let board = the_board(&turns);
    let now = vgpu_shm::monotonic_ns();
    let (tenants, records) = on_the_board(&board, now);
    assert!(
        tenants.len() == 1 && now - tenants[0].heartbeat_ns <= MAX_AGE_NS,
        "the parent still beats after its child exited: {tenants:?}"
    );
    assert!(
        records.len() == 1 && now - records[0].heartbeat <= MAX_AGE_NS,
        "{records:?}"
    );
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(20), "no hang");
    let (tenants, _) = on_the_board(&board, vgpu_shm::monotonic_ns());
    assert!(
        tenants.is_empty(),
        "withdrawn at exit, not put back by a beat: {tenants:?}"
    );
}

#[test]
fn a_limited_processs_samples_open_behind_a_gate_that_is_always_opened() {
    // A sample's start marker waits on a host word (cuStreamWaitValue32) that the limiter
    // writes once the launch and its end marker are queued. A gate left closed would hold
    // the stream until the watchdog opens it (1 ms), and that sample would not count.
    // Under lazy loading a function's first launch call waits for every stream of its
    // context (the simulated driver as the real one), so a gate ahead of a first launch
    // stays closed until the watchdog opens it: what hung PyTorch on an H200 before the
    // watchdog. Gating a first launch (the limiter's `known` condition dropped) fails here
    // with 2 (k) and 3 (p) gates opened late in every run; with it, none in 24 runs.
    let _one = serial();
    for mode in ['k', 'p'] {
        let e = env();
        let cache = e.fresh_cache(&format!("gate-{mode}.cache"));
        let mut cmd = e.hooked(&["0.5", "200000", &mode.to_string()], &cache);
        // The simulated driver's lazy loading (the real default) makes a function's first
        // launch call wait for the context's streams; a second function ("tick") has its
        // first launch while the stream holds work.
        cmd.env("CUDA_DEVICE_SM_LIMIT", "50")
            .env("VGPU_SIM_UTIL_WINDOW_MS", "500")
            .env("LIBCUDA_LOG_LEVEL", "3")
            .env("CUDA_MODULE_LOADING", "LAZY")
            .env("TICK", "1");
        let out = cmd.output().expect("run the program");
        parse(&out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let (line, [samples, gated, unknown, late]) = limiter_counts(&stderr);
        assert!(samples > 0, "{mode}: {line}");
        // All but the identities' first launches (the driver may load a kernel then: never
        // gated).
        assert!(gated + unknown >= samples, "{mode}: samples gated: {line}");
        // No gate held a first launch (which waits for the gated stream inside the call)
        // until the hook's watchdog opened it. One is allowed: a launching thread descheduled
        // for a millisecond on a loaded test machine also lets the watchdog open its gate.
        assert!(late <= 1, "{mode}: gates opened late: {line}");
        eprintln!("{mode}: {line}");
    }
}

#[test]
fn samples_stay_gated_after_the_context_that_registered_the_word_is_reset() {
    // The gate's word is reached through a registration, which goes with the context that
    // made it. A word in memory the driver allocated (cuMemHostAlloc) would be unmapped by
    // the reset, and the hook's next write to it would kill the program.
    let _one = serial();
    let e = env();
    let cache = e.fresh_cache("gate-reset.cache");
    let mut cmd = e.hooked(&["0.3", "200000", "k"], &cache);
    cmd.env("CUDA_DEVICE_SM_LIMIT", "50")
        .env("VGPU_SIM_UTIL_WINDOW_MS", "300")
        .env("LIBCUDA_LOG_LEVEL", "3")
        .env("RESET_THEN", "1");
    let out = cmd.output().expect("run the program");
    parse(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("after_reset=ok"), "{stdout}\n{stderr}");
    // Every sample of an identity launched before is gated, after the reset too.
    let (line, [samples, gated, unknown, _]) = limiter_counts(&stderr);
    assert!(gated + unknown >= samples, "samples gated: {line}");
}

/// The `limiter stats` line a limited process logs at exit, and its counts: samples, gated
/// samples, launches of unknown identity, gates opened late.
fn limiter_counts(stderr: &str) -> (&str, [u64; 4]) {
    let line = stderr
        .lines()
        .find(|l| l.contains("limiter stats"))
        .unwrap_or_else(|| panic!("no limiter stats: {stderr}"));
    let count = |after: &str| -> u64 {
        let i = line.find(after).expect("the field") + after.len();
        line[i..]
            .trim_start()
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a number after {after:?} in {line}"))
    };
    let counts = [
        count("cost), "),
        count("samples ("),
        count("launches ("),
        count("gated, "),
    ];
    (line, counts)
}
