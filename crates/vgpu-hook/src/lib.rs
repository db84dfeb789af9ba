//! `libvgpu.so`: preloaded into unmodified CUDA programs, it intercepts the CUDA driver API
//! and NVML and enforces per-device memory limits (and, through `sm_limit`'s hooks,
//! compute limits) for every process sharing one usage table.
//!
//! Layout:
//! - `exports` (generated from `vgpu-cuda-abi`'s declaration lists) → `hooks` (one Rust
//!   function per hooked symbol, one file per subsystem) → the allocator of `vgpu-alloc-core`, `measured`
//!   (pools, graph memory), `residual` (driver-internal memory reconciled with NVML's
//!   per-process figure, charged as module memory) and `accounting` (sizes, views) →
//!   `real` (the real driver).
//! - `interpose`: what `dlsym` and `cuGetProcAddress` return.
//! - `state`: the per-process state, lazily built, reset in a forked child; `ledger`: its
//!   slot in the shared table, addressed by CUDA ordinal, kept on the right GPU and file.
//!
//! See `docs/hook.md` for how interception works and what each path accounts.
//!
//! Unsafe code is denied here and allowed only in the boundary modules below, each for the
//! reason given at its declaration (in `hooks`, per file: the hooks that read or write the
//! caller's pointers). Accounting (`accounting`, `measured`, `residual`), lookup decisions
//! (`interpose`) and logging (`log`, but for its `stderr` writer) are safe Rust.

#![deny(unsafe_code)]

mod accounting;
// Real driver calls: function pointers from the declaration list, called under their contract.
#[allow(unsafe_code)]
mod driver;
// The C ABI: `#[no_mangle]` exports, the naked `dlsym`, the forwards to the real functions.
#[allow(unsafe_code)]
pub mod exports;
// Out-pointer writes and in-pointer reads at the C boundary.
#[allow(unsafe_code)]
mod ffi;
mod hooks;
mod host_backing;
mod interpose;
mod ledger;
mod log;
mod measured;
// Fork and exit handlers, `dlopen`/`dlsym` of the
// real libraries and their lock-free publication (`real`), the per-process state's
// publication and fork reset (`state`), the SM limiter's event functions (`sm_limit`).
// The leaked-Box publication behind `Published<T>` (a raw pointer owned by one cell).
#[allow(unsafe_code)]
mod published;
#[allow(unsafe_code)]
mod real;
mod residual;
#[allow(unsafe_code)]
mod sm_limit;
#[allow(unsafe_code)]
mod state;
mod sync;
#[cfg(test)]
mod testing;
mod worker;
