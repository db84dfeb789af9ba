//! `libvgpu.so`: preloaded into unmodified CUDA programs, it intercepts the CUDA driver API
//! and NVML and enforces per-device memory limits (and, through `sm_limit`'s hooks,
//! compute limits) for every process sharing one usage table.
//!
//! Layout:
//! - `exports` (generated from `vgpu-cuda-abi`'s declaration lists) → `hooks` (one Rust
//!   function per hooked symbol) → the allocator of `vgpu-alloc-core`, `measured`
//!   (pools, graph memory), `residual` (driver-internal memory reconciled with NVML's
//!   per-process figure, charged as module memory) and `accounting` (sizes, views) →
//!   `real` (the real driver).
//! - `interpose`: what `dlsym` and `cuGetProcAddress` return.
//! - `state`: the per-process state, lazily built, reset in a forked child.
//!
//! See `docs/hook.md` for how interception works and what each path accounts.

mod accounting;
mod driver;
pub mod exports;
mod ffi;
mod hooks;
mod interpose;
mod log;
mod measured;
mod power;
mod published;
mod real;
mod residual;
mod sm_limit;
mod state;
