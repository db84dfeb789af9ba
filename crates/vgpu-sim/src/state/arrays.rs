//! Arrays and mipmapped arrays.

use super::*;

/// An array's descriptor (the 3D form; 1D/2D arrays have zero height/depth).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArrayDesc {
    /// Width in elements.
    pub width: u64,
    /// Height (0 for 1D).
    pub height: u64,
    /// Depth (0 for 1D/2D).
    pub depth: u64,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels: 1, 2 or 4.
    pub channels: u32,
    /// `CUDA_ARRAY3D_*` flags.
    pub flags: u32,
}

impl ArrayDesc {
    pub(super) fn elem_bytes(&self) -> CuResult<u64> {
        let per = match self.format {
            0x01 | 0x08 => 1,
            0x02 | 0x09 | 0x10 => 2,
            0x03 | 0x0a | 0x20 => 4,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        if !matches!(self.channels, 1 | 2 | 4) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(per * self.channels as u64)
    }

    /// Bytes this array occupies on the simulated device.
    pub fn bytes(&self) -> CuResult<u64> {
        let layered = self.flags & 0x1 != 0;
        if self.width == 0 || (self.height == 0 && self.depth != 0 && !layered) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let b = self
            .width
            .checked_mul(self.height.max(1))
            .and_then(|v| v.checked_mul(self.depth.max(1)))
            .and_then(|v| v.checked_mul(self.elem_bytes().ok()?))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        round_up(b, ALLOC_ALIGN).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    pub(super) fn level(&self, l: u32) -> ArrayDesc {
        let shrink = |v: u64| if v == 0 { 0 } else { (v >> l).max(1) };
        ArrayDesc {
            width: shrink(self.width),
            height: shrink(self.height),
            depth: shrink(self.depth),
            ..*self
        }
    }
}

impl Sim {
    /// `cuArrayCreate_v2` / `cuArray3DCreate_v2`.
    pub fn array_create(&self, desc: ArrayDesc) -> CuResult<u64> {
        let bytes = desc.bytes()?;
        self.add_array(tag::ARRAY, desc, 1, bytes)
    }

    /// `cuArrayDestroy`.
    pub fn array_destroy(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::ARRAY, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        if st.arrays.get(&id).is_none_or(|a| a.parent.is_some()) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let a = st.arrays.remove(&id).expect("present");
        self.devices[a.dev].release(a.bytes);
        Ok(())
    }

    /// `cuArray3DGetDescriptor_v2`.
    pub fn array_desc(&self, h: u64) -> CuResult<ArrayDesc> {
        self.read_handle(
            (tag::ARRAY, h, CUDA_ERROR_INVALID_HANDLE),
            |st| &st.arrays,
            |a| a.desc,
        )
    }

    /// `cuMipmappedArrayCreate`.
    pub fn mipmap_create(&self, desc: ArrayDesc, levels: u32) -> CuResult<u64> {
        let max_dim = desc.width.max(desc.height).max(desc.depth).max(1);
        let max_levels = 64 - max_dim.leading_zeros();
        if levels == 0 || levels > max_levels {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut bytes = 0u64;
        for l in 0..levels {
            bytes = bytes
                .checked_add(desc.level(l).bytes()?)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
        self.add_array(tag::MIPMAP, desc, levels, bytes)
    }

    /// Charges `bytes` to the current device and registers a top-level array (or mipmapped
    /// array, by `t`) of `levels` levels.
    fn add_array(&self, t: u64, desc: ArrayDesc, levels: u32, bytes: u64) -> CuResult<u64> {
        let (ctx, dev) = self.cur_dev()?;
        self.devices[dev].reserve(bytes)?;
        let array = Array {
            dev,
            ctx,
            bytes,
            desc,
            levels,
            parent: None,
        };
        Ok(self.new_handle(t, |st| &mut st.arrays, array))
    }

    /// `cuMipmappedArrayGetLevel`.
    pub fn mipmap_level(&self, h: u64, level: u32) -> CuResult<u64> {
        let id = unhandle(tag::MIPMAP, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let a = st.arrays.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if level >= a.levels {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dev, ctx, desc) = (a.dev, a.ctx, a.desc.level(level));
        let lid = st.id();
        st.arrays.insert(
            lid,
            Array {
                dev,
                ctx,
                bytes: 0,
                desc,
                levels: 1,
                parent: Some(id),
            },
        );
        Ok(handle(tag::ARRAY, lid))
    }

    /// `cuMipmappedArrayDestroy`.
    pub fn mipmap_destroy(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::MIPMAP, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let a = st.arrays.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.arrays.retain(|_, l| l.parent != Some(id));
        self.devices[a.dev].release(a.bytes);
        Ok(())
    }
}
