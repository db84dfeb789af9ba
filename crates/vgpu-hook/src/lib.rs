//! vgpu-hook (work in progress).
