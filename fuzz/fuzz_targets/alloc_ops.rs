//! Random operation sequences through vgpu-alloc-core's allocator, checked against its
//! model after every step (see `vgpu_alloc_core::fuzzing`).
//! Run: `cargo fuzz run -s none alloc_ops` (works on stable Rust).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(violation) = vgpu_alloc_core::fuzzing::run_ops(data) {
        panic!("{violation}");
    }
});
