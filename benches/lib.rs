//! Criterion benchmarks of vgpu's hot paths live beside this file; run them with `cargo bench -p vgpu-benches`.
