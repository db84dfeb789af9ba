//! `cuGetProcAddress`: base name + requested CUDA version + stream flags → our own function.
//!
//! The pointers are this library's own functions; with `-Bsymbolic` they cannot be
//! interposed, exactly like the real driver's, so a preloaded hook only sees calls through
//! these pointers if it answers `cuGetProcAddress` itself.

use std::collections::HashMap;
use std::sync::OnceLock;

use crate::driver::*;
use crate::nvml::*;

/// One variant of a driver function.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    /// Exported symbol name.
    pub name: &'static str,
    /// Lowest `cudaVersion` that gets it.
    pub min_version: i32,
    /// Its address.
    pub addr: usize,
    /// The per-thread-default-stream twin (`_ptsz`/`_ptds`), if any.
    pub per_thread: Option<(&'static str, usize)>,
}

macro_rules! table {
    ($( $base:literal : $( $ver:literal => $f:ident $(/ $pt:ident)? ),+ ;)*) => {{
        let mut m: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        $( $( m.entry($base).or_default().push(Variant {
            name: stringify!($f),
            min_version: $ver,
            addr: $f as *const () as usize,
            per_thread: None $( .or(Some((stringify!($pt), $pt as *const () as usize))) )?,
        }); )+ )*
        m
    }};
}

/// Base name → variants, oldest first.
pub fn table() -> &'static HashMap<&'static str, Vec<Variant>> {
    static T: OnceLock<HashMap<&'static str, Vec<Variant>>> = OnceLock::new();
    T.get_or_init(|| {
        table! {
            "cuInit": 2000 => cuInit;
            "cuDriverGetVersion": 2020 => cuDriverGetVersion;
            "cuGetErrorName": 6000 => cuGetErrorName;
            "cuGetErrorString": 6000 => cuGetErrorString;
            "cuGetProcAddress": 11030 => cuGetProcAddress, 12000 => cuGetProcAddress_v2;
            "cuGetExportTable": 3000 => cuGetExportTable;
            "cuDeviceGet": 2000 => cuDeviceGet;
            "cuDeviceGetCount": 2000 => cuDeviceGetCount;
            "cuDeviceGetName": 2000 => cuDeviceGetName;
            "cuDeviceGetUuid": 9020 => cuDeviceGetUuid, 11040 => cuDeviceGetUuid_v2;
            "cuDeviceTotalMem": 2000 => cuDeviceTotalMem, 3020 => cuDeviceTotalMem_v2;
            "cuDeviceGetAttribute": 2000 => cuDeviceGetAttribute;
            "cuDeviceComputeCapability": 2000 => cuDeviceComputeCapability;
            "cuDeviceGetPCIBusId": 4010 => cuDeviceGetPCIBusId;
            "cuDeviceGetByPCIBusId": 4010 => cuDeviceGetByPCIBusId;
            "cuDeviceGetDefaultMemPool": 11020 => cuDeviceGetDefaultMemPool;
            "cuDeviceGetMemPool": 11020 => cuDeviceGetMemPool;
            "cuDeviceSetMemPool": 11020 => cuDeviceSetMemPool;
            "cuDeviceGetGraphMemAttribute": 11040 => cuDeviceGetGraphMemAttribute;
            "cuDeviceSetGraphMemAttribute": 11040 => cuDeviceSetGraphMemAttribute;
            "cuDeviceGraphMemTrim": 11040 => cuDeviceGraphMemTrim;
            "cuDevicePrimaryCtxRetain": 7000 => cuDevicePrimaryCtxRetain;
            "cuDevicePrimaryCtxRelease": 7000 => cuDevicePrimaryCtxRelease, 11000 => cuDevicePrimaryCtxRelease_v2;
            "cuDevicePrimaryCtxReset": 7000 => cuDevicePrimaryCtxReset, 11000 => cuDevicePrimaryCtxReset_v2;
            "cuDevicePrimaryCtxSetFlags": 7000 => cuDevicePrimaryCtxSetFlags, 11000 => cuDevicePrimaryCtxSetFlags_v2;
            "cuDevicePrimaryCtxGetState": 7000 => cuDevicePrimaryCtxGetState;
            "cuCtxCreate": 3020 => cuCtxCreate_v2, 11040 => cuCtxCreate_v3, 12050 => cuCtxCreate_v4;
            "cuCtxDestroy": 2000 => cuCtxDestroy, 4000 => cuCtxDestroy_v2;
            "cuCtxGetCurrent": 4000 => cuCtxGetCurrent;
            "cuCtxSetCurrent": 4000 => cuCtxSetCurrent;
            "cuCtxPushCurrent": 4000 => cuCtxPushCurrent_v2;
            "cuCtxPopCurrent": 4000 => cuCtxPopCurrent_v2;
            "cuCtxGetDevice": 2000 => cuCtxGetDevice;
            "cuCtxGetFlags": 7000 => cuCtxGetFlags;
            "cuCtxGetId": 12000 => cuCtxGetId;
            "cuCtxGetApiVersion": 3020 => cuCtxGetApiVersion;
            "cuCtxSynchronize": 2000 => cuCtxSynchronize;
            // CUDA 13's context-argument variants are APIs of their own, not newer versions.
            "cuCtxSynchronize_v2": 13000 => cuCtxSynchronize_v2;
            "cuCtxGetDevice_v2": 13000 => cuCtxGetDevice_v2;
            "cuCtxSetLimit": 3010 => cuCtxSetLimit;
            "cuCtxGetLimit": 3010 => cuCtxGetLimit;
            "cuCtxGetStreamPriorityRange": 5050 => cuCtxGetStreamPriorityRange;
            "cuCtxGetCacheConfig": 3020 => cuCtxGetCacheConfig;
            "cuCtxSetCacheConfig": 3020 => cuCtxSetCacheConfig;
            "cuMemAlloc": 3020 => cuMemAlloc_v2;
            "cuMemAllocPitch": 3020 => cuMemAllocPitch_v2;
            "cuMemAllocManaged": 6000 => cuMemAllocManaged;
            "cuMemFree": 3020 => cuMemFree_v2;
            "cuMemGetInfo": 3020 => cuMemGetInfo_v2;
            "cuMemGetAddressRange": 3020 => cuMemGetAddressRange_v2;
            "cuPointerGetAttribute": 4000 => cuPointerGetAttribute;
            "cuPointerGetAttributes": 7000 => cuPointerGetAttributes;
            "cuMemAllocHost": 3020 => cuMemAllocHost_v2;
            "cuMemHostAlloc": 2020 => cuMemHostAlloc;
            "cuMemFreeHost": 2000 => cuMemFreeHost;
            "cuMemHostGetDevicePointer": 3020 => cuMemHostGetDevicePointer_v2;
            "cuMemHostGetFlags": 2030 => cuMemHostGetFlags;
            "cuMemHostRegister": 6050 => cuMemHostRegister_v2;
            "cuMemHostUnregister": 4000 => cuMemHostUnregister;
            "cuIpcGetMemHandle": 4010 => cuIpcGetMemHandle;
            "cuIpcOpenMemHandle": 11000 => cuIpcOpenMemHandle_v2;
            "cuIpcCloseMemHandle": 4010 => cuIpcCloseMemHandle;
            "cuMemcpy": 4000 => cuMemcpy / cuMemcpy_ptds;
            "cuMemcpyHtoD": 3020 => cuMemcpyHtoD_v2 / cuMemcpyHtoD_v2_ptds;
            "cuMemcpyDtoH": 3020 => cuMemcpyDtoH_v2 / cuMemcpyDtoH_v2_ptds;
            "cuMemcpyDtoD": 3020 => cuMemcpyDtoD_v2 / cuMemcpyDtoD_v2_ptds;
            "cuMemcpyAsync": 4000 => cuMemcpyAsync / cuMemcpyAsync_ptsz;
            "cuMemcpyHtoDAsync": 3020 => cuMemcpyHtoDAsync_v2 / cuMemcpyHtoDAsync_v2_ptsz;
            "cuMemcpyDtoHAsync": 3020 => cuMemcpyDtoHAsync_v2 / cuMemcpyDtoHAsync_v2_ptsz;
            "cuMemcpyDtoDAsync": 3020 => cuMemcpyDtoDAsync_v2 / cuMemcpyDtoDAsync_v2_ptsz;
            "cuMemsetD8": 3020 => cuMemsetD8_v2 / cuMemsetD8_v2_ptds;
            "cuMemsetD16": 3020 => cuMemsetD16_v2 / cuMemsetD16_v2_ptds;
            "cuMemsetD32": 3020 => cuMemsetD32_v2 / cuMemsetD32_v2_ptds;
            "cuMemsetD8Async": 3020 => cuMemsetD8Async / cuMemsetD8Async_ptsz;
            "cuMemsetD32Async": 3020 => cuMemsetD32Async / cuMemsetD32Async_ptsz;
            "cuMemCreate": 10020 => cuMemCreate;
            "cuMemRelease": 10020 => cuMemRelease;
            "cuMemAddressReserve": 10020 => cuMemAddressReserve;
            "cuMemAddressFree": 10020 => cuMemAddressFree;
            "cuMemMap": 10020 => cuMemMap;
            "cuMemUnmap": 10020 => cuMemUnmap;
            "cuMemSetAccess": 10020 => cuMemSetAccess;
            "cuMemGetAccess": 10020 => cuMemGetAccess;
            "cuMemGetAllocationGranularity": 10020 => cuMemGetAllocationGranularity;
            "cuMemGetAllocationPropertiesFromHandle": 10020 => cuMemGetAllocationPropertiesFromHandle;
            "cuMemRetainAllocationHandle": 11000 => cuMemRetainAllocationHandle;
            "cuMemExportToShareableHandle": 10020 => cuMemExportToShareableHandle;
            "cuMemAllocAsync": 11020 => cuMemAllocAsync / cuMemAllocAsync_ptsz;
            "cuMemAllocFromPoolAsync": 11020 => cuMemAllocFromPoolAsync / cuMemAllocFromPoolAsync_ptsz;
            "cuMemFreeAsync": 11020 => cuMemFreeAsync / cuMemFreeAsync_ptsz;
            "cuMemPoolCreate": 11020 => cuMemPoolCreate;
            "cuMemPoolDestroy": 11020 => cuMemPoolDestroy;
            "cuMemPoolTrimTo": 11020 => cuMemPoolTrimTo;
            "cuMemPoolGetAttribute": 11020 => cuMemPoolGetAttribute;
            "cuMemPoolSetAttribute": 11020 => cuMemPoolSetAttribute;
            "cuMemPoolSetAccess": 11020 => cuMemPoolSetAccess;
            "cuArrayCreate": 3020 => cuArrayCreate_v2;
            "cuArray3DCreate": 3020 => cuArray3DCreate_v2;
            "cuArrayDestroy": 2000 => cuArrayDestroy;
            "cuArrayGetDescriptor": 3020 => cuArrayGetDescriptor_v2;
            "cuArray3DGetDescriptor": 3020 => cuArray3DGetDescriptor_v2;
            "cuMipmappedArrayCreate": 5000 => cuMipmappedArrayCreate;
            "cuMipmappedArrayGetLevel": 5000 => cuMipmappedArrayGetLevel;
            "cuMipmappedArrayDestroy": 5000 => cuMipmappedArrayDestroy;
            "cuStreamCreate": 2000 => cuStreamCreate;
            "cuStreamCreateWithPriority": 5050 => cuStreamCreateWithPriority;
            "cuStreamDestroy": 2000 => cuStreamDestroy, 4000 => cuStreamDestroy_v2;
            "cuStreamSynchronize": 2000 => cuStreamSynchronize / cuStreamSynchronize_ptsz;
            "cuStreamQuery": 2000 => cuStreamQuery / cuStreamQuery_ptsz;
            "cuStreamWaitEvent": 3020 => cuStreamWaitEvent / cuStreamWaitEvent_ptsz;
            "cuStreamGetFlags": 5050 => cuStreamGetFlags / cuStreamGetFlags_ptsz;
            "cuStreamGetPriority": 5050 => cuStreamGetPriority / cuStreamGetPriority_ptsz;
            "cuStreamGetCtx": 9020 => cuStreamGetCtx / cuStreamGetCtx_ptsz;
            "cuStreamBeginCapture": 10000 => cuStreamBeginCapture / cuStreamBeginCapture_ptsz,
                10010 => cuStreamBeginCapture_v2 / cuStreamBeginCapture_v2_ptsz;
            "cuStreamEndCapture": 10000 => cuStreamEndCapture / cuStreamEndCapture_ptsz;
            "cuStreamIsCapturing": 10000 => cuStreamIsCapturing / cuStreamIsCapturing_ptsz;
            "cuStreamGetCaptureInfo": 11030 => cuStreamGetCaptureInfo_v2 / cuStreamGetCaptureInfo_v2_ptsz;
            "cuEventCreate": 2000 => cuEventCreate;
            "cuEventDestroy": 2000 => cuEventDestroy, 4000 => cuEventDestroy_v2;
            "cuEventRecord": 2000 => cuEventRecord / cuEventRecord_ptsz;
            "cuEventRecordWithFlags": 11010 => cuEventRecordWithFlags / cuEventRecordWithFlags_ptsz;
            "cuEventSynchronize": 2000 => cuEventSynchronize;
            "cuEventQuery": 2000 => cuEventQuery;
            "cuEventElapsedTime": 2000 => cuEventElapsedTime, 12080 => cuEventElapsedTime_v2;
            "cuModuleLoad": 2000 => cuModuleLoad;
            "cuModuleLoadData": 2000 => cuModuleLoadData;
            "cuModuleLoadDataEx": 2010 => cuModuleLoadDataEx;
            "cuModuleLoadFatBinary": 2000 => cuModuleLoadFatBinary;
            "cuModuleUnload": 2000 => cuModuleUnload;
            "cuModuleGetFunction": 2000 => cuModuleGetFunction;
            "cuLibraryLoadData": 12000 => cuLibraryLoadData;
            "cuLibraryLoadFromFile": 12000 => cuLibraryLoadFromFile;
            "cuLibraryUnload": 12000 => cuLibraryUnload;
            "cuLibraryGetModule": 12000 => cuLibraryGetModule;
            "cuFuncGetAttribute": 2020 => cuFuncGetAttribute;
            "cuFuncSetAttribute": 9000 => cuFuncSetAttribute;
            "cuFuncSetCacheConfig": 3000 => cuFuncSetCacheConfig;
            "cuOccupancyMaxActiveBlocksPerMultiprocessor": 6050 => cuOccupancyMaxActiveBlocksPerMultiprocessor;
            "cuLaunchKernel": 4000 => cuLaunchKernel / cuLaunchKernel_ptsz;
            "cuLaunchKernelEx": 11060 => cuLaunchKernelEx / cuLaunchKernelEx_ptsz;
            "cuLaunchCooperativeKernel": 9000 => cuLaunchCooperativeKernel / cuLaunchCooperativeKernel_ptsz;
            "cuGraphCreate": 10000 => cuGraphCreate;
            "cuGraphDestroy": 10000 => cuGraphDestroy;
            "cuGraphAddKernelNode": 10000 => cuGraphAddKernelNode, 12000 => cuGraphAddKernelNode_v2;
            "cuGraphAddEmptyNode": 10000 => cuGraphAddEmptyNode;
            "cuGraphAddMemAllocNode": 11040 => cuGraphAddMemAllocNode;
            "cuGraphAddMemFreeNode": 11040 => cuGraphAddMemFreeNode;
            "cuGraphGetNodes": 10000 => cuGraphGetNodes;
            "cuGraphInstantiate": 11000 => cuGraphInstantiate_v2, 12000 => cuGraphInstantiateWithFlags;
            "cuGraphInstantiateWithFlags": 11040 => cuGraphInstantiateWithFlags;
            "cuGraphLaunch": 10000 => cuGraphLaunch / cuGraphLaunch_ptsz;
            "cuGraphUpload": 11010 => cuGraphUpload / cuGraphUpload_ptsz;
            "cuGraphExecDestroy": 10000 => cuGraphExecDestroy;
        }
    })
}

/// Status values of `cuGetProcAddress_v2`.
const FOUND: u32 = 0;
const SYMBOL_NOT_FOUND: u32 = 1;
const VERSION_NOT_SUFFICIENT: u32 = 2;

/// Resolves `symbol` for `cuda_version` and `flags`: (address or 0, status).
pub fn lookup(symbol: &str, cuda_version: i32, flags: u64) -> (usize, u32) {
    let Some(vs) = table().get(symbol) else {
        return (0, SYMBOL_NOT_FOUND);
    };
    let Some(v) = vs
        .iter()
        .filter(|v| v.min_version <= cuda_version)
        .max_by_key(|v| v.min_version)
    else {
        return (0, VERSION_NOT_SUFFICIENT);
    };
    let per_thread = flags & 2 != 0;
    match (per_thread, v.per_thread) {
        (true, Some((_, addr))) => (addr, FOUND),
        _ => (v.addr, FOUND),
    }
}

/// Every exported symbol name of the simulated driver and NVML (for tests and docs).
pub fn exported_names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = table()
        .values()
        .flatten()
        .flat_map(|v| std::iter::once(v.name).chain(v.per_thread.map(|p| p.0)))
        .collect();
    v.extend(NVML_EXPORTS);
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cuda_abi::{
        CUDA_HOOKED_SYMBOLS, CUDA_USED_SYMBOLS, NVML_HOOKED_SYMBOLS, NVML_USED_SYMBOLS,
    };

    #[test]
    fn versions_and_stream_flags_pick_variants() {
        let name = |s: &str, v: i32, f: u64| {
            let (a, st) = lookup(s, v, f);
            (
                table().values().flatten().find_map(|x| {
                    if x.addr == a {
                        Some(x.name)
                    } else {
                        x.per_thread.filter(|p| p.1 == a).map(|p| p.0)
                    }
                }),
                st,
            )
        };
        assert_eq!(name("cuMemAlloc", 12000, 0), (Some("cuMemAlloc_v2"), 0));
        assert_eq!(name("cuCtxCreate", 11040, 0), (Some("cuCtxCreate_v3"), 0));
        assert_eq!(name("cuCtxCreate", 13000, 0), (Some("cuCtxCreate_v4"), 0));
        assert_eq!(
            name("cuLaunchKernel", 12000, 2),
            (Some("cuLaunchKernel_ptsz"), 0)
        );
        assert_eq!(
            name("cuLaunchKernel", 12000, 1),
            (Some("cuLaunchKernel"), 0)
        );
        assert_eq!(
            name("cuMemcpyHtoD", 12000, 2),
            (Some("cuMemcpyHtoD_v2_ptds"), 0)
        );
        assert_eq!(lookup("cuMemAlloc", 3000, 0), (0, VERSION_NOT_SUFFICIENT));
        assert_eq!(lookup("cuMemAlloc_v2", 12000, 0), (0, SYMBOL_NOT_FOUND));
    }

    #[test]
    fn every_symbol_the_hook_uses_is_implemented_with_the_same_variant_choice() {
        let names = exported_names();
        for s in CUDA_HOOKED_SYMBOLS
            .iter()
            .chain(CUDA_USED_SYMBOLS)
            .chain(NVML_HOOKED_SYMBOLS)
            .chain(NVML_USED_SYMBOLS)
        {
            assert!(names.contains(&s.name), "the simulator lacks {}", s.name);
        }
        for s in CUDA_HOOKED_SYMBOLS.iter().chain(CUDA_USED_SYMBOLS) {
            let flags = if s.stream == vgpu_cuda_abi::StreamKind::PerThread {
                2
            } else {
                0
            };
            let ours = lookup(s.base, s.min_version, flags).0;
            let want = table()
                .values()
                .flatten()
                .find_map(|v| {
                    if v.name == s.name {
                        Some(v.addr)
                    } else {
                        v.per_thread.filter(|p| p.0 == s.name).map(|p| p.1)
                    }
                })
                .unwrap_or_else(|| panic!("{} not in the proc-address table", s.name));
            assert_eq!(
                ours, want,
                "cuGetProcAddress({}, {}) disagrees with the hook's list",
                s.base, s.min_version
            );
        }
    }
}
