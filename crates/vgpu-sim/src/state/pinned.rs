//! Pinned host memory: not device memory, not counted against a device.

use super::*;

impl Sim {
    /// `cuMemAllocHost` / `cuMemHostAlloc`.
    pub fn host_alloc(&self, size: u64) -> CuResult<u64> {
        self.current()?;
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let r = HostRegion::new(size as usize).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let a = r.addr();
        self.st().host_allocs.insert(a, Arc::new(r));
        Ok(a)
    }

    /// `cuMemFreeHost`.
    pub fn host_free(&self, p: u64) -> CuResult<()> {
        self.st()
            .host_allocs
            .remove(&p)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }
}
