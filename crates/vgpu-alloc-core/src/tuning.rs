//! The sub-allocator's sizes (HAMi-core's OVERSIZE, BITSIZE, IPCSIZE, ALIGN) and the rules
//! they must satisfy together. Where the values come from is the caller's business (the
//! hook reads them from `VGPU_ALLOC_*` through `vgpu-env`); [`Allocator::new`] refuses a
//! set that breaks a rule.
//!
//! [`Allocator::new`]: crate::Allocator::new

const MIB: u64 = 1 << 20;

/// Sizes of the region/bitmap/chunk sub-allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorConfig {
    /// Whether small requests are sub-allocated at all.
    pub suballoc: bool,
    /// Bytes of the largest region (OVERSIZE, default 128 MiB). Regions grow to it: a
    /// context's first is one page (the threshold rounded up to ALIGN), each next one
    /// twice the largest it holds, and none larger than what the limit leaves.
    pub region_size: u64,
    /// Bytes of one chunk (BITSIZE, default 512); every sub-allocation is chunk-aligned.
    pub chunk_size: u64,
    /// Requests strictly below this are sub-allocated (IPCSIZE, default 2 MiB).
    pub suballoc_threshold: u64,
    /// Direct allocations are accounted rounded up to this (ALIGN, default 2 MiB).
    pub align: u64,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        Self {
            suballoc: true,
            region_size: 128 * MIB,
            chunk_size: 512,
            suballoc_threshold: 2 * MIB,
            align: 2 * MIB,
        }
    }
}

impl AllocatorConfig {
    /// Chunks per region.
    pub fn chunks_per_region(&self) -> u64 {
        self.region_size / self.chunk_size.max(1)
    }

    /// Check the sizes fit together; the message says which rule is broken.
    pub fn validate(&self) -> Result<(), String> {
        if self.chunk_size == 0 || !self.chunk_size.is_power_of_two() {
            return Err(format!(
                "chunk size {} must be a power of two",
                self.chunk_size
            ));
        }
        if self.align == 0 || !self.align.is_power_of_two() {
            return Err(format!("alignment {} must be a power of two", self.align));
        }
        if self.region_size == 0 || self.region_size % self.chunk_size != 0 {
            return Err(format!(
                "region size {} must be a non-zero multiple of the chunk size {}",
                self.region_size, self.chunk_size
            ));
        }
        // The bitmap index is u32 and a region must stay addressable by one allocation.
        if self.chunks_per_region() > u64::from(u32::MAX) {
            return Err(format!(
                "region size {} has too many chunks",
                self.region_size
            ));
        }
        // A sub-allocation's size is kept in 32 bits beside its chunks.
        if self.suballoc_threshold > 1 << 32 {
            return Err(format!(
                "sub-allocation threshold {} exceeds 4 GiB",
                self.suballoc_threshold
            ));
        }
        if self.suballoc_threshold > self.region_size {
            return Err(format!(
                "sub-allocation threshold {} exceeds the region size {}",
                self.suballoc_threshold, self.region_size
            ));
        }
        Ok(())
    }
}
