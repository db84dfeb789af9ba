//! Launches: the SM limit's entry points.

use super::*;

/// Runs a launch with the SM limiter around it when one is configured; without one this is
/// a single relaxed load and the real call.
#[inline(always)]
pub(super) fn launch(
    cuda: &Cuda,
    stream: impl FnOnce() -> CUstream,
    kind: LaunchKind,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    if !sm_limit::enabled() {
        return real();
    }
    launch_limited(cuda, stream(), kind, real)
}

#[cold]
pub(super) fn launch_limited(
    cuda: &Cuda,
    stream: CUstream,
    kind: LaunchKind,
    real: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some(idx) = driver::stream_device(cuda, stream).ok().and_then(dev_index) else {
        return real();
    };
    tri!(sm_limit::before_launch(idx, stream, kind));
    let r = real();
    sm_limit::after_launch(idx, stream, kind, r);
    r
}

pub(crate) unsafe fn cuLaunchKernel(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || stream,
        LaunchKind::Kernel,
        || {
            call!(
                cuda,
                h.cuLaunchKernel(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params,
                    extra
                )
            )
        },
    )
}

pub(crate) unsafe fn cuLaunchKernel_ptsz(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || per_thread(stream),
        LaunchKind::Kernel,
        || {
            call!(
                cuda,
                h.cuLaunchKernel_ptsz(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params,
                    extra
                )
            )
        },
    )
}

/// The stream a `_ptsz` entry point runs on: the null stream there is the calling thread's
/// default stream, which the limiter must name as `CU_STREAM_PER_THREAD` to record its events
/// on the same stream.
pub(super) fn per_thread(stream: CUstream) -> CUstream {
    if stream.is_null() {
        2usize as CUstream
    } else {
        stream
    }
}

/// The stream of a `CUlaunchConfig` (null config: the default stream; the driver reports it).
///
/// # Safety
/// `config` is null or valid (driver contract).
pub(super) unsafe fn config_stream(config: *const CUlaunchConfig) -> CUstream {
    // SAFETY: per this function's contract.
    unsafe { read_in(config) }.map_or(std::ptr::null_mut(), |c| c.hStream)
}

pub(crate) unsafe fn cuLaunchKernelEx(
    config: *const CUlaunchConfig,
    f: CUfunction,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `config` per the driver contract.
    launch(
        cuda,
        || unsafe { config_stream(config) },
        LaunchKind::KernelEx,
        || call!(cuda, h.cuLaunchKernelEx(config, f, kernel_params, extra)),
    )
}

pub(crate) unsafe fn cuLaunchKernelEx_ptsz(
    config: *const CUlaunchConfig,
    f: CUfunction,
    kernel_params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    // SAFETY: `config` per the driver contract.
    launch(
        cuda,
        || per_thread(unsafe { config_stream(config) }),
        LaunchKind::KernelEx,
        || {
            call!(
                cuda,
                h.cuLaunchKernelEx_ptsz(config, f, kernel_params, extra)
            )
        },
    )
}

pub(crate) unsafe fn cuLaunchCooperativeKernel(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || stream,
        LaunchKind::Cooperative,
        || {
            call!(
                cuda,
                h.cuLaunchCooperativeKernel(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params
                )
            )
        },
    )
}

pub(crate) unsafe fn cuLaunchCooperativeKernel_ptsz(
    f: CUfunction,
    grid_x: c_uint,
    grid_y: c_uint,
    grid_z: c_uint,
    block_x: c_uint,
    block_y: c_uint,
    block_z: c_uint,
    shared_mem_bytes: c_uint,
    stream: CUstream,
    kernel_params: *mut *mut c_void,
) -> CUresult {
    let cuda = tri!(real::cuda());
    launch(
        cuda,
        || per_thread(stream),
        LaunchKind::Cooperative,
        || {
            call!(
                cuda,
                h.cuLaunchCooperativeKernel_ptsz(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    kernel_params
                )
            )
        },
    )
}
