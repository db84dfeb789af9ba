//! Physical devices: memory counters, ordinals and attributes.

use super::*;

/// One physical device.
#[derive(Debug)]
pub struct Device {
    /// Bytes of memory.
    pub total: u64,
    /// Bytes used by processes outside this one.
    pub other_used: u64,
    /// UUID bytes.
    pub uuid: [u8; 16],
    /// Bytes this process uses (contexts, modules, allocations, pools, arrays).
    pub used: AtomicU64,
    /// Kernel busy time.
    pub busy: BusyLog,
    /// Its physical index, and the file through which processes share device memory
    /// (`VGPU_SIM_SHARED_MEM`; `None`: this process is alone).
    pub index: usize,
    pub shared: Option<std::sync::Arc<super::shared_mem::SharedMem>>,
}

impl Device {
    /// Bytes free on the device for everybody.
    pub fn free(&self) -> u64 {
        self.total
            .saturating_sub(self.others())
            .saturating_sub(self.used.load(Ordering::Relaxed))
    }

    /// Bytes used by processes outside this one: the static figure, and what the processes
    /// sharing device memory with this one use now.
    pub fn others(&self) -> u64 {
        self.other_used + self.shared.as_ref().map_or(0, |s| s.others(self.index))
    }

    pub(super) fn reserve(&self, bytes: u64) -> CuResult<()> {
        reserve_under(&self.used, self.total.saturating_sub(self.others()), bytes)?;
        self.publish();
        Ok(())
    }

    pub(super) fn release(&self, bytes: u64) {
        release_from(&self.used, bytes);
        self.publish();
    }

    fn publish(&self) {
        if let Some(s) = &self.shared {
            s.publish(self.index, self.used.load(Ordering::Relaxed));
        }
    }
}

impl Sim {
    /// Visible device count.
    pub fn device_count(&self) -> usize {
        self.cfg.visible.len()
    }

    /// Physical index of CUDA ordinal `ord`.
    pub fn phys(&self, ord: i32) -> CuResult<usize> {
        usize::try_from(ord)
            .ok()
            .and_then(|o| self.cfg.visible.get(o).copied())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// CUDA ordinal of physical device `p`, if visible.
    pub fn ordinal_of(&self, p: usize) -> Option<i32> {
        self.cfg
            .visible
            .iter()
            .position(|&v| v == p)
            .map(|o| o as i32)
    }

    /// `cuDeviceGetAttribute`.
    pub fn attribute(&self, attr: i32, ord: i32) -> CuResult<i32> {
        let p = self.phys(ord)?;
        let (maj, min) = self.cfg.compute_capability;
        Ok(match attr {
            1 => 1024,
            2 | 3 => 1024,
            4 => 64,
            5 => i32::MAX,
            6 | 7 => 65535,
            8 => 49152,
            9 => 65536,
            10 => 32,
            11 => i32::MAX,
            12 => 65536,
            13 => 1_980_000,
            14 => 512,
            15 => 1,
            16 => self.cfg.sm_count,
            17 | 18 => 0,
            19 => 1,
            20 => 0,
            31 => 1,
            32 => 1,
            33 => p as i32 + 1,
            34 | 35 => 0,
            36 => 2_619_000,
            37 => 5120,
            38 => 60 << 20,
            39 => 2048,
            40 => 2,
            41 => 1,
            50 => 0,
            75 => maj,
            76 => min,
            81 => 228 << 10,
            82 => 65536,
            83 => 1,
            84 => 0,
            86 => 1,
            88 => 1,
            89 => 1,
            95 => 1,
            97 => 227 << 10,
            102 => 1,
            // POSIX file descriptor handles, and the GPUDirect RDMA flag of cuMemCreate
            // (PyTorch's expandable segments ask for both when these say yes).
            103 => 1,
            106 => 32,
            110 => 1,
            115 => 1,
            116 => 0b1,
            a if (0..=160).contains(&a) => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    }
}
