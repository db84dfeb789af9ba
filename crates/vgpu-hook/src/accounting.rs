//! Pure accounting arithmetic: sizes of arrays, pitched and VMM allocations, and the
//! virtualized memory views. No driver calls, no unsafe; unit tested.

use vgpu_alloc_core::DeviceUsage;
use vgpu_cuda_abi::{
    CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUarray_format, array3d_flags,
};

/// The page in which the driver maps device memory: 2 MiB on every current GPU (the VMM
/// granularity `cuMemGetAllocationGranularity` reports for device memory). Pools grow by
/// whole pages, residuals are charged in them, and it stands in for the granularity when
/// the driver does not say.
pub(crate) const DEVICE_PAGE: u64 = 2 << 20;

/// `bytes` rounded up to a multiple of `align` (a power of two, or 0/1 for none);
/// `None` on overflow.
pub(crate) fn align_up(bytes: u64, align: u64) -> Option<u64> {
    if align <= 1 {
        return Some(bytes);
    }
    bytes.checked_add(align - 1).map(|b| b / align * align)
}

/// Storage of one array element as `(numerator, denominator)` bytes per texel:
/// block-compressed and NV12 formats have fractional sizes.
fn texel_bytes(format: CUarray_format, channels: u32) -> (u64, u64) {
    let ch = u64::from(channels.max(1));
    match format {
        CUarray_format::UNSIGNED_INT8 | CUarray_format::SIGNED_INT8 => (ch, 1),
        CUarray_format::UNSIGNED_INT16 | CUarray_format::SIGNED_INT16 | CUarray_format::HALF => {
            (2 * ch, 1)
        }
        CUarray_format::UNSIGNED_INT32 | CUarray_format::SIGNED_INT32 | CUarray_format::FLOAT => {
            (4 * ch, 1)
        }
        CUarray_format::UNORM_INT8X1 | CUarray_format::SNORM_INT8X1 => (1, 1),
        CUarray_format::UNORM_INT8X2 | CUarray_format::SNORM_INT8X2 => (2, 1),
        CUarray_format::UNORM_INT8X4 | CUarray_format::SNORM_INT8X4 => (4, 1),
        CUarray_format::UNORM_INT16X1 | CUarray_format::SNORM_INT16X1 => (2, 1),
        CUarray_format::UNORM_INT16X2 | CUarray_format::SNORM_INT16X2 => (4, 1),
        CUarray_format::UNORM_INT16X4 | CUarray_format::SNORM_INT16X4 => (8, 1),
        // 4:2:0 — a full-size luma plane plus a half-size chroma plane.
        CUarray_format::NV12 => (3, 2),
        // 8 bytes per 4×4 block.
        CUarray_format::BC1_UNORM
        | CUarray_format::BC1_UNORM_SRGB
        | CUarray_format::BC4_UNORM
        | CUarray_format::BC4_SNORM => (1, 2),
        // 16 bytes per 4×4 block.
        CUarray_format::BC2_UNORM
        | CUarray_format::BC2_UNORM_SRGB
        | CUarray_format::BC3_UNORM
        | CUarray_format::BC3_UNORM_SRGB
        | CUarray_format::BC5_UNORM
        | CUarray_format::BC5_SNORM
        | CUarray_format::BC6H_UF16
        | CUarray_format::BC6H_SF16
        | CUarray_format::BC7_UNORM
        | CUarray_format::BC7_UNORM_SRGB => (1, 1),
        // A format newer than this list: assume the widest texel (4 × 32-bit), so an
        // unknown format is over- rather than under-counted.
        _ => (16, 1),
    }
}

/// Bytes of a 3-D (or layered/cubemap) array with these extents; `None` on overflow.
/// Sparse and deferred-mapping arrays take no memory until mapped (`cuMemCreate` pays).
pub(crate) fn array3d_bytes(d: &CUDA_ARRAY3D_DESCRIPTOR) -> Option<u64> {
    if d.Flags & (array3d_flags::SPARSE | array3d_flags::DEFERRED_MAPPING) != 0 {
        return Some(0);
    }
    let mut depth = d.Depth.max(1) as u64;
    if d.Flags & array3d_flags::CUBEMAP != 0 && d.Flags & array3d_flags::LAYERED == 0 {
        depth = 6; // a cubemap without layers has six faces; layered ones give 6 × layers
    }
    level_bytes(
        d.Width as u64,
        d.Height as u64,
        depth,
        d.Format,
        d.NumChannels,
    )
}

/// Bytes of a 1-D/2-D array (`cuArrayCreate_v2`).
pub(crate) fn array2d_bytes(d: &CUDA_ARRAY_DESCRIPTOR) -> Option<u64> {
    level_bytes(d.Width as u64, d.Height as u64, 1, d.Format, d.NumChannels)
}

fn level_bytes(w: u64, h: u64, depth: u64, format: CUarray_format, channels: u32) -> Option<u64> {
    let (num, den) = texel_bytes(format, channels);
    let texels = w.max(1).checked_mul(h.max(1))?.checked_mul(depth)?;
    Some(texels.checked_mul(num)?.div_ceil(den))
}

/// Bytes of a mipmapped array: every level halves width, height and (unless layered or
/// a cubemap) depth, down to 1.
pub(crate) fn mipmapped_bytes(d: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> Option<u64> {
    let base = array3d_bytes(d)?;
    if base == 0 {
        return Some(0);
    }
    let layered = d.Flags & (array3d_flags::LAYERED | array3d_flags::CUBEMAP) != 0;
    let mut total: u64 = 0;
    for level in 0..levels.clamp(1, 64) {
        let shrink = |x: usize| ((x as u64) >> level).max(1);
        let mut l = *d;
        l.Width = shrink(d.Width) as usize;
        l.Height = if d.Height == 0 {
            0
        } else {
            shrink(d.Height) as usize
        };
        if !layered && d.Depth != 0 {
            l.Depth = shrink(d.Depth) as usize;
        }
        total = total.checked_add(array3d_bytes(&l)?)?;
        if l.Width == 1 && l.Height <= 1 && (layered || l.Depth <= 1) {
            break;
        }
    }
    Some(total)
}

/// `(free, total)` as a program under a limit sees them (`cuMemGetInfo`):
/// total = min(limit, physical total); free = min(limit − container usage, physical free),
/// saturating at 0 when usage exceeds the limit (never an error).
pub(crate) fn virtual_mem_info(phys_free: u64, phys_total: u64, usage: DeviceUsage) -> (u64, u64) {
    match usage.limit {
        None => (phys_free, phys_total),
        Some(limit) => {
            let total = limit.min(phys_total);
            let free = limit.saturating_sub(usage.used).min(phys_free).min(total);
            (free, total)
        }
    }
}

/// NVML's `(total, free, used)` under a limit: the same view as [`virtual_mem_info`], with
/// `used` = the container's accounted usage (capped at the virtual total), so `nvidia-smi`
/// in the container shows its usage against its limit.
pub(crate) fn virtual_nvml_info(
    phys_total: u64,
    phys_free: u64,
    usage: DeviceUsage,
) -> Option<(u64, u64, u64)> {
    usage.limit?;
    let (free, total) = virtual_mem_info(phys_free, phys_total, usage);
    Some((total, free, usage.used.min(total)))
}

/// Context (or other driver-internal) memory measured as the growth of the device's used
/// memory across the call; a shrink (another process freed meanwhile) counts as 0.
pub(crate) fn measured_growth(used_before: u64, used_after: u64) -> u64 {
    used_after.saturating_sub(used_before)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d3(
        w: usize,
        h: usize,
        d: usize,
        f: CUarray_format,
        ch: u32,
        flags: u32,
    ) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            Width: w,
            Height: h,
            Depth: d,
            Format: f,
            NumChannels: ch,
            Flags: flags,
        }
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 2 << 20), Some(0));
        assert_eq!(align_up(1, 2 << 20), Some(2 << 20));
        assert_eq!(align_up(2 << 20, 2 << 20), Some(2 << 20));
        assert_eq!(align_up((2 << 20) + 1, 2 << 20), Some(4 << 20));
        assert_eq!(align_up(u64::MAX - 5, 2 << 20), None);
        assert_eq!(align_up(7, 1), Some(7));
    }

    #[test]
    fn array_sizes_follow_format_channels_and_dimensions() {
        let a = CUDA_ARRAY_DESCRIPTOR {
            Width: 1024,
            Height: 768,
            Format: CUarray_format::FLOAT,
            NumChannels: 4,
        };
        assert_eq!(array2d_bytes(&a), Some(1024 * 768 * 16));
        // 1-D: height 0 counts as 1.
        let a = CUDA_ARRAY_DESCRIPTOR {
            Width: 1000,
            Height: 0,
            Format: CUarray_format::HALF,
            NumChannels: 2,
        };
        assert_eq!(array2d_bytes(&a), Some(4000));
        assert_eq!(
            array3d_bytes(&d3(64, 64, 64, CUarray_format::UNSIGNED_INT8, 1, 0)),
            Some(64 * 64 * 64)
        );
        // Layered: depth is the layer count.
        assert_eq!(
            array3d_bytes(&d3(
                32,
                32,
                10,
                CUarray_format::FLOAT,
                1,
                array3d_flags::LAYERED
            )),
            Some(32 * 32 * 10 * 4)
        );
        // Cubemap: six faces.
        assert_eq!(
            array3d_bytes(&d3(
                16,
                16,
                6,
                CUarray_format::FLOAT,
                1,
                array3d_flags::CUBEMAP
            )),
            Some(16 * 16 * 6 * 4)
        );
        // Block-compressed: BC1 is half a byte per texel, NV12 1.5.
        assert_eq!(
            array3d_bytes(&d3(64, 64, 0, CUarray_format::BC1_UNORM, 4, 0)),
            Some(64 * 64 / 2)
        );
        assert_eq!(
            array3d_bytes(&d3(64, 64, 0, CUarray_format::NV12, 1, 0)),
            Some(64 * 64 * 3 / 2)
        );
        // Unknown formats are over-counted, never zero.
        assert_eq!(
            array3d_bytes(&d3(10, 1, 1, CUarray_format(0x7777), 1, 0)),
            Some(160)
        );
        // Sparse / deferred arrays take nothing until mapped.
        assert_eq!(
            array3d_bytes(&d3(
                1 << 14,
                1 << 14,
                0,
                CUarray_format::FLOAT,
                4,
                array3d_flags::SPARSE
            )),
            Some(0)
        );
        // Overflow is detected.
        assert_eq!(
            array3d_bytes(&d3(usize::MAX, usize::MAX, 2, CUarray_format::FLOAT, 4, 0)),
            None
        );
    }

    #[test]
    fn mipmaps_sum_their_levels() {
        // 8×8 float: 64 + 16 + 4 + 1 texels.
        let d = d3(8, 8, 0, CUarray_format::FLOAT, 1, 0);
        assert_eq!(mipmapped_bytes(&d, 4), Some((64 + 16 + 4 + 1) * 4));
        // Asking for more levels than exist stops at 1×1.
        assert_eq!(mipmapped_bytes(&d, 20), Some((64 + 16 + 4 + 1) * 4));
        // 3-D shrinks depth too; layered does not.
        assert_eq!(
            mipmapped_bytes(&d3(4, 4, 4, CUarray_format::UNSIGNED_INT8, 1, 0), 3),
            Some(64 + 8 + 1)
        );
        assert_eq!(
            mipmapped_bytes(
                &d3(
                    4,
                    4,
                    3,
                    CUarray_format::UNSIGNED_INT8,
                    1,
                    array3d_flags::LAYERED
                ),
                3
            ),
            Some(48 + 12 + 3)
        );
    }

    #[test]
    fn mem_info_view_is_clamped_by_limit_and_physical_free() {
        const G: u64 = 1 << 30;
        let u = |used, limit| DeviceUsage { used, limit };
        assert_eq!(
            virtual_mem_info(70 * G, 80 * G, u(5 * G, None)),
            (70 * G, 80 * G)
        );
        assert_eq!(
            virtual_mem_info(70 * G, 80 * G, u(G, Some(4 * G))),
            (3 * G, 4 * G)
        );
        // Physical free is the tighter bound (other tenants of the GPU).
        assert_eq!(
            virtual_mem_info(G / 2, 80 * G, u(G, Some(4 * G))),
            (G / 2, 4 * G)
        );
        // Usage over the limit: free 0, no error.
        assert_eq!(
            virtual_mem_info(70 * G, 80 * G, u(5 * G, Some(4 * G))),
            (0, 4 * G)
        );
        // Limit above the physical total: total is physical.
        assert_eq!(
            virtual_mem_info(70 * G, 80 * G, u(0, Some(200 * G))),
            (70 * G, 80 * G)
        );
        assert_eq!(
            virtual_nvml_info(80 * G, 70 * G, u(5 * G, Some(4 * G))),
            Some((4 * G, 0, 4 * G))
        );
        assert_eq!(
            virtual_nvml_info(80 * G, 70 * G, u(G, Some(4 * G))),
            Some((4 * G, 3 * G, G))
        );
        assert_eq!(virtual_nvml_info(80 * G, 70 * G, u(G, None)), None);
    }

    #[test]
    fn growth_never_negative() {
        assert_eq!(measured_growth(100, 350), 250);
        assert_eq!(measured_growth(350, 100), 0);
    }
}
