#![no_main]
//! Arbitrary file contents through the shared table's attach path (validate, attach, register,
//! reserve, release, sweep, snapshot): no panic, hang or exit. `P`-prefixed inputs patch a
//! valid file to get past validation (see `vgpu_shm::fuzzing::attach_arbitrary`).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vgpu_shm::fuzzing::attach_arbitrary(data);
});
