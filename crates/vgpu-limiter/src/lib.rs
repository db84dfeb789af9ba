//! vgpu-limiter (work in progress).
