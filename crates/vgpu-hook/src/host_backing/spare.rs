//! Pinned host memory kept for one allocation's next swap-out (`VGPU_SWAP_KEEP_HOST`,
//! docs/swap.md "Host memory"): what a swap-in emptied, or what was pinned ahead of an idle
//! swap-out.
//!
//! Invariant: the slot's `kept_host` word (`vgpu status`, `watch`, the exporter) is the sum of
//! the sizes of every [`Spare`] that holds memory, since every change of one goes through
//! here with the ledger: kept raises it; taken (a swap-out fills it: its bytes are then the
//! host class) or given back lowers it. A swap-out charges the host class before it takes the
//! spare, so for that moment both count the memory, and never neither.

use vgpu_alloc_core::{DeviceIndex, OutOfMemory};
use vgpu_cuda_abi::{CUmemGenericAllocationHandle, CUresult};

use super::create_on_host;
use crate::driver;
use crate::ledger::SharedLedger;
use crate::real::Cuda;

/// The kept memory of one allocation of `size` bytes (always exactly its allocation's size:
/// a swap-out maps it in the allocation's place), if any.
#[derive(Debug, Default)]
pub(crate) struct Spare(Option<CUmemGenericAllocationHandle>);

impl Spare {
    /// Whether none is kept.
    pub(crate) fn is_none(&self) -> bool {
        self.0.is_none()
    }

    /// Keeps `h` (`size` bytes), said in the slot. One is kept at a time: the callers keep
    /// only where none is, and one already there would be given back rather than lost.
    pub(crate) fn keep(
        &mut self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        h: CUmemGenericAllocationHandle,
        size: u64,
    ) {
        self.release(cuda, ledger, size);
        self.0 = Some(h);
        ledger.slot().add_kept_host(size);
    }

    /// Takes it for a swap-out to fill (it is no longer kept, whatever the swap-out does with
    /// it: a failed one releases it).
    pub(crate) fn take(
        &mut self,
        ledger: &SharedLedger,
        size: u64,
    ) -> Option<CUmemGenericAllocationHandle> {
        let h = self.0.take()?;
        ledger.slot().remove_kept_host(size);
        Some(h)
    }

    /// The host memory a swap-out of `size` bytes on `device` fills: the host class charged
    /// first, then this spare taken or fresh memory pinned. On failure nothing stays charged;
    /// on success the caller releases the charge (`release_host`) if a later step fails.
    pub(crate) fn host_for_move_out(
        &mut self,
        cuda: &Cuda,
        ledger: &SharedLedger,
        device: DeviceIndex,
        size: u64,
    ) -> Result<CUmemGenericAllocationHandle, CUresult> {
        ledger
            .reserve_swap_out(device, size)
            .map_err(|_: OutOfMemory| CUresult::OUT_OF_MEMORY)?;
        self.take(ledger, size)
            .map_or_else(|| create_on_host(cuda, size, 0, &|| false), Ok)
            .inspect_err(|_| ledger.release_host(device, size))
    }

    /// Gives it back to the driver: the bytes given back (0 if none was kept).
    pub(crate) fn release(&mut self, cuda: &Cuda, ledger: &SharedLedger, size: u64) -> u64 {
        match self.take(ledger, size) {
            Some(h) => {
                let _ = driver::mem_release(cuda, h);
                size
            }
            None => 0,
        }
    }
}
