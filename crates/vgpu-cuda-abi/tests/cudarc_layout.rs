//! Our hand-written driver declarations against cudarc's bindgen output of the CUDA 13.0
//! headers: sizes, alignments, field offsets and the constants we name.

use std::mem::{align_of, offset_of, size_of};

use cudarc::driver::sys as c;
use vgpu_cuda_abi as v;

macro_rules! same_layout {
    ($ours:ty, $theirs:ty $(, $f:ident => $g:ident)*) => {{
        assert_eq!(size_of::<$ours>(), size_of::<$theirs>(), "size of {}", stringify!($ours));
        assert_eq!(align_of::<$ours>(), align_of::<$theirs>(), "align of {}", stringify!($ours));
        $(assert_eq!(
            offset_of!($ours, $f),
            offset_of!($theirs, $g),
            "offset of {}.{}",
            stringify!($ours),
            stringify!($f)
        );)*
    }};
}

#[test]
fn structs_match_the_cuda_headers() {
    same_layout!(v::CUresult, c::CUresult);
    same_layout!(v::CUdevice, c::CUdevice);
    same_layout!(v::CUdeviceptr, c::CUdeviceptr);
    same_layout!(
        v::CUmemGenericAllocationHandle,
        c::CUmemGenericAllocationHandle
    );
    same_layout!(v::CUuuid, c::CUuuid, bytes => bytes);
    same_layout!(v::CUipcMemHandle, c::CUipcMemHandle, reserved => reserved);
    same_layout!(v::CUDA_ARRAY_DESCRIPTOR, c::CUDA_ARRAY_DESCRIPTOR,
        Width => Width, Height => Height, Format => Format, NumChannels => NumChannels);
    same_layout!(v::CUDA_ARRAY3D_DESCRIPTOR, c::CUDA_ARRAY3D_DESCRIPTOR,
        Width => Width, Height => Height, Depth => Depth, Format => Format, NumChannels => NumChannels,
        Flags => Flags);
    same_layout!(v::CUmemLocation, c::CUmemLocation, type_ => type_, id => id);
    same_layout!(v::CUmemAllocationProp, c::CUmemAllocationProp,
        type_ => type_, requestedHandleTypes => requestedHandleTypes, location => location,
        win32HandleMetaData => win32HandleMetaData, allocFlags => allocFlags);
    same_layout!(v::CUmemPoolProps, c::CUmemPoolProps,
        allocType => allocType, handleTypes => handleTypes, location => location,
        win32SecurityAttributes => win32SecurityAttributes, maxSize => maxSize, usage => usage,
        reserved => reserved);
    same_layout!(v::CUmemAccessDesc, c::CUmemAccessDesc, location => location, flags => flags);
    same_layout!(v::CUDA_MEM_ALLOC_NODE_PARAMS, c::CUDA_MEM_ALLOC_NODE_PARAMS,
        poolProps => poolProps, accessDescs => accessDescs, accessDescCount => accessDescCount,
        bytesize => bytesize, dptr => dptr);
    same_layout!(v::CUlaunchAttribute, c::CUlaunchAttribute, id => id);
    same_layout!(v::CUlaunchConfig, c::CUlaunchConfig,
        gridDimX => gridDimX, blockDimZ => blockDimZ, sharedMemBytes => sharedMemBytes,
        hStream => hStream, attrs => attrs, numAttrs => numAttrs);
    same_layout!(v::CUDA_KERNEL_NODE_PARAMS_v1, c::CUDA_KERNEL_NODE_PARAMS_v1,
        func => func, gridDimX => gridDimX, gridDimZ => gridDimZ, blockDimX => blockDimX,
        blockDimZ => blockDimZ, sharedMemBytes => sharedMemBytes, kernelParams => kernelParams,
        extra => extra);
}

#[test]
fn named_codes_match_the_cuda_headers() {
    use c::cudaError_enum as E;
    for (ours, theirs) in [
        (v::CUresult::SUCCESS, E::CUDA_SUCCESS),
        (v::CUresult::INVALID_VALUE, E::CUDA_ERROR_INVALID_VALUE),
        (v::CUresult::OUT_OF_MEMORY, E::CUDA_ERROR_OUT_OF_MEMORY),
        (v::CUresult::NOT_INITIALIZED, E::CUDA_ERROR_NOT_INITIALIZED),
        (v::CUresult::DEINITIALIZED, E::CUDA_ERROR_DEINITIALIZED),
        (v::CUresult::STUB_LIBRARY, E::CUDA_ERROR_STUB_LIBRARY),
        (v::CUresult::NO_DEVICE, E::CUDA_ERROR_NO_DEVICE),
        (v::CUresult::INVALID_DEVICE, E::CUDA_ERROR_INVALID_DEVICE),
        (v::CUresult::INVALID_CONTEXT, E::CUDA_ERROR_INVALID_CONTEXT),
        (v::CUresult::INVALID_HANDLE, E::CUDA_ERROR_INVALID_HANDLE),
        (v::CUresult::ILLEGAL_STATE, E::CUDA_ERROR_ILLEGAL_STATE),
        (v::CUresult::NOT_FOUND, E::CUDA_ERROR_NOT_FOUND),
        (v::CUresult::NOT_READY, E::CUDA_ERROR_NOT_READY),
        (v::CUresult::NOT_PERMITTED, E::CUDA_ERROR_NOT_PERMITTED),
        (v::CUresult::NOT_SUPPORTED, E::CUDA_ERROR_NOT_SUPPORTED),
        (
            v::CUresult::STREAM_CAPTURE_UNSUPPORTED,
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        ),
        (v::CUresult::UNKNOWN, E::CUDA_ERROR_UNKNOWN),
    ] {
        assert_eq!(ours.0, theirs as u32, "{ours:?}");
    }
    assert_eq!(
        v::CUpointer_attribute::RANGE_START_ADDR.0,
        c::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR as u32
    );
    assert_eq!(
        v::CUpointer_attribute::RANGE_SIZE.0,
        c::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE as u32
    );
    assert_eq!(
        v::CUpointer_attribute::DEVICE_ORDINAL.0,
        c::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as u32
    );
    assert_eq!(
        v::CUmemPool_attribute::RESERVED_MEM_CURRENT.0,
        c::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as u32
    );
    assert_eq!(
        v::CUmemPool_attribute::USED_MEM_CURRENT.0,
        c::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT as u32
    );
    assert_eq!(
        v::CUgraphMem_attribute::RESERVED_MEM_CURRENT.0,
        c::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT as u32
    );
    assert_eq!(
        v::CUmemLocationType::DEVICE.0,
        c::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32
    );
    assert_eq!(
        v::CUarray_format::FLOAT.0,
        c::CUarray_format::CU_AD_FORMAT_FLOAT as u32
    );
    assert_eq!(
        v::CUarray_format::NV12.0,
        c::CUarray_format::CU_AD_FORMAT_NV12 as u32
    );
    assert_eq!(
        v::CUarray_format::BC7_UNORM_SRGB.0,
        c::CUarray_format::CU_AD_FORMAT_BC7_UNORM_SRGB as u32
    );
    assert_eq!(
        v::CUarray_format::SNORM_INT16X4.0,
        c::CUarray_format::CU_AD_FORMAT_SNORM_INT16X4 as u32
    );
    assert_eq!(
        v::proc_address_flags::PER_THREAD_DEFAULT_STREAM,
        c::CUdriverProcAddress_flags::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM as u64
    );
    assert_eq!(v::array3d_flags::CUBEMAP, c::CUDA_ARRAY3D_CUBEMAP);
    assert_eq!(v::array3d_flags::LAYERED, c::CUDA_ARRAY3D_LAYERED);
    assert_eq!(v::array3d_flags::SPARSE, c::CUDA_ARRAY3D_SPARSE);
    assert_eq!(
        v::array3d_flags::DEFERRED_MAPPING,
        c::CUDA_ARRAY3D_DEFERRED_MAPPING
    );
}
