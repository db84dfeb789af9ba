//! The sample gate (docs/sm-limit.md, "What a launch costs"): a stream wait on a word of
//! pinned host memory that the limiter puts ahead of a sample's start marker and opens once
//! the sample's launch and end marker are queued, so the bracket holds the kernel alone.
//!
//! One word per device's timer, allocated at the first sample (`cuMemHostAlloc`, portable
//! and mapped, so every context of the process can wait on it) and kept for the process's
//! life. Its value only grows: each gate waits for the word to reach a larger value
//! (`CU_STREAM_WAIT_VALUE_GEQ`, which compares as a wrapping difference), and opening writes
//! the last value handed out. The limiter holds at most one gate at a time and opens it
//! before its launch call returns to the program, so a gate never outlives a launch.

use std::sync::atomic::{AtomicU32, Ordering};

use vgpu_cuda_abi::{CUdeviceptr, CUresult, CUstream, pfn};
use vgpu_limiter::TimerError;

use crate::log::{INFO, vlog};

/// `CU_STREAM_WAIT_VALUE_GEQ`.
const WAIT_GEQ: u32 = 0;
/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const HOST_ALLOC_FLAGS: u32 = 0x1 | 0x2;
/// The word's allocation (the driver pins whole pages).
const WORD_ALLOC: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct GateFns {
    wait: pfn::cuStreamWaitValue32_v2,
    host_alloc: pfn::cuMemHostAlloc,
    device_pointer: pfn::cuMemHostGetDevicePointer_v2,
}

#[derive(Debug)]
enum Word {
    /// Not needed yet.
    Untried,
    /// The host word's address and its device address.
    Ready { host: usize, device: u64 },
    /// The driver cannot give one: samples go ungated.
    Unavailable,
}

/// A device timer's gate.
#[derive(Debug)]
pub(super) struct SampleGate {
    word: Word,
    /// The value the last gate waits for.
    issued: u32,
    /// A gate is queued and not opened.
    held: bool,
}

impl SampleGate {
    pub(super) const fn new() -> Self {
        Self {
            word: Word::Untried,
            issued: 0,
            held: false,
        }
    }

    /// Queues a gate on the stream `handle` (the program's handle, as it passed it).
    pub(super) fn hold(&mut self, handle: usize) -> Result<(), TimerError> {
        let (fns, device) = self.ready()?;
        let value = self.issued.wrapping_add(1);
        // SAFETY: the program's stream handle as it passes it to its launch, the device
        // address of our live pinned word, and flags the driver knows.
        let r = unsafe { (fns.wait)(handle as CUstream, CUdeviceptr(device), value, WAIT_GEQ) };
        if r == CUresult::NOT_SUPPORTED {
            self.unavailable("the driver does not support stream waits");
        }
        if !r.is_success() {
            return Err(TimerError { code: r.0 as i32 });
        }
        self.issued = value;
        self.held = true;
        Ok(())
    }

    /// Opens every gate queued.
    pub(super) fn open(&mut self) {
        if !std::mem::take(&mut self.held) {
            return;
        }
        if let Word::Ready { host, .. } = self.word {
            // SAFETY: our pinned word, 4-aligned (a page's start), mapped for the process's
            // life; the GPU only reads it.
            let word = unsafe { AtomicU32::from_ptr(host as *mut u32) };
            word.store(self.issued, Ordering::Release);
        }
    }

    fn ready(&mut self) -> Result<(GateFns, u64), TimerError> {
        const UNAVAILABLE: TimerError = TimerError { code: -4 };
        if let Word::Untried = self.word {
            self.word = match allocate() {
                Ok(w) => w,
                Err(why) => {
                    self.unavailable(why);
                    Word::Unavailable
                }
            };
        }
        match (&self.word, gate_fns()) {
            (Word::Ready { device, .. }, Some(fns)) => Ok((fns, *device)),
            _ => Err(UNAVAILABLE),
        }
    }

    #[cold]
    fn unavailable(&mut self, why: &str) {
        self.word = Word::Unavailable;
        vlog!(
            INFO,
            "SM limit: samples are not gated ({why}); a sample on an idle stream may hold the launch call's time"
        );
    }
}

fn gate_fns() -> Option<GateFns> {
    let u = &crate::real::cuda().ok()?.u;
    Some(GateFns {
        wait: u.cuStreamWaitValue32_v2?,
        host_alloc: u.cuMemHostAlloc?,
        device_pointer: u.cuMemHostGetDevicePointer_v2?,
    })
}

#[cold]
fn allocate() -> Result<Word, &'static str> {
    let fns = gate_fns().ok_or("the driver lacks stream waits or mapped host memory")?;
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer, a size and flags the driver knows; the calling thread's
    // context is current (a launch is being admitted on it).
    let r = unsafe { (fns.host_alloc)(&mut host, WORD_ALLOC, HOST_ALLOC_FLAGS) };
    if !r.is_success() || host.is_null() {
        return Err("no pinned host memory for its word");
    }
    // SAFETY: the allocation is ours and WORD_ALLOC bytes long; nothing else uses it yet.
    unsafe { AtomicU32::from_ptr(host.cast::<u32>()) }.store(0, Ordering::Release);
    let mut device = CUdeviceptr(0);
    // SAFETY: valid out-pointer and a pinned allocation of ours; flags must be 0.
    let r = unsafe { (fns.device_pointer)(&mut device, host, 0) };
    if !r.is_success() || device.0 == 0 {
        return Err("its word has no device address");
    }
    Ok(Word::Ready {
        host: host as usize,
        device: device.0,
    })
}
