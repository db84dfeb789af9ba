//! Launches: the SM limit's entry points. Each body names only the arguments it reads (the
//! stream); the list line gives the export the rest, and every `_ptsz` twin is a list line.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

/// Runs a launch with the SM limiter around it when one is configured; without one this is
/// a single relaxed load and the real call. `stream` is read only under a limit.
#[inline(always)]
pub(super) fn launch(
    variant: StreamKind,
    stream: impl FnOnce() -> CUstream,
    kind: LaunchKind,
    forward: impl Forward,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    if !sm_limit::enabled() {
        return forward(cuda);
    }
    let stream = match variant {
        StreamKind::PerThread => per_thread(stream()),
        StreamKind::Legacy | StreamKind::Any => stream(),
    };
    launch_limited(cuda, stream, kind, forward)
}

#[cold]
fn launch_limited(
    cuda: &Cuda,
    stream: CUstream,
    kind: LaunchKind,
    forward: impl Forward,
) -> Result<(), CUresult> {
    let Some(idx) = driver::stream_device(cuda, stream).ok().and_then(dev_index) else {
        return forward(cuda);
    };
    sm_limit::before_launch(idx, stream, kind)?;
    let r = forward(cuda);
    sm_limit::after_launch(idx, stream, kind, crate::ffi::code(r));
    r
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

/// The launch hooks whose stream is an argument, each with the kind the limiter records.
macro_rules! stream_argument_launches {
    ($($name:ident => $kind:ident;)*) => {$(
        pub(crate) fn $name(
            variant: StreamKind,
            forward: impl Forward,
            stream: CUstream,
        ) -> Result<(), CUresult> {
            launch(variant, || stream, LaunchKind::$kind, forward)
        }
    )*};
}

stream_argument_launches! {
    cuLaunchKernel => Kernel;
    cuLaunchCooperativeKernel => Cooperative;
}

pub(crate) unsafe fn cuLaunchKernelEx(
    variant: StreamKind,
    forward: impl Forward,
    config: *const CUlaunchConfig,
) -> Result<(), CUresult> {
    // The stream of the config (null config: the default stream; the driver reports it).
    // SAFETY: `config` is null or valid (driver contract).
    let stream = || unsafe { read_in(config) }.map_or(std::ptr::null_mut(), |c| c.hStream);
    launch(variant, stream, LaunchKind::KernelEx, forward)
}
