//! The process root: everything this process keeps about enforcement, in one [`Process`].
//!
//! ```text
//! PROCESS ─┬─ enforcement: Published<Enforcement>   built on first use from the environment
//!          │     Ready ─ config, allocator + ledger (`ledger`: this process's slot), pools,
//!          │             graph memory, VMM references, primary contexts, residual, NVML handles
//!          ├─ building, left, fork_handler_registered the build's spin flag; left the table at exit
//!          └─ sm: SmLimiter                           started with the config and the slot
//!                ├─ limits, policy, board directory, slot, per-device limiters (Published)
//!                └─ heartbeat: Heartbeat              the `vgpu-heartbeat` thread
//! ```
//!
//! The enforcement state is published in a [`Published`] cell and never freed. Building it
//! takes a tiny spin flag, never a mutex, and calls no loader function, so it cannot
//! deadlock against a thread inside `dlopen`; the builder then starts the SM limiter,
//! handing it the config and this process's slot in the shared table.
//!
//! One fork handler ([`after_fork_in_child`], atomic stores only) resets, in this order:
//! the enforcement state (forgotten: its locks may be held by threads that do not exist in
//! the child; the child builds its own on its next call, which registers it in the shared
//! table as a new process), then the SM limiter and its heartbeat
//! ([`SmLimiter::reset_in_child`]).
//!
//! Exit: one handler ([`at_exit`], a `.fini_array` entry) says how many log lines the rate
//! limit suppressed that no later line reported, stops the heartbeat, takes the container's
//! entries off the turn board, then leaves the shared table.
//!
//! The real driver's tables (`real`) are loader caches, valid in a child too, and stay there.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_alloc_core::{Allocator, DeviceIndex, MAX_DEVICES};
use vgpu_cuda_abi::{CUdevice, CUresult};
use vgpu_env::{Config, ConfigErrors, Vars};
use vgpu_shm::{HostPolicy, ProcessSlot, TableInit, UsageTable};

use crate::driver::RealBackend;
use crate::ledger::SharedLedger;
use crate::log::{DEBUG, ERROR, INFO, MSG, WARN, vlog};
use crate::measured::MeasuredTracker;
use crate::published::Published;
use crate::residual::Residual;
use crate::sm_limit::SmLimiter;

/// Working enforcement.
#[derive(Debug)]
pub(crate) struct Ready {
    /// The parsed environment, with the shared file's host policy in force (its
    /// `host_backing`'s spill and oversubscription: [`adopt_host_policy`]).
    pub(crate) config: Config,
    /// Sub-allocator, allocation table and reserve-or-OOM decision.
    pub(crate) alloc: Allocator<RealBackend, SharedLedger>,
    /// Stream-ordered pools, keyed by `CUmemoryPool`.
    pub(crate) pools: MeasuredTracker<usize>,
    /// Graph memory, keyed by CUDA ordinal.
    pub(crate) graph: MeasuredTracker<i32>,
    /// Graph memory may exist (an alloc node was added or a stream-ordered allocation was
    /// made, which stream capture turns into one): graph launches measure it.
    pub(crate) graph_mem_possible: AtomicBool,
    /// A stream-ordered pool grew since the last sync point: the sync point reconciles once
    /// more, for driver memory the pool took after the allocation returned.
    pub(crate) pool_grew: AtomicBool,
    /// Extra references to charged `cuMemCreate` handles taken by
    /// `cuMemRetainAllocationHandle`: the charge goes with the last `cuMemRelease`.
    pub(crate) vmm_extra_refs: Mutex<HashMap<u64, u32>>,
    /// Primary context per CUDA ordinal, while we hold its memory charge.
    pub(crate) primary: Mutex<HashMap<i32, PrimaryCharge>>,
    /// Driver-internal memory reconciled with NVML's per-process figure, charged as module
    /// memory.
    pub(crate) residual: Residual,
    /// NVML device handle per CUDA ordinal (found by UUID once).
    pub(crate) nvml_handles: Mutex<HashMap<i32, usize>>,
    /// Allocations backed by host memory (`CUDA_OVERSUBSCRIBE`, `VGPU_HOST_SPILL`).
    pub(crate) host_backed: crate::host_backing::HostBacked,
}

impl Ready {
    /// The ledger.
    pub(crate) fn ledger(&self) -> &SharedLedger {
        self.alloc.ledger()
    }

    /// This process's slot in the shared table.
    pub(crate) fn slot(&self) -> &ProcessSlot {
        self.ledger().slot()
    }
}

/// A primary context whose memory is charged: its handle and what its creation measured
/// (charged again when a reset keeps it alive, see `hooks::primary_reset`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrimaryCharge {
    pub(crate) ctx: usize,
    pub(crate) bytes: u64,
}

/// What the hook does with allocations.
#[derive(Debug)]
pub(crate) enum Enforcement {
    /// Limits are enforced.
    Ready(Box<Ready>),
    /// The configuration or the shared table is unusable: allocations fail (never run
    /// unenforced). The reason is logged once at build time and on every refusal.
    Broken(String),
}

/// Everything the process keeps (see the module's picture).
pub(crate) struct Process {
    /// The enforcement state, built on first use.
    enforcement: Published<Enforcement>,
    /// Taken by the one thread building [`Process::enforcement`].
    building: AtomicBool,
    /// Set once this process has left the shared table at exit (see [`at_exit`]).
    left: AtomicBool,
    /// [`after_fork_in_child`] is registered.
    fork_handler_registered: AtomicBool,
    /// The SM limiter.
    sm: SmLimiter,
}

static PROCESS: Process = Process {
    enforcement: Published::new(),
    building: AtomicBool::new(false),
    left: AtomicBool::new(false),
    fork_handler_registered: AtomicBool::new(false),
    sm: SmLimiter::new(),
};

/// The SM limiter (for `sm_limit`'s entry points).
#[inline(always)]
pub(crate) fn sm_limiter() -> &'static SmLimiter {
    &PROCESS.sm
}

/// The state, built on first use.
#[inline]
pub(crate) fn get() -> &'static Enforcement {
    match PROCESS.enforcement.get() {
        Some(state) => state,
        None => build(),
    }
}

/// The working state, or the error code for allocating calls when enforcement is broken.
#[inline]
pub(crate) fn ready() -> Result<&'static Ready, CUresult> {
    match get() {
        Enforcement::Ready(r) => Ok(r),
        Enforcement::Broken(why) => {
            vlog!(
                ERROR,
                "refusing allocation: enforcement unavailable ({why})"
            );
            Err(CUresult::OUT_OF_MEMORY)
        }
    }
}

#[cold]
fn build() -> &'static Enforcement {
    // Everything that may enter the loader or the driver happens before the flag is taken.
    // A bad log level or priority is a warning, not a reason to refuse every allocation.
    let mut config = Config::from_vars_with_warnings(&Vars::from_os(std::env::vars_os()));
    let uuids = container_uuids();
    if let Ok(c) = &mut config {
        // Limits named by GPU UUID go on the container's devices these GPUs are (the file's
        // device indices, NVML's order, as the `_<i>` limits are).
        for w in c.apply_device_uuids(&uuids) {
            vlog!(WARN, "{w}");
        }
    }
    let open_shared_table = move |c: &Config| open_table(c, uuids);
    let p = &PROCESS;
    let mut waits = 0u32;
    loop {
        if p.building
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            break;
        }
        // Once the builder is done, so that the SM limiter is started too.
        if !p.building.load(Ordering::Acquire)
            && let Some(state) = p.enforcement.get()
        {
            return state;
        }
        // The builder may wait on the shared file's initialization lock (seconds at worst):
        // yield at first, then sleep, rather than burn a core.
        waits += 1;
        if waits < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(500));
        }
    }
    if let Some(state) = p.enforcement.get() {
        p.building.store(false, Ordering::Release);
        return state;
    }
    // The only builder: the publication cannot lose.
    let state = p.enforcement.publish(make(config, open_shared_table));
    // The published state is never freed, so its slot lives as long as the limiter. (A
    // launch racing this first build may pass unthrottled, as one before it would.)
    if let Enforcement::Ready(ready) = state {
        p.sm.start(&ready.config, Some(ready.ledger()));
        crate::swap::start(ready);
    }
    p.building.store(false, Ordering::Release);
    // A flag, not a `Once`: a fork while another thread registers must not leave the child
    // a `Once` that never completes. A child inherits the registration and keeps the flag.
    if !p.fork_handler_registered.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a handler that only makes atomic stores.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    }
    state
}

/// UUIDs of the container's GPUs in NVML's order: a new file's `uuids[]`, whose index i the
/// environment's `_<i>` limits name (docs/compatibility.md).
///
/// NVML lists every GPU of the container whatever this process's `CUDA_VISIBLE_DEVICES`
/// says, so a first process that narrows it (a Ray worker or MPI rank given one GPU) still
/// records them all, each under its own limit, and the other ranks find theirs. Without
/// NVML, the devices CUDA shows this process stand in, if it has initialized CUDA: the hook
/// never does (issue 12: the driver refuses CUDA in a child forked after initialization),
/// and `cuDeviceGetCount` answers only once the program has. Empty when neither answers.
fn container_uuids() -> Vec<String> {
    let mut uuids = crate::driver::nvml_uuids();
    if uuids.is_empty()
        && let Ok(cuda) = crate::real::cuda()
        && let Ok(n) = crate::driver::device_count(cuda)
    {
        uuids = (0..n.clamp(0, MAX_DEVICES as i32))
            .map(|i| crate::driver::device_uuid(cuda, CUdevice(i)).unwrap_or_default())
            .collect();
    }
    uuids.truncate(MAX_DEVICES);
    uuids
}

/// Opens (or creates) the shared table and registers this process in it.
fn open_table(config: &Config, uuids: Vec<String>) -> Result<SharedLedger, String> {
    if !uuids.is_empty() {
        for w in config.absent_device_warnings(uuids.len()) {
            vlog!(WARN, "{w}");
        }
    }
    let init = TableInit {
        uuids,
        memory_limits: config.memory_limit.to_vec(),
        sm_limits: config.sm_limit.iter().map(|l| l.map(u64::from)).collect(),
        priority: config.task_priority,
    };
    let path = &config.shared_cache;
    // The container's host policy is its file's, set by the process that makes it (so that
    // every process's reservations and `vgpu status` see one), never by a process joining.
    let table = UsageTable::open_or_create_with_host_policy(path, &init, asked_host_policy(config))
        .map_err(|e| format!("shared table: {e}"))?;
    let slot = table
        .register_self()
        .map_err(|e| format!("shared table: {e}"))?;
    vlog!(
        INFO,
        "registered in shared table {path} (slot {})",
        slot.index()
    );
    say_limits_in_force(config, &table);
    Ok(SharedLedger::new(slot))
}

/// Logs the memory limits in force (the file's: an existing file keeps its own): at the
/// info level always, and once at the default level when they differ from the
/// environment's, so that a leftover file never changes a limit without a word.
fn say_limits_in_force(config: &Config, table: &UsageTable) {
    let show = |l: Option<u64>| l.map_or_else(|| "unlimited".to_owned(), |b| format!("{b}"));
    let devices = (0..table.device_num()).map(DeviceIndex);
    let in_force: Vec<String> = devices
        .clone()
        .map(|d| format!("{d}={}", show(table.memory_limit(d))))
        .collect();
    vlog!(
        INFO,
        "memory limits in force (bytes, by device of the shared file): {}",
        in_force.join(" ")
    );
    let differ: Vec<String> = devices
        .filter_map(|d| {
            let env = config.memory_limit.get(d.as_usize()).copied().flatten();
            let file = table.memory_limit(d);
            (env != file).then(|| {
                format!(
                    "device {d}: {} (the environment says {})",
                    show(file),
                    show(env)
                )
            })
        })
        .collect();
    if !differ.is_empty() {
        vlog!(
            MSG,
            "memory limits in force differ from the environment's: {}; the shared file {} was \
             made with these and keeps them (vgpu set-limit changes them; a new file takes the \
             environment's)",
            differ.join(", "),
            table.path().display()
        );
    }
}

/// The host policy the environment asks for (`VGPU_HOST_SPILL`, `CUDA_OVERSUBSCRIBE`).
fn asked_host_policy(config: &Config) -> HostPolicy {
    HostPolicy {
        spill: config.host_backing.spill,
        oversubscribe: config.host_backing.oversubscribe,
    }
}

/// Makes the shared file's host policy this process's: the file's wins, as its limits do (a
/// new file has its creator's). Device 0's stands for the file's: every writer sets all
/// devices alike. Logged at the info level, and once at the default level when the
/// environment asks for another, so that a process never runs under another policy than it
/// asked for without a word, nor changes the container's.
fn adopt_host_policy(config: &mut Config, table: &UsageTable) {
    let show = |p: HostPolicy| {
        format!(
            "spill {} bytes, oversubscribe {}",
            p.spill,
            if p.oversubscribe { "on" } else { "off" }
        )
    };
    let (asked, file) = (asked_host_policy(config), table.host_policy(DeviceIndex(0)));
    vlog!(INFO, "host memory policy in force: {}", show(file));
    if asked != file {
        vlog!(
            MSG,
            "host memory policy in force differs from the environment's: {} (the environment \
             says {}); the shared file {} was made with it and keeps it for all its processes \
             (a new file takes the environment's)",
            show(file),
            show(asked),
            table.path().display()
        );
    }
    config.host_backing.spill = file.spill;
    config.host_backing.oversubscribe = file.oversubscribe;
}

/// Builds the state from a parsed configuration and a ledger opener (separate from the
/// globals for tests).
pub(crate) fn make(
    config: Result<Config, ConfigErrors>,
    open_ledger: impl FnOnce(&Config) -> Result<SharedLedger, String>,
) -> Enforcement {
    let config = match config {
        Ok(c) => {
            // Variables that do not affect enforcement: their defaults are in use.
            for w in &c.warnings {
                vlog!(WARN, "{w}; using the default");
            }
            for n in &c.notices {
                vlog!(MSG, "{n}");
            }
            c
        }
        Err(e) => {
            let why = format!("bad configuration: {e}");
            vlog!(ERROR, "{why}; every allocation will fail until it is fixed");
            return Enforcement::Broken(why);
        }
    };
    let ledger = match open_ledger(&config) {
        Ok(l) => l,
        Err(why) => {
            vlog!(
                ERROR,
                "{why}; every allocation will fail until it is fixed (the limit is never ignored)"
            );
            return Enforcement::Broken(why);
        }
    };
    let mut config = config;
    adopt_host_policy(&mut config, ledger.slot().table());
    let alloc = match Allocator::new(config.allocator, RealBackend, ledger) {
        Ok(a) => a,
        Err(e) => {
            let why = format!("bad configuration: {e}");
            vlog!(ERROR, "{why}; every allocation will fail until it is fixed");
            return Enforcement::Broken(why);
        }
    };
    let residual = Residual::new(config.reconcile_ms);
    Enforcement::Ready(Box::new(Ready {
        config,
        alloc,
        pools: MeasuredTracker::default(),
        graph: MeasuredTracker::default(),
        graph_mem_possible: AtomicBool::new(false),
        pool_grew: AtomicBool::new(false),
        vmm_extra_refs: Mutex::new(HashMap::new()),
        primary: Mutex::new(HashMap::new()),
        residual,
        nvml_handles: Mutex::new(HashMap::new()),
        host_backed: Default::default(),
    }))
}

/// The process's one fork handler (child side): see the module's order.
extern "C" fn after_fork_in_child() {
    let p = &PROCESS;
    // The parent's state is leaked, not dropped: its mutexes may be held by threads that
    // were not copied into the child.
    p.enforcement.forget();
    p.building.store(false, Ordering::Release);
    p.left.store(false, Ordering::Relaxed);
    p.sm.reset_in_child();
    crate::swap::watcher::reset_in_child();
}

/// Whether this process has already left the shared table because it is exiting: its usage
/// was given back, and allocations made by threads still running are refused.
pub(crate) fn has_left() -> bool {
    PROCESS.left.load(Ordering::Relaxed)
}

/// The process's exit handler, run by the dynamic loader when the process exits normally
/// (return from `main`, `exit()` from any thread, the last thread calling `pthread_exit`)
/// and when `libvgpu.so` is unloaded. In order: the SM limiter's heartbeat stops and the
/// container leaves the turn board, then this process leaves the shared table.
///
/// A `.fini_array` entry, not an `atexit` handler: the loader runs `.fini_array` entries after
/// every `atexit` handler and, object by object, after the destructors of everything loaded
/// after us (the CUDA runtime's and frameworks' teardown, which may still free memory
/// through us), so the usage is given back as late as possible and nothing needs
/// registering. It does nothing unless the state was built (no constructor-like work), and
/// in a forked child it sees only the child's own state (the fork handler forgets the
/// parent's; a parent's `ProcessSlot` also refuses to act in a child).
// SAFETY: the entry is a plain `extern "C" fn()` with no arguments, which is what the loader
// calls `.fini_array` entries as; the function catches every panic.
#[used]
#[unsafe(link_section = ".fini_array")]
static AT_EXIT: extern "C" fn() = at_exit;

extern "C" fn at_exit() {
    let p = &PROCESS;
    let _ = std::panic::catch_unwind(crate::log::say_suppressed_at_exit);
    let _ = std::panic::catch_unwind(|| p.sm.stop_at_exit());
    let _ = std::panic::catch_unwind(crate::swap::watcher::stop);
    let _ = std::panic::catch_unwind(|| {
        let Some(Enforcement::Ready(ready)) = p.enforcement.get() else {
            return;
        };
        let slot = ready.slot();
        // From here on, allocations by threads still running are refused (never unenforced):
        // the process is going away and its usage is no longer counted.
        p.left.store(true, Ordering::Relaxed);
        match slot.leave() {
            Ok(()) => vlog!(
                DEBUG,
                "exiting: left the shared table (slot {})",
                slot.index()
            ),
            Err(e) => {
                p.left.store(false, Ordering::Relaxed);
                vlog!(
                    WARN,
                    "exiting: could not leave the shared table ({e}); its usage returns when the process is gone"
                );
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_alloc_core::{UsageClass, UsageLedger};

    fn ready(e: &Enforcement) -> &Ready {
        match e {
            Enforcement::Ready(r) => r,
            Enforcement::Broken(why) => panic!("broken: {why}"),
        }
    }

    #[test]
    fn malformed_limit_breaks_enforcement_instead_of_unlimiting() {
        let cfg = Config::from_pairs([("CUDA_DEVICE_MEMORY_LIMIT", "4 gigs")]);
        let e = make(cfg, |_| panic!("must not open the table with a bad config"));
        match e {
            Enforcement::Broken(why) => assert!(why.contains("CUDA_DEVICE_MEMORY_LIMIT"), "{why}"),
            Enforcement::Ready(_) => panic!("a malformed limit must not run unenforced"),
        }
    }

    /// A path for a fresh shared file `vgpu-hook-{tag}-{pid}` in the temporary directory.
    fn fresh_path(tag: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("vgpu-hook-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        path
    }

    /// `n` GPUs' UUIDs for a shared file.
    fn gpus(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("GPU-test{i}")).collect()
    }

    #[test]
    fn a_bad_log_level_keeps_enforcement_running() {
        let path = fresh_path("loglevel");
        let cfg = Config::from_vars_with_warnings(&Vars::from_pairs([
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("LIBCUDA_LOG_LEVEL", "loud"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", path.to_str().unwrap()),
        ]));
        assert_eq!(cfg.as_ref().map(|c| c.warnings.len()), Ok(1));
        let e = make(cfg, |c| open_table(c, gpus(1)));
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            ready(&e).ledger().usage(DeviceIndex(0)).limit,
            Some(1 << 30),
            "the GPU stays usable and limited"
        );
    }

    #[test]
    fn unusable_table_breaks_enforcement() {
        let cfg = Config::from_pairs([("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
        let e = make(cfg, |_| Err("shared table /x: corrupt".into()));
        assert!(matches!(e, Enforcement::Broken(ref w) if w.contains("corrupt")));
    }

    #[test]
    fn limits_reach_the_ledger() {
        let path = fresh_path("limits");
        let cfg = Config::from_pairs([
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "512m"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", path.to_str().unwrap()),
        ]);
        let e = make(cfg, |c| open_table(c, gpus(2)));
        let _ = std::fs::remove_file(&path);
        let r = ready(&e);
        assert_eq!(r.ledger().usage(DeviceIndex(0)).limit, Some(1 << 30));
        assert_eq!(r.ledger().usage(DeviceIndex(1)).limit, Some(512 << 20));
        assert!(
            r.ledger()
                .try_reserve(DeviceIndex(1), UsageClass::Data, (512 << 20) + 1)
                .is_err()
        );
    }

    /// Two processes' state on one fresh shared file `vgpu-hook-{tag}-{pid}` under `limit`, and
    /// the file's path.
    fn two_on_one_file(limit: &str, tag: &str) -> (Enforcement, Enforcement, std::path::PathBuf) {
        let path = fresh_path(tag);
        let pairs = [
            ("CUDA_DEVICE_MEMORY_LIMIT", limit),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", path.to_str().unwrap()),
        ];
        let one = || make(Config::from_pairs(pairs), |c| open_table(c, gpus(1)));
        (one(), one(), path)
    }

    #[test]
    fn the_process_own_holdings_and_nvml_pid_come_from_its_slot() {
        let (a, other, path) = two_on_one_file("1g", "held");
        let (a, other) = (ready(&a), ready(&other));
        let d = DeviceIndex(0);
        a.ledger().try_reserve(d, UsageClass::Context, 5).unwrap();
        a.ledger().try_reserve(d, UsageClass::Module, 6).unwrap();
        a.ledger().try_reserve(d, UsageClass::Data, 7).unwrap();
        other
            .ledger()
            .try_reserve(d, UsageClass::Data, 100)
            .unwrap();
        assert_eq!(
            a.ledger().held_by_self(d),
            18,
            "its own classes, not the container's"
        );
        assert_eq!(
            a.ledger().nvml_pid(),
            std::process::id(),
            "no host pid written"
        );
        a.slot().set_hostpid(4242);
        assert_eq!(a.ledger().nvml_pid(), 4242, "the monitor's host pid");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn shared_table_ledger_enforces_across_handles() {
        let (a, b, dir) = two_on_one_file("64m", "state");
        let (a, b) = (ready(&a), ready(&b));
        let d = DeviceIndex(0);
        a.ledger()
            .try_reserve(d, UsageClass::Data, 40 << 20)
            .unwrap();
        // The second registration sees the first one's usage and cannot exceed the limit.
        assert_eq!(b.ledger().usage(d).used, 40 << 20);
        assert!(
            b.ledger()
                .try_reserve(d, UsageClass::Data, 30 << 20)
                .is_err()
        );
        b.ledger()
            .try_reserve(d, UsageClass::Data, 24 << 20)
            .unwrap();
        a.ledger().release(d, UsageClass::Data, 40 << 20);
        b.ledger().release(d, UsageClass::Data, 24 << 20);
        assert_eq!(a.ledger().usage(d).used, 0);
        let _ = std::fs::remove_file(&dir);
    }
}
