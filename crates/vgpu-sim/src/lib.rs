//! `libvgpusim.so`: a simulated CUDA driver and NVML over host memory, for testing `libvgpu.so`
//! without a GPU.
//!
//! One shared object is served under the names `libcuda.so.1` and `libnvidia-ml.so.1`
//! (symlinks), so NVML sees the same devices and usage as the driver API. Device memory is
//! host memory mapped lazily; kernels are built-ins (`spin`, `fill`) that run on per-stream
//! worker threads. The environment variables that configure the simulated machine are
//! documented in `docs/simulated-driver.md` and in [`machine`].
//!
//! Layout: [`machine`] (the simulated machine, from the environment), [`codes`] (the result
//! codes), [`state`] (all semantics, safe Rust, one file per subsystem), [`engine`] (stream
//! workers, events, busy time), [`power`] (the power draw NVML reports), [`hostmem`] (the only
//! code that maps or touches raw memory), and the exported C functions in [`driver`] (one file
//! per subsystem, and [`driver::procaddr`], the `cuGetProcAddress` table) and [`nvml`]
//! (pointer translation only). The compiler keeps that map true: unsafe code is denied
//! everywhere but in `hostmem`, `driver` (but for `procaddr`) and `nvml`.

#![deny(unsafe_code)]

/// Writes `$v` through the out-parameter `$p` the C caller passed, or returns `Err($null)`
/// when it is null: the one body of the driver's `out!` and NVML's `put!`, which differ in
/// the code a null pointer gets. It expands in `driver` and `nvml`, where unsafe is allowed.
macro_rules! write_out {
    ($p:expr, $v:expr, $null:expr) => {{
        let p = $p;
        if p.is_null() {
            return Err($null);
        }
        let v = $v;
        // SAFETY: a non-null out-parameter the caller passed; the driver and NVML APIs require
        // it to be valid for one write of its type.
        unsafe { p.write(v) };
    }};
}

pub mod codes;
#[allow(unsafe_code)]
pub mod driver;
pub mod engine;
#[allow(unsafe_code)]
pub mod hostmem;
pub mod machine;
#[allow(unsafe_code)]
pub mod nvml;
pub mod power;
pub mod state;
