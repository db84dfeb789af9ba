//! vgpu-cuda-abi (work in progress).
