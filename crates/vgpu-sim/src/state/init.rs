//! `cuInit`, the process-wide simulator, fault injection and the fork rule.
//!
//! The fork rule is the real driver's: a child forked after its parent initialized CUDA
//! (`cuInit` succeeded) cannot use CUDA, its `cuInit` and every later call return
//! `CUDA_ERROR_NOT_INITIALIZED` (3); a child of a parent that only used NVML, or nothing, can
//! initialize CUDA itself. Seen on the H200 (issue 12: the bare driver's child of an NVML-only
//! parent works; a parent whose hook had initialized CUDA got 3 in the child) and reported for
//! H100s (triton-lang/triton#10443: `cuInit` in a child forked after CUDA initialization
//! returns 3, so does `cuDeviceGetCount`).

use super::*;

static SIM: OnceLock<Result<Sim, ConfigError>> = OnceLock::new();

/// Set in a child forked after CUDA was initialized: the parent's driver state is not usable
/// there, and CUDA cannot be initialized again.
static FORKED: AtomicBool = AtomicBool::new(false);

/// Registers the fork handler once per process.
pub(super) fn watch_forks() {
    static AT_FORK: std::sync::Once = std::sync::Once::new();
    AT_FORK.call_once(|| crate::hostmem::at_fork_child(forked_child));
}

/// The `pthread_atfork` child handler: atomic loads and a store only (async-signal-safe).
extern "C" fn forked_child() {
    let cuda_in_parent = matches!(SIM.get(), Some(Ok(s)) if s.inited.load(Ordering::Acquire));
    if cuda_in_parent {
        FORKED.store(true, Ordering::Relaxed);
    }
}

/// The process-wide simulator (configured from the environment on first use).
pub fn global() -> Result<&'static Sim, u32> {
    match SIM.get_or_init(|| SimConfig::from_env().map(Sim::new)) {
        Ok(s) => Ok(s),
        Err(e) => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                eprintln!("{e}");
            }
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

/// The simulator if `cuInit` succeeded in this process, else `CUDA_ERROR_NOT_INITIALIZED`.
pub fn inited() -> CuResult<&'static Sim> {
    match SIM.get() {
        Some(Ok(s)) if s.inited.load(Ordering::Acquire) && !FORKED.load(Ordering::Relaxed) => Ok(s),
        _ => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

impl Sim {
    /// `cuInit`.
    pub fn init(&self, flags: u32) -> CuResult<()> {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if FORKED.load(Ordering::Relaxed) {
            // A child forked after the parent initialized CUDA (module doc).
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        }
        if self.cfg.visible.is_empty() {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        self.inited.store(true, Ordering::Release);
        Ok(())
    }

    /// Applies injected faults for entry point `op`; `alloc` marks allocating calls.
    pub fn fault(&self, op: &str, alloc: bool) -> CuResult<()> {
        for (i, f) in self.cfg.faults.iter().enumerate() {
            if f.op == op || (alloc && f.op == "alloc") {
                let n = self.fault_calls[i].fetch_add(1, Ordering::Relaxed) + 1;
                if f.nth.is_none_or(|k| k == n) {
                    return Err(f.code);
                }
            }
        }
        Ok(())
    }
}
