//! `cuGetProcAddress`: base name + requested CUDA version + stream flags → our own function.
//!
//! The pointers are this library's own functions; with `-Bsymbolic` they cannot be
//! interposed, exactly like the real driver's, so a preloaded hook only sees calls through
//! these pointers if it answers `cuGetProcAddress` itself.
//!
//! A child of `driver` because its table holds the driver's functions and the driver's
//! `cuGetProcAddress` answers from it; safe Rust, unlike its parent.

#![deny(unsafe_code)]

use std::collections::HashMap;
use std::sync::OnceLock;

use super::*;
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

/// `(name, address)` of the first function named: `function!($($f)? $base)` is `$f`'s where
/// given, else `$base`'s.
macro_rules! function {
    ($f:ident $($otherwise:ident)?) => {
        (stringify!($f), $f as *const () as usize)
    };
}

/// A row is `base: variant, ...;` and a variant `min_version [=> function] [/ per-thread twin]`;
/// without `=> function` the exported function is named like the base.
macro_rules! table {
    ($( $base:ident : $( $ver:literal $(=> $f:ident)? $(/ $pt:ident)? ),+ ;)*) => {{
        let mut m: HashMap<&'static str, Vec<Variant>> = HashMap::new();
        $( $( {
            let (name, addr) = function!($($f)? $base);
            m.entry(stringify!($base)).or_default().push(Variant {
                name,
                min_version: $ver,
                addr,
                per_thread: None $( .or(Some(function!($pt))) )?,
            });
        } )+ )*
        m
    }};
}

/// Base name → variants, oldest first.
pub fn table() -> &'static HashMap<&'static str, Vec<Variant>> {
    static T: OnceLock<HashMap<&'static str, Vec<Variant>>> = OnceLock::new();
    T.get_or_init(|| {
        table! {
            cuInit: 2000;
            cuDriverGetVersion: 2020;
            cuGetErrorName: 6000;
            cuGetErrorString: 6000;
            cuGetProcAddress: 11030, 12000 => cuGetProcAddress_v2;
            cuGetExportTable: 3000;
            cuDeviceGet: 2000;
            cuDeviceGetCount: 2000;
            cuDeviceGetName: 2000;
            cuDeviceGetUuid: 9020, 11040 => cuDeviceGetUuid_v2;
            cuDeviceTotalMem: 2000, 3020 => cuDeviceTotalMem_v2;
            cuDeviceGetAttribute: 2000;
            cuDeviceComputeCapability: 2000;
            cuDeviceGetPCIBusId: 4010;
            cuDeviceGetByPCIBusId: 4010;
            cuDeviceGetDefaultMemPool: 11020;
            cuDeviceGetMemPool: 11020;
            cuDeviceSetMemPool: 11020;
            cuDeviceGetGraphMemAttribute: 11040;
            cuDeviceSetGraphMemAttribute: 11040;
            cuDeviceGraphMemTrim: 11040;
            cuDevicePrimaryCtxRetain: 7000;
            cuDevicePrimaryCtxRelease: 7000, 11000 => cuDevicePrimaryCtxRelease_v2;
            cuDevicePrimaryCtxReset: 7000, 11000 => cuDevicePrimaryCtxReset_v2;
            cuDevicePrimaryCtxSetFlags: 7000, 11000 => cuDevicePrimaryCtxSetFlags_v2;
            cuDevicePrimaryCtxGetState: 7000;
            cuCtxCreate: 3020 => cuCtxCreate_v2, 11040 => cuCtxCreate_v3, 12050 => cuCtxCreate_v4;
            cuCtxDestroy: 2000, 4000 => cuCtxDestroy_v2;
            cuCtxGetCurrent: 4000;
            cuCtxSetCurrent: 4000;
            cuCtxPushCurrent: 4000 => cuCtxPushCurrent_v2;
            cuCtxPopCurrent: 4000 => cuCtxPopCurrent_v2;
            cuCtxGetDevice: 2000;
            cuCtxGetFlags: 7000;
            cuCtxGetId: 12000;
            cuCtxGetApiVersion: 3020;
            cuCtxSynchronize: 2000;
            // CUDA 13's context-argument variants are APIs of their own, not newer versions.
            cuCtxSynchronize_v2: 13000;
            cuCtxGetDevice_v2: 13000;
            cuCtxSetLimit: 3010;
            cuCtxGetLimit: 3010;
            cuCtxGetStreamPriorityRange: 5050;
            cuCtxGetCacheConfig: 3020;
            cuCtxSetCacheConfig: 3020;
            cuMemAlloc: 3020 => cuMemAlloc_v2;
            cuMemAllocPitch: 3020 => cuMemAllocPitch_v2;
            cuMemAllocManaged: 6000;
            cuMemFree: 3020 => cuMemFree_v2;
            cuMemGetInfo: 3020 => cuMemGetInfo_v2;
            cuMemGetAddressRange: 3020 => cuMemGetAddressRange_v2;
            cuPointerGetAttribute: 4000;
            cuPointerGetAttributes: 7000;
            cuMemAllocHost: 3020 => cuMemAllocHost_v2;
            cuMemHostAlloc: 2020;
            cuMemFreeHost: 2000;
            cuMemHostGetDevicePointer: 3020 => cuMemHostGetDevicePointer_v2;
            cuMemHostGetFlags: 2030;
            cuMemHostRegister: 6050 => cuMemHostRegister_v2;
            cuMemHostUnregister: 4000;
            cuIpcGetMemHandle: 4010;
            cuIpcOpenMemHandle: 11000 => cuIpcOpenMemHandle_v2;
            cuIpcCloseMemHandle: 4010;
            cuMemcpy: 4000 / cuMemcpy_ptds;
            cuMemcpyHtoD: 3020 => cuMemcpyHtoD_v2 / cuMemcpyHtoD_v2_ptds;
            cuMemcpyDtoH: 3020 => cuMemcpyDtoH_v2 / cuMemcpyDtoH_v2_ptds;
            cuMemcpyDtoD: 3020 => cuMemcpyDtoD_v2 / cuMemcpyDtoD_v2_ptds;
            cuMemcpyAsync: 4000 / cuMemcpyAsync_ptsz;
            cuMemcpyHtoDAsync: 3020 => cuMemcpyHtoDAsync_v2 / cuMemcpyHtoDAsync_v2_ptsz;
            cuMemcpyDtoHAsync: 3020 => cuMemcpyDtoHAsync_v2 / cuMemcpyDtoHAsync_v2_ptsz;
            cuMemcpyDtoDAsync: 3020 => cuMemcpyDtoDAsync_v2 / cuMemcpyDtoDAsync_v2_ptsz;
            cuMemsetD8: 3020 => cuMemsetD8_v2 / cuMemsetD8_v2_ptds;
            cuMemsetD16: 3020 => cuMemsetD16_v2 / cuMemsetD16_v2_ptds;
            cuMemsetD32: 3020 => cuMemsetD32_v2 / cuMemsetD32_v2_ptds;
            cuMemsetD8Async: 3020 / cuMemsetD8Async_ptsz;
            cuMemsetD16Async: 3020 / cuMemsetD16Async_ptsz;
            cuMemsetD32Async: 3020 / cuMemsetD32Async_ptsz;
            cuMemCreate: 10020;
            cuMemRelease: 10020;
            cuMemAddressReserve: 10020;
            cuMemAddressFree: 10020;
            cuMemMap: 10020;
            cuMemUnmap: 10020;
            cuMemSetAccess: 10020;
            cuMemGetAccess: 10020;
            cuMemGetAllocationGranularity: 10020;
            cuMemGetAllocationPropertiesFromHandle: 10020;
            cuMemRetainAllocationHandle: 11000;
            cuMemExportToShareableHandle: 10020;
            cuMemImportFromShareableHandle: 10020;
            cuMulticastBindMem: 12010;
            cuMemAllocAsync: 11020 / cuMemAllocAsync_ptsz;
            cuMemAllocFromPoolAsync: 11020 / cuMemAllocFromPoolAsync_ptsz;
            cuMemFreeAsync: 11020 / cuMemFreeAsync_ptsz;
            cuMemPoolCreate: 11020;
            cuMemPoolDestroy: 11020;
            cuMemPoolTrimTo: 11020;
            cuMemPoolGetAttribute: 11020;
            cuMemPoolSetAttribute: 11020;
            cuMemPoolSetAccess: 11020;
            cuArrayCreate: 3020 => cuArrayCreate_v2;
            cuArray3DCreate: 3020 => cuArray3DCreate_v2;
            cuArrayDestroy: 2000;
            cuArrayGetDescriptor: 3020 => cuArrayGetDescriptor_v2;
            cuArray3DGetDescriptor: 3020 => cuArray3DGetDescriptor_v2;
            cuMipmappedArrayCreate: 5000;
            cuMipmappedArrayGetLevel: 5000;
            cuMipmappedArrayDestroy: 5000;
            cuStreamCreate: 2000;
            cuStreamCreateWithPriority: 5050;
            cuStreamDestroy: 2000, 4000 => cuStreamDestroy_v2;
            cuStreamSynchronize: 2000 / cuStreamSynchronize_ptsz;
            cuStreamQuery: 2000 / cuStreamQuery_ptsz;
            cuStreamWaitEvent: 3020 / cuStreamWaitEvent_ptsz;
            cuStreamWaitValue32: 12000 => cuStreamWaitValue32_v2 / cuStreamWaitValue32_v2_ptsz;
            cuStreamGetFlags: 5050 / cuStreamGetFlags_ptsz;
            cuStreamGetPriority: 5050 / cuStreamGetPriority_ptsz;
            cuStreamGetCtx: 9020 / cuStreamGetCtx_ptsz;
            cuStreamBeginCapture: 10000 / cuStreamBeginCapture_ptsz,
                10010 => cuStreamBeginCapture_v2 / cuStreamBeginCapture_v2_ptsz;
            cuStreamEndCapture: 10000 / cuStreamEndCapture_ptsz;
            cuStreamIsCapturing: 10000 / cuStreamIsCapturing_ptsz;
            cuStreamGetCaptureInfo: 11030 => cuStreamGetCaptureInfo_v2 / cuStreamGetCaptureInfo_v2_ptsz;
            cuEventCreate: 2000;
            cuEventDestroy: 2000, 4000 => cuEventDestroy_v2;
            cuEventRecord: 2000 / cuEventRecord_ptsz;
            cuEventRecordWithFlags: 11010 / cuEventRecordWithFlags_ptsz;
            cuEventSynchronize: 2000;
            cuEventQuery: 2000;
            cuEventElapsedTime: 2000, 12080 => cuEventElapsedTime_v2;
            cuModuleLoad: 2000;
            cuModuleLoadData: 2000;
            cuModuleLoadDataEx: 2010;
            cuModuleLoadFatBinary: 2000;
            cuModuleUnload: 2000;
            cuModuleGetFunction: 2000;
            cuLibraryLoadData: 12000;
            cuLibraryLoadFromFile: 12000;
            cuLibraryUnload: 12000;
            cuLibraryGetModule: 12000;
            cuFuncGetAttribute: 2020;
            cuFuncSetAttribute: 9000;
            cuFuncSetCacheConfig: 3000;
            cuOccupancyMaxActiveBlocksPerMultiprocessor: 6050;
            cuLaunchKernel: 4000 / cuLaunchKernel_ptsz;
            cuLaunchKernelEx: 11060 / cuLaunchKernelEx_ptsz;
            cuLaunchCooperativeKernel: 9000 / cuLaunchCooperativeKernel_ptsz;
            cuGraphCreate: 10000;
            cuGraphDestroy: 10000;
            cuGraphAddKernelNode: 10000, 12000 => cuGraphAddKernelNode_v2;
            cuGraphAddEmptyNode: 10000;
            cuGraphAddMemAllocNode: 11040;
            cuGraphAddMemFreeNode: 11040;
            cuGraphGetNodes: 10000;
            cuGraphInstantiate: 11000 => cuGraphInstantiate_v2, 12000 => cuGraphInstantiateWithFlags;
            cuGraphInstantiateWithFlags: 11040;
            cuGraphLaunch: 10000 / cuGraphLaunch_ptsz;
            cuGraphUpload: 11010 / cuGraphUpload_ptsz;
            cuGraphExecDestroy: 10000;
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
