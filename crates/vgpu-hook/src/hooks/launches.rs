//! Launches: the SM limit's entry points. Each body names only the arguments it reads (the
//! stream, and what tells the launch's work apart: the function with its geometry, or the
//! graph); the list line gives the export the rest, and every `_ptsz` twin is a list line.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;
use crate::sm_limit::launch_timing::{part, timed};
use vgpu_limiter::LaunchId;

/// Runs a launch with the SM limiter around it when one is configured; without one this is
/// a single relaxed load and the real call. `what` gives the stream and the launch's
/// identity, and is read only under a limit.
#[inline(always)]
pub(super) fn launch(
    variant: StreamKind,
    what: impl FnOnce() -> (CUstream, LaunchId),
    forward: impl Forward,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    if !state::sm_limiter().enabled() {
        return forward(cuda);
    }
    let (stream, id) = what();
    let stream = match variant {
        StreamKind::PerThread => per_thread(stream),
        StreamKind::Legacy | StreamKind::Any => stream,
    };
    launch_limited(cuda, stream, id, forward)
}

#[cold]
fn launch_limited(
    cuda: &Cuda,
    stream: CUstream,
    id: LaunchId,
    forward: impl Forward,
) -> Result<(), CUresult> {
    let device = timed!(part::DEVICE, driver::stream_device(cuda, stream));
    let Some(idx) = device.ok().and_then(dev_index) else {
        return forward(cuda);
    };
    let sm = state::sm_limiter();
    admit_timed(|| sm.before_launch(idx, stream, id))?;
    #[cfg(feature = "launch-timing")]
    crate::sm_limit::launch_timing::launched();
    let r = timed!(part::LAUNCH, forward(cuda));
    timed!(part::AFTER, sm.after_launch(crate::ffi::code(r)));
    r
}

/// Admission, timed as `admit` less its sleeps (`wait`) in a `launch-timing` build.
#[inline(always)]
fn admit_timed(f: impl FnOnce() -> Result<(), CUresult>) -> Result<(), CUresult> {
    #[cfg(feature = "launch-timing")]
    {
        use crate::sm_limit::launch_timing::{time, total};
        let waited = total(part::WAIT);
        let r = time(part::ADMIT, f);
        // The sleeps are their own part: not admission's host time.
        crate::sm_limit::launch_timing::untime(part::ADMIT, total(part::WAIT) - waited);
        r
    }
    #[cfg(not(feature = "launch-timing"))]
    {
        let _: usize = part::ADMIT;
        f()
    }
}

/// The stream a `_ptsz` entry point runs on: the null stream there is the calling thread's
/// default stream, which the limiter must name as `CU_STREAM_PER_THREAD` to record its events
/// on the same stream.
fn per_thread(stream: CUstream) -> CUstream {
    if stream.is_null() {
        2usize as CUstream
    } else {
        stream
    }
}

/// A kernel launch's identity: its function and geometry (what its run time follows).
fn kernel_id(f: CUfunction, grid: [c_uint; 3], block: [c_uint; 3], shared: c_uint) -> LaunchId {
    let g = |d: [c_uint; 3]| u64::from(d[0]) | u64::from(d[1]) << 24 | u64::from(d[2]) << 48;
    sm_limit::launch_id(&[f as u64, g(grid), g(block), u64::from(shared)])
}

/// The launch hooks whose geometry and stream are arguments.
macro_rules! argument_launches {
    ($($name:ident;)*) => {$(
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name(
            variant: StreamKind,
            forward: impl Forward,
            f: CUfunction,
            grid_x: c_uint,
            grid_y: c_uint,
            grid_z: c_uint,
            block_x: c_uint,
            block_y: c_uint,
            block_z: c_uint,
            shared_mem_bytes: c_uint,
            stream: CUstream,
        ) -> Result<(), CUresult> {
            let id = || kernel_id(f, [grid_x, grid_y, grid_z], [block_x, block_y, block_z], shared_mem_bytes);
            launch(variant, || (stream, id()), forward)
        }
    )*};
}

argument_launches! {
    cuLaunchKernel;
    cuLaunchCooperativeKernel;
}

pub(crate) unsafe fn cuLaunchKernelEx(
    variant: StreamKind,
    forward: impl Forward,
    config: *const CUlaunchConfig,
    f: CUfunction,
) -> Result<(), CUresult> {
    // The stream and geometry of the config (null config: the default stream; the driver
    // reports the error).
    let what = || {
        // SAFETY: `config` is null or valid (driver contract).
        match unsafe { read_in(config) } {
            Some(c) => (
                c.hStream,
                kernel_id(
                    f,
                    [c.gridDimX, c.gridDimY, c.gridDimZ],
                    [c.blockDimX, c.blockDimY, c.blockDimZ],
                    c.sharedMemBytes,
                ),
            ),
            None => (std::ptr::null_mut(), kernel_id(f, [0; 3], [0; 3], 0)),
        }
    };
    launch(variant, what, forward)
}
