//! The fork rule at the simulator level (no hook), as the real driver has it: a child forked
//! from a parent that only used NVML initializes CUDA and allocates; a child forked after the
//! parent initialized CUDA gets `CUDA_ERROR_NOT_INITIALIZED` (3) from `cuInit` and from every
//! later call.
//!
//! Its own harness (`harness = false` in `Cargo.toml`): `fork` wants a process with one thread,
//! and the simulator's process-wide state must start fresh, with nothing initialized.

use std::ptr::null_mut;

use vgpu_cuda_abi::{CUcontext, CUdevice, CUdeviceptr, nvmlDevice_t, nvmlMemory_t};
use vgpusim::driver::{
    cuCtxSetCurrent, cuDeviceGet, cuDeviceGetCount, cuDevicePrimaryCtxRetain, cuInit,
    cuMemAlloc_v2, cuMemFree_v2, cuMemcpyDtoH_v2, cuMemsetD8_v2,
};
use vgpusim::nvml::{nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetMemoryInfo, nvmlInit_v2};

const CUDA_ERROR_NOT_INITIALIZED: u32 = 3;

/// What a worker does: initialize CUDA, allocate, write and read back. The first failing
/// call's code, or 0.
fn use_cuda() -> u32 {
    let mut dev = CUdevice(0);
    let mut ctx: CUcontext = null_mut();
    let mut p = CUdeviceptr(0);
    let mut back = [0u8; 64];
    // SAFETY: every out-parameter is a live local; sizes match the buffers.
    let steps = unsafe {
        [
            cuInit(0),
            cuDeviceGet(&mut dev, 0),
            cuDevicePrimaryCtxRetain(&mut ctx, dev),
            cuCtxSetCurrent(ctx),
            cuMemAlloc_v2(&mut p, 1 << 20),
            cuMemsetD8_v2(p, 0x5a, back.len()),
            cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), p, back.len()),
            cuMemFree_v2(p),
        ]
    };
    // Evaluated in order; the array holds every result, so report the first error.
    if let Some(r) = steps.iter().find(|r| r.0 != 0) {
        return r.0;
    }
    if back.iter().any(|&b| b != 0x5a) {
        return 999;
    }
    0
}

/// `cuDeviceGetCount` in this process.
fn device_count() -> u32 {
    let mut n = 0;
    // SAFETY: `n` is a live local.
    unsafe { cuDeviceGetCount(&mut n) }.0
}

/// Runs `f` in a forked child; its result (0..=255, or 255 for larger codes).
fn in_child(f: fn() -> u32) -> u32 {
    // SAFETY: this process has one thread (no harness), so the child may run Rust code.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let r = f();
        if r != 0 {
            eprintln!("fork test child: the first failing call returned {r}");
        }
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(r.min(255) as i32) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child did not exit: {status}");
    libc::WEXITSTATUS(status) as u32
}

fn main() {
    // SAFETY: out-parameters are live locals.
    unsafe {
        let mut d: nvmlDevice_t = null_mut();
        let mut m = nvmlMemory_t::default();
        assert_eq!(nvmlInit_v2().0, 0);
        assert_eq!(nvmlDeviceGetHandleByIndex_v2(0, &mut d).0, 0);
        assert_eq!(nvmlDeviceGetMemoryInfo(d, &mut m).0, 0);
        assert!(m.total > 0);
    }
    assert_eq!(
        in_child(use_cuda),
        0,
        "a child of a parent that used only NVML initializes CUDA and allocates"
    );
    assert_eq!(
        device_count(),
        CUDA_ERROR_NOT_INITIALIZED,
        "the child's cuInit did not initialize the parent"
    );

    assert_eq!(use_cuda(), 0, "the parent itself uses CUDA");
    assert_eq!(
        in_child(use_cuda),
        CUDA_ERROR_NOT_INITIALIZED,
        "a child of a parent that initialized CUDA is refused with CUDA_ERROR_NOT_INITIALIZED"
    );
    assert_eq!(
        in_child(device_count),
        CUDA_ERROR_NOT_INITIALIZED,
        "and so is every later call there"
    );
    assert_eq!(use_cuda(), 0, "the parent is unaffected");
    println!("fork rule: ok");
}
