//! The sample gate (docs/sm-limit.md, "What a launch costs"): a stream wait on a word of
//! pinned host memory that the limiter puts ahead of a sample's start marker and opens once
//! the sample's launch and end marker are queued, so the bracket holds the kernel alone.
//!
//! **Invariant: no gate stays closed longer than [`MAX_HELD`].** A launch call can wait for
//! the GPU inside the driver (the driver loads a kernel's module into the context at its
//! first launch and waits for that; a full command queue waits for room), and the GPU would
//! wait for the gate the launching thread opens only after the call: on the H200 a PyTorch
//! process hung at its first launches, most likely that way (not traced). So a watchdog thread (`vgpu-gate`) opens
//! every gate held past its deadline, and such a sample is not used ([`SampleGate::open`]
//! says so). The limiter gates only identities launched before, so the driver's first-launch
//! work seldom meets a gate.
//!
//! One word per device, on a page of our own mapped at the first gate and never unmapped, so
//! writing it can never fault. The driver reaches it through a registration
//! (`cuMemHostRegister`, portable and mapped), which belongs to the context that made it and
//! goes with it (`cuCtxDestroy`, a primary context's reset): each gate asks for the word's
//! device address first and registers it again where that fails. Its value only grows: each gate waits for the word to reach a larger value
//! (`CU_STREAM_WAIT_VALUE_GEQ`, which compares as a wrapping difference), and opening writes
//! that value. A device's limiter holds at most one gate at a time (its lock is held from
//! admission to the launch's report).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use vgpu_alloc_core::MAX_DEVICES;
use vgpu_cuda_abi::{CUdeviceptr, CUresult, CUstream, pfn};
use vgpu_limiter::TimerError;

use crate::log::{INFO, vlog};
use crate::worker::Worker;

/// The longest a gate stays closed: far beyond a launch call's few microseconds, and short
/// enough that a launch call waiting inside the driver for the GPU costs at most this once.
const MAX_HELD: Duration = Duration::from_millis(1);
/// The longest an exiting process waits for the watchdog's step (a store to a word).
const STOP_WAIT: Duration = Duration::from_millis(10);
/// `CU_STREAM_WAIT_VALUE_GEQ`.
const WAIT_GEQ: u32 = 0;
/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`.
const REGISTER_FLAGS: u32 = 0x1 | 0x2;
/// The word's page (the driver pins whole pages).
const WORD_PAGE: usize = 4096;
/// `word`: no page mapped yet; none could be mapped.
const UNTRIED: usize = 0;
const UNAVAILABLE: usize = 1;

/// No gate is queued any more (the driver refused a stream wait, or the watchdog could not
/// start). A word once allocated stays valid: gates queued before are still opened.
static OFF: AtomicBool = AtomicBool::new(false);

/// One device's gate, shared with the watchdog.
struct GateCell {
    /// The host word's address, or [`UNTRIED`] / [`UNAVAILABLE`].
    word: AtomicUsize,
    /// The value the last gate waits for.
    issued: AtomicU32,
    /// When the gate held now must be open (`CLOCK_MONOTONIC` ns); 0 while none is held.
    /// Whoever swaps it from a deadline to 0 opens the gate.
    deadline: AtomicU64,
}

static CELLS: [GateCell; MAX_DEVICES] = [const {
    GateCell {
        word: AtomicUsize::new(UNTRIED),
        issued: AtomicU32::new(0),
        deadline: AtomicU64::new(0),
    }
}; MAX_DEVICES];

impl GateCell {
    /// Writes the last issued value: every gate of this cell is open.
    fn write_open(&self) {
        let word = self.word.load(Ordering::Acquire);
        if word > UNAVAILABLE {
            // SAFETY: our word, 4-aligned (a page's start) on a page we mapped and never
            // unmap; the GPU only reads it.
            let w = unsafe { AtomicU32::from_ptr(word as *mut u32) };
            w.store(self.issued.load(Ordering::Acquire), Ordering::Release);
        }
    }
}

/// A device's gate (its limiter's timer holds it).
#[derive(Debug)]
pub(super) struct SampleGate {
    device: usize,
}

impl SampleGate {
    pub(super) fn new(device: usize) -> Self {
        Self {
            device: device.min(MAX_DEVICES - 1),
        }
    }

    fn cell(&self) -> &'static GateCell {
        &CELLS[self.device]
    }

    /// Queues a gate on the stream `handle` (the program's handle, as it passed it).
    pub(super) fn hold(&mut self, handle: usize) -> Result<(), TimerError> {
        let cell = self.cell();
        let (fns, device) = ready(cell)?;
        let value = cell.issued.load(Ordering::Relaxed).wrapping_add(1);
        // SAFETY: the program's stream handle as it passes it to its launch, the device
        // address of our live pinned word, and flags the driver knows.
        let r = unsafe { (fns.wait)(handle as CUstream, CUdeviceptr(device), value, WAIT_GEQ) };
        if r == CUresult::NOT_SUPPORTED {
            off("the driver does not support stream waits");
        }
        if !r.is_success() {
            return Err(TimerError { code: r.0 as i32 });
        }
        cell.issued.store(value, Ordering::Release);
        let deadline = vgpu_shm::monotonic_ns().saturating_add(MAX_HELD.as_nanos() as u64);
        cell.deadline.store(deadline.max(1), Ordering::Release);
        watchdog().wake();
        Ok(())
    }

    /// Opens the gate held, if any; whether it was still held until now (false: the
    /// watchdog opened it, or none was held).
    pub(super) fn open(&mut self) -> bool {
        let cell = self.cell();
        if cell.deadline.swap(0, Ordering::AcqRel) == 0 {
            return false;
        }
        cell.write_open();
        true
    }
}

#[derive(Debug, Clone, Copy)]
struct GateFns {
    wait: pfn::cuStreamWaitValue32_v2,
    register: pfn::cuMemHostRegister_v2,
    device_pointer: pfn::cuMemHostGetDevicePointer_v2,
}

fn gate_fns() -> Option<GateFns> {
    let u = &crate::real::cuda().ok()?.u;
    Some(GateFns {
        wait: u.cuStreamWaitValue32_v2?,
        register: u.cuMemHostRegister_v2?,
        device_pointer: u.cuMemHostGetDevicePointer_v2?,
    })
}

/// The functions and the word's device address in the current context: its page mapped at
/// the first gate, registered again where its registration went with an ended context.
fn ready(cell: &GateCell) -> Result<(GateFns, u64), TimerError> {
    const NONE: TimerError = TimerError { code: -4 };
    if OFF.load(Ordering::Relaxed) {
        return Err(NONE);
    }
    let Some(fns) = gate_fns() else {
        off("the driver lacks stream waits or host registration");
        return Err(NONE);
    };
    if cell.word.load(Ordering::Acquire) == UNTRIED {
        let word = map_page().unwrap_or(UNAVAILABLE);
        if word == UNAVAILABLE {
            log_off("no page for its word");
        }
        cell.word.store(word, Ordering::Release);
    }
    let word = cell.word.load(Ordering::Acquire);
    if word <= UNAVAILABLE {
        return Err(NONE);
    }
    if let Some(device) = device_address(fns, word) {
        return Ok((fns, device));
    }
    // SAFETY: our page, WORD_PAGE bytes, mapped for the process's life; flags the driver
    // knows. A registration that still exists answers ALREADY_REGISTERED, which the
    // address lookup above would have found.
    let r = unsafe { (fns.register)(word as *mut std::ffi::c_void, WORD_PAGE, REGISTER_FLAGS) };
    if r == CUresult::NOT_SUPPORTED {
        off("the driver cannot register host memory");
    }
    device_address(fns, word)
        .map(|d| (fns, d))
        .ok_or(TimerError { code: r.0 as i32 })
}

/// The device address of our word in the current context, if its page is registered there.
fn device_address(fns: GateFns, word: usize) -> Option<u64> {
    let mut device = CUdeviceptr(0);
    // SAFETY: valid out-pointer; a host address of ours; flags must be 0. An unregistered
    // address is an error answer, nothing more.
    let r = unsafe { (fns.device_pointer)(&mut device, word as *mut std::ffi::c_void, 0) };
    (r.is_success() && device.0 != 0).then_some(device.0)
}

/// A fresh page of our own for a word (never unmapped), zeroed.
#[cold]
fn map_page() -> Option<usize> {
    crate::ffi::map_anonymous(WORD_PAGE).map(|p| p as usize)
}

/// No more gates anywhere in the process.
#[cold]
fn off(why: &str) {
    if !OFF.swap(true, Ordering::Relaxed) {
        log_off(why);
    }
}

#[cold]
fn log_off(why: &str) {
    vlog!(
        INFO,
        "SM limit: samples are not gated ({why}); a sample on an idle stream may hold the launch call's time"
    );
}

/// The watchdog thread's controls and its handle (for waking it).
struct Watchdog {
    worker: Worker,
    thread: AtomicPtr<std::thread::Thread>,
}

static WATCHDOG: Watchdog = Watchdog {
    worker: Worker::new(),
    thread: AtomicPtr::new(std::ptr::null_mut()),
};

fn watchdog() -> &'static Watchdog {
    &WATCHDOG
}

impl Watchdog {
    /// Wakes the thread (starting it once per process) to watch a gate's deadline.
    fn wake(&'static self) {
        if self.worker.claim() {
            let started = self.worker.spawn("vgpu-gate", |w| {
                // Leaked, never freed: a waker may be reading the handle it replaces (a
                // forked child's replaces its parent's thread's).
                let me = Box::into_raw(Box::new(std::thread::current()));
                WATCHDOG.thread.store(me, Ordering::Release);
                run(w)
            });
            if let Err(e) = started {
                // The gate held now is opened by its launch as usual; no more are queued.
                off(&format!("its watchdog thread cannot start: {e}"));
            }
            return;
        }
        let t = self.thread.load(Ordering::Acquire);
        if !t.is_null() {
            // SAFETY: a leaked, never freed `Thread` handle.
            unsafe { &*t }.unpark();
        }
    }
}

/// Opens every gate past its deadline; sleeps until the next deadline, or until woken.
fn run(w: &Worker) {
    loop {
        let now = vgpu_shm::monotonic_ns();
        let mut next: Option<u64> = None;
        let step = w.step(|| {
            for cell in &CELLS {
                let d = cell.deadline.load(Ordering::Acquire);
                if d == 0 {
                    continue;
                }
                if d <= now {
                    if cell
                        .deadline
                        .compare_exchange(d, 0, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        cell.write_open();
                    }
                } else {
                    next = Some(next.map_or(d, |n: u64| n.min(d)));
                }
            }
        });
        if step.is_err() {
            return;
        }
        match next {
            Some(d) => std::thread::park_timeout(Duration::from_nanos(d.saturating_sub(now))),
            None => std::thread::park(),
        }
    }
}

/// At exit: the watchdog takes no step after this (it would write to pinned memory the
/// driver may be tearing down).
pub(super) fn stop_at_exit() {
    WATCHDOG.worker.stop(STOP_WAIT);
}

/// In the child after `fork`: the watchdog thread was not copied.
pub(super) fn reset_in_child() {
    WATCHDOG.worker.reset_in_child();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_past_its_deadline_is_opened_by_the_watchdog_and_its_sample_is_not_used() {
        // A word of our own in place of the pinned one (the cell of the last device, which
        // no other test of this process uses).
        let word: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
        let cell = &CELLS[MAX_DEVICES - 1];
        cell.word
            .store(word as *const AtomicU32 as usize, Ordering::Release);
        cell.issued.store(7, Ordering::Release);
        cell.deadline
            .store(vgpu_shm::monotonic_ns() + 1_000_000, Ordering::Release);
        watchdog().wake();
        let t0 = std::time::Instant::now();
        while word.load(Ordering::Acquire) != 7 {
            assert!(t0.elapsed() < Duration::from_secs(5), "never opened");
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(
            t0.elapsed() >= Duration::from_micros(500),
            "opened before its deadline"
        );
        let mut gate = SampleGate::new(MAX_DEVICES - 1);
        assert!(
            !gate.open(),
            "the watchdog opened it: the sample is not used"
        );
        // A gate opened in time says so.
        cell.issued.store(8, Ordering::Release);
        cell.deadline
            .store(vgpu_shm::monotonic_ns() + 1_000_000_000, Ordering::Release);
        watchdog().wake();
        assert!(gate.open());
        assert_eq!(word.load(Ordering::Acquire), 8);
        cell.word.store(UNTRIED, Ordering::Release);
    }
}
