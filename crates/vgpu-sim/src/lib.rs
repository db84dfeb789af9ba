//! `libvgpusim.so`: a simulated CUDA driver and NVML over host memory, for testing `libvgpu.so`
//! without a GPU.
//!
//! One shared object is served under the names `libcuda.so.1` and `libnvidia-ml.so.1`
//! (symlinks), so NVML sees the same devices and usage as the driver API. Device memory is
//! host memory mapped lazily; kernels are built-ins (`spin`, `fill`) that run on per-stream
//! worker threads. The environment variables that configure the simulated machine are
//! documented in `docs/simulated-driver.md` and in [`config`].
//!
//! Layout: [`config`] (environment), [`state`] (all semantics, safe Rust), [`engine`] (stream
//! workers, events, busy time), [`power`] (the power draw NVML reports), [`hostmem`] (the only
//! raw memory code), and the exported C functions in `driver`, `nvml` and `procaddr` (pointer
//! translation only).

pub mod codes;
pub mod config;
pub mod driver;
pub mod engine;
pub mod hostmem;
pub mod nvml;
pub mod power;
pub mod procaddr;
pub mod state;
