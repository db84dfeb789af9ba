//! Arrays and mipmapped arrays.

use super::*;

fn desc2(d: &CUDA_ARRAY_DESCRIPTOR) -> ArrayDesc {
    ArrayDesc {
        width: d.Width as u64,
        height: d.Height as u64,
        depth: 0,
        format: d.Format.0,
        channels: d.NumChannels,
        flags: 0,
    }
}

fn desc3(d: &CUDA_ARRAY3D_DESCRIPTOR) -> ArrayDesc {
    ArrayDesc {
        width: d.Width as u64,
        height: d.Height as u64,
        depth: d.Depth as u64,
        format: d.Format.0,
        channels: d.NumChannels,
        flags: d.Flags,
    }
}

exports! {
    cuArrayCreate_v2(h: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) true |s| {
        let d: CUDA_ARRAY_DESCRIPTOR = inp!(desc);
        out_created!(h, hp(s.array_create(desc2(&d))?));
        Ok(())
    }
    cuArray3DCreate_v2(h: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) true |s| {
        let d: CUDA_ARRAY3D_DESCRIPTOR = inp!(desc);
        out_created!(h, hp(s.array_create(desc3(&d))?));
        Ok(())
    }
    cuArrayDestroy(h: CUarray) false |s| { s.array_destroy(hv(h)) }
    cuArrayGetDescriptor_v2(desc: *mut CUDA_ARRAY_DESCRIPTOR, h: CUarray) false |s| {
        let d = s.array_desc(hv(h))?;
        out!(desc, CUDA_ARRAY_DESCRIPTOR {
            Width: d.width as usize,
            Height: d.height as usize,
            Format: vgpu_cuda_abi::CUarray_format(d.format),
            NumChannels: d.channels,
        });
        Ok(())
    }
    cuArray3DGetDescriptor_v2(desc: *mut CUDA_ARRAY3D_DESCRIPTOR, h: CUarray) false |s| {
        let d = s.array_desc(hv(h))?;
        out!(desc, CUDA_ARRAY3D_DESCRIPTOR {
            Width: d.width as usize,
            Height: d.height as usize,
            Depth: d.depth as usize,
            Format: vgpu_cuda_abi::CUarray_format(d.format),
            NumChannels: d.channels,
            Flags: d.flags,
        });
        Ok(())
    }
    cuMipmappedArrayCreate(h: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) true |s| {
        let d: CUDA_ARRAY3D_DESCRIPTOR = inp!(desc);
        out_created!(h, hp(s.mipmap_create(desc3(&d), levels)?));
        Ok(())
    }
    cuMipmappedArrayGetLevel(level_array: *mut CUarray, h: CUmipmappedArray, level: c_uint) false |s| {
        out!(level_array, hp(s.mipmap_level(hv(h), level)?));
        Ok(())
    }
    cuMipmappedArrayDestroy(h: CUmipmappedArray) false |s| { s.mipmap_destroy(hv(h)) }
}
