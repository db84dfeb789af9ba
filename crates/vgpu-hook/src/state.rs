//! The process's enforcement state, built on first use from the environment.
//!
//! Published through an atomic pointer and never freed. Building it takes a tiny spin
//! flag, never a mutex, and calls no loader function, so it cannot deadlock against a
//! thread inside `dlopen`. After `fork` the child handler forgets the parent's state
//! (its locks may be held by threads that do not exist in the child); the child builds
//! its own on its next call, which registers it in the shared table as a new process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use vgpu_alloc_core::{
    Allocator, Config, DeviceIndex, DeviceUsage, InMemoryLedger, OutOfMemory, UsageClass,
    UsageLedger,
};
use vgpu_cuda_abi::CUresult;

use crate::driver::RealBackend;
use crate::log::{ERROR, INFO, vlog};
use crate::measured::MeasuredTracker;

/// The usage ledger behind the allocator: the seam between process-local accounting and
/// the cross-process shared table.
#[derive(Debug)]
pub(crate) enum HookLedger {
    /// Process-local (used until the shared table is wired in, and in tests).
    Local(InMemoryLedger),
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
        }
    }

    fn release(&self, device: DeviceIndex, class: UsageClass, bytes: u64) {
        match self {
            Self::Local(l) => l.release(device, class, bytes),
        }
    }

    fn usage(&self, device: DeviceIndex) -> DeviceUsage {
        match self {
            Self::Local(l) => l.usage(device),
        }
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
    /// Primary context handle per CUDA ordinal, while we hold its memory charge.
    pub(crate) primary: Mutex<HashMap<i32, usize>>,
    /// NVML UUID → CUDA ordinal, built on the first NVML view.
    pub(crate) ordinals_by_uuid: Mutex<Option<HashMap<String, i32>>>,
}

impl Ready {
    /// The ledger.
    pub(crate) fn ledger(&self) -> &HookLedger {
        self.alloc.ledger()
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

static STATE: AtomicPtr<Enforcement> = AtomicPtr::new(std::ptr::null_mut());
static BUILDING: AtomicBool = AtomicBool::new(false);
static ATFORK: std::sync::Once = std::sync::Once::new();

/// The state, built on first use.
#[inline]
pub(crate) fn get() -> &'static Enforcement {
    let p = STATE.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: published pointers come from Box::into_raw and are never freed.
        return unsafe { &*p };
    }
    build()
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
    loop {
        if BUILDING
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            break;
        }
        let p = STATE.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: as in get().
            return unsafe { &*p };
        }
        std::thread::yield_now();
    }
    let p = STATE.load(Ordering::Acquire);
    if !p.is_null() {
        BUILDING.store(false, Ordering::Release);
        // SAFETY: as in get().
        return unsafe { &*p };
    }
    let env = |name: &str| std::env::var(name).ok();
    let state = make(Config::from_lookup(env));
    let fresh = Box::into_raw(Box::new(state));
    STATE.store(fresh, Ordering::Release);
    BUILDING.store(false, Ordering::Release);
    ATFORK.call_once(|| {
        // SAFETY: registers a handler that only stores to two atomics.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
    // SAFETY: just published; never freed.
    unsafe { &*fresh }
}

/// Builds the state from a parsed configuration (separate from the globals for tests).
pub(crate) fn make(config: Result<Config, vgpu_alloc_core::ConfigErrors>) -> Enforcement {
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            let why = format!("bad configuration: {e}");
            vlog!(ERROR, "{why}; every allocation will fail until it is fixed");
            return Enforcement::Broken(why);
        }
    };
    let ledger = HookLedger::Local(InMemoryLedger::new(config.memory_limit));
    let alloc = match Allocator::new(config.allocator, RealBackend, ledger) {
        Ok(a) => a,
        Err(e) => {
            let why = format!("bad configuration: {e}");
            vlog!(ERROR, "{why}; every allocation will fail until it is fixed");
            return Enforcement::Broken(why);
        }
    };
    crate::sm_limit::configure(&config);
    for (i, l) in config.memory_limit.iter().enumerate() {
        if let Some(l) = l {
            vlog!(INFO, "device {i}: memory limit {l} bytes");
        }
    }
    Enforcement::Ready(Box::new(Ready {
        config,
        alloc,
        pools: MeasuredTracker::default(),
        graph: MeasuredTracker::default(),
        graph_mem_possible: AtomicBool::new(false),
        primary: Mutex::new(HashMap::new()),
        ordinals_by_uuid: Mutex::new(None),
    }))
}

extern "C" fn after_fork_in_child() {
    // The parent's state is leaked, not dropped: its mutexes may be held by threads that
    // were not copied into the child.
    STATE.store(std::ptr::null_mut(), Ordering::Release);
    BUILDING.store(false, Ordering::Release);
    crate::sm_limit::after_fork_in_child();
}
