//! vgpu-shm (work in progress).
