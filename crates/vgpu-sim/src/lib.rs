//! vgpu-sim (work in progress).
