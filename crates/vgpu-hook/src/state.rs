//! The process root: everything this process keeps about enforcement, in one [`Process`].
//!
//! ```text
//! PROCESS ─┬─ enforcement: Published<Enforcement>   built on first use from the environment
//!          │     Ready ─ config, allocator + ledger (this process's ProcessSlot), pools,
//!          │             graph memory, VMM references, primary contexts, residual, NVML handles
//!          ├─ building, left, fork_handler_registered the build's spin flag; left the table at exit
//!          └─ sm: SmLimiter                           started with the config and the slot
//!                ├─ limits, policy, tuning, slot, per-device limiters (Published)
//!                ├─ power baselines
//!                └─ power: PowerReader                the `vgpu-power` thread's readings
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
//! table as a new process), then the SM limiter and its power reader
//! ([`SmLimiter::reset_in_child`]).
//!
//! Exit: one handler ([`at_exit`], a `.fini_array` entry) stops the power reader, then
//! leaves the shared table. The power reader must also stop before NVML's own `atexit`
//! handlers, which only an `atexit` registration made after NVML's initialization runs
//! before: [`stop_before_nvml_exits`] registers that one, calling the same stop.
//!
//! The real driver's tables (`real`) are loader caches, valid in a child too, and stay there.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use vgpu_alloc_core::{
    Allocator, DeviceIndex, DeviceUsage, InMemoryLedger, MAX_DEVICES, OutOfMemory, UsageClass,
    UsageLedger,
};
use vgpu_cuda_abi::{CUdevice, CUresult};
use vgpu_env::{Config, ConfigErrors, Vars};
use vgpu_shm::{ProcessSlot, TableInit, UsageTable};

use crate::driver::RealBackend;
use crate::log::{DEBUG, ERROR, INFO, WARN, vlog};
use crate::measured::MeasuredTracker;
use crate::published::Published;
use crate::residual::Residual;
use crate::sm_limit::SmLimiter;

/// The usage ledger behind the allocator: the seam between process-local accounting and
/// the cross-process shared table.
#[derive(Debug)]
pub(crate) enum HookLedger {
    /// Process-local (tests).
    #[allow(dead_code)]
    Local(Box<InMemoryLedger>),
    /// This process's slot in the container's shared table (`CUDA_DEVICE_MEMORY_SHARED_CACHE`).
    Shared(ProcessSlot),
}

impl UsageLedger for HookLedger {
    fn try_reserve(
        &self,
        device: DeviceIndex,
        class: UsageClass,
        bytes: u64,
    ) -> Result<(), OutOfMemory> {
        match self {
            Self::Local(l) => l.try_reserve(device, class, bytes),
            Self::Shared(t) => t.try_reserve(device, class, bytes),
        }
    }

    fn release(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        match self {
            Self::Local(l) => l.release(device, class, bytes),
            Self::Shared(t) => t.release(device, class, bytes),
        }
    }

    fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        match self {
            Self::Local(l) => l.usage(device),
            Self::Shared(t) => t.table().usage(device),
        }
    }

    fn charge_over_limit(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        match self {
            Self::Local(l) => l.charge_over_limit(device, class, bytes),
            Self::Shared(t) => t.charge_over_limit(device, class, bytes),
        }
    }
}

impl HookLedger {
    /// Bytes this process holds on `device`, every class (a process-local ledger holds only
    /// this process's).
    pub(crate) fn held_by_self(&self, device: DeviceIndex) -> u64 {
        match self {
            Self::Local(l) => l.usage(device).used,
            Self::Shared(t) => {
                let h = t.held(device);
                h.context.saturating_add(h.module).saturating_add(h.data)
            }
        }
    }

    /// The pid NVML lists this process under: the host pid the monitor wrote into the shared
    /// file, else `getpid()`.
    pub(crate) fn nvml_pid(&self) -> u32 {
        let hostpid = match self {
            Self::Shared(t) => t.hostpid(),
            Self::Local(_) => None,
        };
        hostpid.map_or_else(std::process::id, |h| h as u32)
    }

    /// Usage for a view (`cuMemGetInfo`, NVML): first gives dead processes' usage back, so
    /// a process that just exited is not shown as still holding memory. Costs one lock probe
    /// per live process; not for allocation paths (refused reservations sweep by themselves).
    pub(crate) fn usage_for_view(&self, device: DeviceIndex) -> DeviceUsage {
        if let Self::Shared(t) = self {
            // At most one sweep per millisecond: a program polling cuMemGetInfo in a loop must not
            // pay one lock probe per process of the container on every call.
            static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
            static LAST_SWEEP_NS: std::sync::atomic::AtomicU64 =
                std::sync::atomic::AtomicU64::new(0);
            let now = EPOCH
                .get_or_init(std::time::Instant::now)
                .elapsed()
                .as_nanos() as u64
                + 1;
            let last = LAST_SWEEP_NS.load(Ordering::Relaxed);
            let due = (last == 0 || now.saturating_sub(last) >= 1_000_000)
                && LAST_SWEEP_NS
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok();
            if due {
                let _ = t.table().sweep_dead();
            }
        }
        self.usage(device)
    }
}

/// Working enforcement.
#[derive(Debug)]
pub(crate) struct Ready {
    /// The parsed environment.
    pub(crate) config: Config,
    /// Sub-allocator, allocation table and reserve-or-OOM decision.
    pub(crate) alloc: Allocator<RealBackend, HookLedger>,
    /// Stream-ordered pools, keyed by `CUmemoryPool`.
    pub(crate) pools: MeasuredTracker<usize>,
    /// Graph memory, keyed by CUDA ordinal.
    pub(crate) graph: MeasuredTracker<i32>,
    /// Graph memory may exist (an alloc node was added or a stream-ordered allocation was
    /// made, which stream capture turns into one): graph launches measure it.
    pub(crate) graph_mem_possible: AtomicBool,
    /// Extra references to charged `cuMemCreate` handles taken by
    /// `cuMemRetainAllocationHandle`: the charge goes with the last `cuMemRelease`.
    pub(crate) vmm_extra_refs: Mutex<HashMap<u64, u32>>,
    /// Primary context handle per CUDA ordinal, while we hold its memory charge.
    pub(crate) primary: Mutex<HashMap<i32, usize>>,
    /// NVML UUID → CUDA ordinal, built on the first NVML view.
    pub(crate) ordinals_by_uuid: Mutex<Option<HashMap<String, i32>>>,
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
    pub(crate) fn ledger(&self) -> &HookLedger {
        self.alloc.ledger()
    }

    /// This process's slot in the shared table (for the SM limiter: `sm_util`, the
    /// monitor's `recent_kernel`/`utilization_switch`, live `sm_limit[]`), if the ledger is
    /// the shared table.
    pub(crate) fn slot(&self) -> Option<&ProcessSlot> {
        match self.ledger() {
            HookLedger::Shared(slot) => Some(slot),
            HookLedger::Local(_) => None,
        }
    }
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
    let config = Config::from_vars_with_warnings(&Vars::from_os(std::env::vars_os()));
    let uuids = visible_uuids();
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
        p.sm.start(&ready.config, ready.slot());
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

/// UUIDs of the devices this process sees, in CUDA ordinal order (what the shared table's
/// `uuids[]` are indexed by). Empty when the driver is unavailable.
fn visible_uuids() -> Vec<String> {
    let Ok(cuda) = crate::real::cuda() else {
        return Vec::new();
    };
    let _ = crate::driver::init(cuda);
    let n = crate::driver::device_count(cuda)
        .unwrap_or(0)
        .clamp(0, MAX_DEVICES as i32);
    (0..n)
        .map(|i| crate::driver::device_uuid(cuda, CUdevice(i)).unwrap_or_default())
        .collect()
}

/// Opens (or creates) the shared table and registers this process in it.
fn open_table(config: &Config, uuids: Vec<String>) -> Result<HookLedger, String> {
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
    let table =
        UsageTable::open_or_create(path, &init).map_err(|e| format!("shared table: {e}"))?;
    if config.host_backing.enabled() {
        // The container's policy, in the file so that every process's reservations (and
        // `vgpu status`) see it; all processes of a container share the environment.
        let policy = vgpu_shm::HostPolicy {
            spill: config.host_backing.spill,
            oversubscribe: config.host_backing.oversubscribe,
        };
        for d in 0..vgpu_alloc_core::MAX_DEVICES {
            let _ = table.set_host_policy(vgpu_alloc_core::DeviceIndex(d as u32), policy);
        }
    }
    let slot = table
        .register_self()
        .map_err(|e| format!("shared table: {e}"))?;
    vlog!(
        INFO,
        "registered in shared table {path} (slot {})",
        slot.index()
    );
    Ok(HookLedger::Shared(slot))
}

/// Builds the state from a parsed configuration and a ledger opener (separate from the
/// globals for tests).
pub(crate) fn make(
    config: Result<Config, ConfigErrors>,
    open_ledger: impl FnOnce(&Config) -> Result<HookLedger, String>,
) -> Enforcement {
    let config = match config {
        Ok(c) => {
            // Variables that do not affect enforcement: their defaults are in use.
            for w in &c.warnings {
                vlog!(WARN, "{w}; using the default");
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
    let alloc = match Allocator::new(config.allocator, RealBackend, ledger) {
        Ok(a) => a,
        Err(e) => {
            let why = format!("bad configuration: {e}");
            vlog!(ERROR, "{why}; every allocation will fail until it is fixed");
            return Enforcement::Broken(why);
        }
    };
    if crate::log::enabled(INFO) {
        let limits: Vec<String> = config
            .memory_limit
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.map(|l| format!("{i}={l}")))
            .collect();
        vlog!(
            INFO,
            "memory limits (bytes, by device; the shared table's own limits win): {}",
            limits.join(" ")
        );
    }
    let residual = Residual::new(config.reconcile_ms);
    Enforcement::Ready(Box::new(Ready {
        config,
        alloc,
        pools: MeasuredTracker::default(),
        graph: MeasuredTracker::default(),
        graph_mem_possible: AtomicBool::new(false),
        vmm_extra_refs: Mutex::new(HashMap::new()),
        primary: Mutex::new(HashMap::new()),
        ordinals_by_uuid: Mutex::new(None),
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
}

/// Whether this process has already left the shared table because it is exiting: its usage
/// was given back, and allocations made by threads still running are refused.
pub(crate) fn has_left() -> bool {
    PROCESS.left.load(Ordering::Relaxed)
}

/// Makes the power reader stop before NVML's own exit handlers run: registers
/// [`stop_at_nvml_exit`] with `atexit`. Called by the power reader right after it
/// initialized NVML: `exit()` runs `atexit` handlers in reverse order of registration, so
/// this one runs before any NVML registered while initializing.
pub(crate) fn stop_before_nvml_exits() {
    // SAFETY: atexit(3) with a function that stays valid (this library is never unloaded
    // while the process runs: it is preloaded) and that catches every panic.
    if unsafe { libc::atexit(stop_at_nvml_exit) } != 0 {
        vlog!(DEBUG, "atexit refused the power reader's stop handler");
    }
}

extern "C" fn stop_at_nvml_exit() {
    let _ = std::panic::catch_unwind(|| PROCESS.sm.stop_at_exit());
}

/// The process's exit handler, run by the dynamic loader when the process exits normally
/// (return from `main`, `exit()` from any thread, the last thread calling `pthread_exit`)
/// and when `libvgpu.so` is unloaded. In order: the SM limiter's power reader stops (no
/// more NVML calls: NVML may be torn down next), then this process leaves the shared table.
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
    let _ = std::panic::catch_unwind(|| p.sm.stop_at_exit());
    let _ = std::panic::catch_unwind(|| {
        let Some(Enforcement::Ready(ready)) = p.enforcement.get() else {
            return;
        };
        let Some(slot) = ready.slot() else {
            return;
        };
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

    #[test]
    fn a_bad_log_level_keeps_enforcement_running() {
        let cfg = Config::from_vars_with_warnings(&Vars::from_pairs([
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("LIBCUDA_LOG_LEVEL", "loud"),
        ]));
        assert_eq!(cfg.as_ref().map(|c| c.warnings.len()), Ok(1));
        let e = make(cfg, |c| {
            Ok(HookLedger::Local(Box::new(InMemoryLedger::new(
                c.memory_limit,
            ))))
        });
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
        let cfg = Config::from_pairs([
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "512m"),
        ]);
        let e = make(cfg, |c| {
            Ok(HookLedger::Local(Box::new(InMemoryLedger::new(
                c.memory_limit,
            ))))
        });
        let r = ready(&e);
        assert_eq!(r.ledger().usage(DeviceIndex(0)).limit, Some(1 << 30));
        assert_eq!(r.ledger().usage(DeviceIndex(1)).limit, Some(512 << 20));
        assert!(
            r.ledger()
                .try_reserve(DeviceIndex(1), UsageClass::Data, (512 << 20) + 1)
                .is_err()
        );
    }

    #[test]
    fn the_process_own_holdings_and_nvml_pid_come_from_its_slot() {
        let path = std::env::temp_dir().join(format!("vgpu-hook-held-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let pairs = [
            ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", path.to_str().unwrap()),
        ];
        let a = make(Config::from_pairs(pairs), |c| {
            open_table(c, vec!["GPU-test".into()])
        });
        let other = make(Config::from_pairs(pairs), |c| {
            open_table(c, vec!["GPU-test".into()])
        });
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
        if let HookLedger::Shared(slot) = a.ledger() {
            slot.set_hostpid(4242);
        }
        assert_eq!(a.ledger().nvml_pid(), 4242, "the monitor's host pid");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn shared_table_ledger_enforces_across_handles() {
        let dir = std::env::temp_dir().join(format!("vgpu-hook-state-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let path = dir.to_str().unwrap().to_owned();
        let pairs = [
            ("CUDA_DEVICE_MEMORY_LIMIT", "64m"),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", path.as_str()),
        ];
        let a = make(Config::from_pairs(pairs), |c| {
            open_table(c, vec!["GPU-test".into()])
        });
        let b = make(Config::from_pairs(pairs), |c| {
            open_table(c, vec!["GPU-test".into()])
        });
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
