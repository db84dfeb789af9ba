//! `libvgpu.so`: preloaded into unmodified CUDA programs, it intercepts the CUDA driver API
//! and NVML and enforces per-device memory limits (and, through `sm_limit`'s hooks,
//! compute limits) for every process sharing one usage table.
//!
//! Layout (`docs/architecture.md` draws it; `docs/hook.md` says how interception works and
//! what each path accounts):
//! - The way in: `exports` (one C function per listed symbol, generated from
//!   `vgpu-cuda-abi`'s declaration lists, and `dlsym`) → `hooks` (the implementations, one
//!   file per subsystem); `interpose` decides which pointer `dlsym` and `cuGetProcAddress`
//!   return; `ffi` holds the C-boundary helpers (pointer reads and writes, the panic guard,
//!   the table of our exports' addresses).
//! - Memory accounting: the allocator of `vgpu-alloc-core` over `ledger` (this process's slot
//!   in the shared table, addressed by CUDA ordinal, kept on the right GPU and file);
//!   `measured` (pools, graph memory); `residual` (driver-internal memory reconciled with
//!   NVML's per-process figure, charged as module memory); `host_backing` (allocations backed
//!   by host memory at a device address); `swap` (an idle process's movable memory swapped
//!   out to host memory and back, behind the gate of the calls that can touch it);
//!   `accounting` (sizes, views, the device page; pure).
//! - Compute: `sm_limit` (the launch path's limiter, over `vgpu-limiter`).
//! - The way out: `driver` (the real-driver calls the accounting needs) → `real` (the real
//!   libraries, loaded with the real `dlsym`).
//! - Process: `state` (the one process root, lazily built, reset in a forked child, left at
//!   exit); `published` (`Published<T>`: built once, shared lock-free); `worker` (a background
//!   thread's controls); `sync` (the atomics those protocols use, loom's in their models);
//!   `log` (`LIBCUDA_LOG_LEVEL`, the rate limit, the stderr writer). Test-only: `testing`.
//!
//! Unsafe code is denied here and allowed only in the boundary modules below, each for the
//! reason given at its declaration (in `hooks`, per file: the hooks that read or write the
//! caller's pointers; in `log`, its `stderr` writer). Everything else is safe Rust.

#![deny(unsafe_code)]

mod accounting;
// Real driver calls: function pointers from the declaration list, called under their contract.
#[allow(unsafe_code)]
mod driver;
// The C ABI: `#[no_mangle]` exports, the naked `dlsym`, the forwards to the real functions.
#[allow(unsafe_code)]
pub mod exports;
// Out-pointer writes and in-pointer reads at the C boundary; the export table is `Sync`.
#[allow(unsafe_code)]
mod ffi;
mod hooks;
mod host_backing;
mod interpose;
mod ledger;
mod log;
mod measured;
// The leaked-Box publication behind `Published<T>` (a raw pointer owned by one cell).
#[allow(unsafe_code)]
mod published;
// `dlopen`/`dlsym` of the real libraries and calls through their function pointers.
#[allow(unsafe_code)]
mod real;
mod residual;
// CUDA events around launches (the real driver's function pointers), and the slot it is
// handed at start (a raw pointer to the never-freed process state).
#[allow(unsafe_code)]
mod sm_limit;
// The fork handler's registration and the exit handler's `.fini_array` entry.
#[allow(unsafe_code)]
mod state;
mod swap;
mod sync;
#[cfg(test)]
mod testing;
mod worker;
