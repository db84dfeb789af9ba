//! THE declaration list of hooked symbols.
//!
//! Each list macro takes the name of a *callback* macro and invokes it once with every entry:
//!
//! ```text
//! name [ "base name", min_cuda_version, stream_kind ] fn(arg: Type, ...) -> Ret;
//! ```
//!
//! - `name`: the exported symbol (`cuMemAlloc_v2`, `cuLaunchKernel_ptsz`).
//! - `"base name"`: what programs pass to `cuGetProcAddress` (`"cuMemAlloc"`).
//! - `min_cuda_version`: the lowest `cudaVersion` argument for which `cuGetProcAddress`
//!   returns this variant (the driver picks the newest variant not newer than the request).
//! - `stream_kind`: `any` (no default-stream distinction), `legacy` (the legacy-stream variant
//!   of a function that has a per-thread one) or `ptsz` (the per-thread-default-stream variant,
//!   chosen by `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`).
//!
//! An entry's bracket may end in a *gate* (docs/swap.md): `touches` (the call can touch
//! device memory: it runs, copies, sets or orders work on a device, or waits for it; a
//! process whose memory is swapped out brings it back first, and no memory moves while the
//! call runs) or `ends_context` (the call ends a context, named by its one argument: it waits
//! while a swap-out synchronizes that context or a swap operation moves memory, and brings
//! nothing back). [`TOUCHING_FAMILIES`] says which names must have
//! `touches`, from the driver's headers; a test holds the list to it.
//!
//! Types are written unqualified: the callback's expansion site needs `use vgpu_cuda_abi::*;`.
//! The same lists drive the hook's exports, its real-function table, its `dlsym` and
//! `cuGetProcAddress` tables, and [`CUDA_HOOKED_SYMBOLS`] / [`NVML_HOOKED_SYMBOLS`] here.
//!
//! ## Hook shapes
//!
//! A hooked entry may end in `=> shape`, which says how the hook's generated export reaches
//! its implementation (functions of that name in the hook's `hooks` module):
//!
//! - `then f(args)`: forward the call unchanged to the real function; if it succeeds, run
//!   `f(driver, args)`, whose result is the call's.
//! - `finally f(args)`: forward, run `f(driver, args)` whatever the driver answered, return
//!   the driver's answer.
//! - `twin y(args)`: the per-thread-default-stream (`_ptsz`) twin of the hand-written `y`,
//!   called with `StreamKind::PerThread` and this symbol's own real function.
//! - `pass`: forward the call unchanged, nothing else (an entry hooked only for its gate).
//! - `body(args)`: a hand-written implementation of the same name, given the forward and
//!   only these arguments; `body f(args)`: the hand-written `f`, shared by several symbols.
//!
//! No shape: a hand-written implementation given the forward and every argument (for a
//! `legacy` entry, and `body`/`twin`, also the `StreamKind`). A callback invoked as
//! `cuda_hooked_functions!(with_shapes callback)` sees the shapes; a plain
//! `cuda_hooked_functions!(callback)` sees entries without them.

/// Every driver API symbol `libvgpu.so` intercepts, with its exact C signature.
#[macro_export]
macro_rules! cuda_hooked_functions {
    ($($callback:ident)+) => {
        $crate::__shapes! { [$($callback)+]
            cuInit ["cuInit", 2000, any] fn(flags: c_uint) -> CUresult => then initialized();
            cuGetProcAddress ["cuGetProcAddress", 11030, any]
                fn(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: cuuint64_t) -> CUresult
                => then proc_address_found(symbol, pfn, cuda_version, flags);
            cuGetProcAddress_v2 ["cuGetProcAddress", 12000, any]
                fn(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: cuuint64_t,
                   symbol_status: *mut CUdriverProcAddressQueryResult) -> CUresult
                => then proc_address_found(symbol, pfn, cuda_version, flags);

            // Views.
            cuMemGetInfo_v2 ["cuMemGetInfo", 3020, any] fn(free: *mut usize, total: *mut usize) -> CUresult
                => then mem_info_view(free, total);
            cuDeviceTotalMem_v2 ["cuDeviceTotalMem", 3020, any] fn(bytes: *mut usize, dev: CUdevice) -> CUresult
                => then total_mem_view(bytes, dev);

            // Plain device memory.
            cuMemAlloc_v2 ["cuMemAlloc", 3020, any] fn(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult;
            cuMemAllocPitch_v2 ["cuMemAllocPitch", 3020, any]
                fn(dptr: *mut CUdeviceptr, pitch: *mut usize, width_in_bytes: usize, height: usize,
                   element_size_bytes: c_uint) -> CUresult;
            cuMemAllocManaged ["cuMemAllocManaged", 6000, any]
                fn(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) -> CUresult;
            cuMemFree_v2 ["cuMemFree", 3020, any] fn(dptr: CUdeviceptr) -> CUresult;
            cuMemGetAddressRange_v2 ["cuMemGetAddressRange", 3020, any]
                fn(pbase: *mut CUdeviceptr, psize: *mut usize, dptr: CUdeviceptr) -> CUresult;
            cuPointerGetAttribute ["cuPointerGetAttribute", 4000, any]
                fn(data: *mut c_void, attribute: CUpointer_attribute, ptr: CUdeviceptr) -> CUresult;
            cuPointerGetAttributes ["cuPointerGetAttributes", 7000, any]
                fn(num_attributes: c_uint, attributes: *mut CUpointer_attribute, data: *mut *mut c_void,
                   ptr: CUdeviceptr) -> CUresult;
            cuIpcGetMemHandle ["cuIpcGetMemHandle", 4010, any]
                fn(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) -> CUresult;

            // Virtual memory management.
            cuMemCreate ["cuMemCreate", 10020, any]
                fn(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp,
                   flags: u64) -> CUresult;
            // The program's handles can move (docs/swap.md, "The program's own VMM handles"):
            // every call that names a handle or changes what maps where passes the gate, so
            // it never runs while one moves and always finds it resident; the handle it names
            // is translated to the handle that holds the memory now.
            cuMemRelease ["cuMemRelease", 10020, any, touches] fn(handle: CUmemGenericAllocationHandle) -> CUresult
                => body(handle);
            cuMemRetainAllocationHandle ["cuMemRetainAllocationHandle", 11000, any, touches]
                fn(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult
                => then vmm_retained(handle);
            cuMemMap ["cuMemMap", 10020, any, touches]
                fn(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle,
                   flags: c_ulonglong) -> CUresult
                => body(ptr, size, offset, handle, flags);
            cuMemUnmap ["cuMemUnmap", 10020, any, touches] fn(ptr: CUdeviceptr, size: usize) -> CUresult
                => then vmm_unmapped(ptr, size);
            cuMemSetAccess ["cuMemSetAccess", 10020, any, touches]
                fn(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) -> CUresult
                => then vmm_access_set(ptr, size, desc, count);
            cuMemExportToShareableHandle ["cuMemExportToShareableHandle", 10020, any, touches]
                fn(shareable: *mut c_void, handle: CUmemGenericAllocationHandle, handle_type: c_uint,
                   flags: c_ulonglong) -> CUresult
                => body(shareable, handle, handle_type, flags);
            // An imported handle is the exporter's memory: recorded so that it never moves.
            cuMemImportFromShareableHandle ["cuMemImportFromShareableHandle", 10020, any, touches]
                fn(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, handle_type: c_uint)
                    -> CUresult
                => body(handle, os_handle, handle_type);
            cuMemGetAllocationPropertiesFromHandle ["cuMemGetAllocationPropertiesFromHandle", 10020, any, touches]
                fn(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) -> CUresult
                => body(prop, handle);
            cuMulticastBindMem ["cuMulticastBindMem", 12010, any, touches]
                fn(mc_handle: CUmemGenericAllocationHandle, mc_offset: usize, mem_handle: CUmemGenericAllocationHandle,
                   mem_offset: usize, size: usize, flags: c_ulonglong) -> CUresult
                => body(mc_handle, mc_offset, mem_handle, mem_offset, size, flags);

            // Stream-ordered allocation and pools.
            cuMemAllocAsync ["cuMemAllocAsync", 11020, legacy]
                fn(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> CUresult;
            cuMemAllocAsync_ptsz ["cuMemAllocAsync", 11020, ptsz]
                fn(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> CUresult
                => twin cuMemAllocAsync;
            cuMemAllocFromPoolAsync ["cuMemAllocFromPoolAsync", 11020, legacy]
                fn(dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult;
            cuMemAllocFromPoolAsync_ptsz ["cuMemAllocFromPoolAsync", 11020, ptsz]
                fn(dptr: *mut CUdeviceptr, bytesize: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult
                => twin cuMemAllocFromPoolAsync;
            cuMemFreeAsync ["cuMemFreeAsync", 11020, legacy] fn(dptr: CUdeviceptr, stream: CUstream) -> CUresult;
            cuMemFreeAsync_ptsz ["cuMemFreeAsync", 11020, ptsz] fn(dptr: CUdeviceptr, stream: CUstream) -> CUresult
                => twin cuMemFreeAsync;
            cuMemPoolCreate ["cuMemPoolCreate", 11020, any]
                fn(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult
                => then pool_created(pool, props);
            cuMemPoolDestroy ["cuMemPoolDestroy", 11020, any] fn(pool: CUmemoryPool) -> CUresult
                => then pool_destroyed(pool);
            cuMemPoolTrimTo ["cuMemPoolTrimTo", 11020, any]
                fn(pool: CUmemoryPool, min_bytes_to_keep: usize) -> CUresult
                => then pool_trimmed(pool);
            // Sync points: pools give memory back to the device here.
            cuStreamSynchronize ["cuStreamSynchronize", 2000, legacy, touches] fn(stream: CUstream) -> CUresult
                => finally after_sync();
            cuStreamSynchronize_ptsz ["cuStreamSynchronize", 7000, ptsz, touches] fn(stream: CUstream) -> CUresult
                => finally after_sync();
            cuCtxSynchronize ["cuCtxSynchronize", 2000, any, touches] fn() -> CUresult => body();
            cuEventSynchronize ["cuEventSynchronize", 2000, any, touches] fn(event: CUevent) -> CUresult
                => finally after_sync();
            // CUDA 13's context-argument variant: its own API, not a newer cuCtxSynchronize.
            cuCtxSynchronize_v2 ["cuCtxSynchronize_v2", 13000, any, touches] fn(ctx: CUcontext) -> CUresult
                => body(ctx);

            // Arrays.
            cuArrayCreate_v2 ["cuArrayCreate", 3020, any]
                fn(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult
                => body create_array(handle, desc);
            cuArray3DCreate_v2 ["cuArray3DCreate", 3020, any]
                fn(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult
                => body create_array(handle, desc);
            cuArrayDestroy ["cuArrayDestroy", 2000, any] fn(handle: CUarray) -> CUresult
                => then array_destroyed(handle);
            cuMipmappedArrayCreate ["cuMipmappedArrayCreate", 5000, any]
                fn(handle: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, num_levels: c_uint)
                    -> CUresult;
            cuMipmappedArrayDestroy ["cuMipmappedArrayDestroy", 5000, any]
                fn(handle: CUmipmappedArray) -> CUresult => then mipmapped_array_destroyed(handle);

            // Contexts.
            cuDevicePrimaryCtxRetain ["cuDevicePrimaryCtxRetain", 7000, any]
                fn(pctx: *mut CUcontext, dev: CUdevice) -> CUresult;
            cuDevicePrimaryCtxRelease ["cuDevicePrimaryCtxRelease", 7000, any, ends_context] fn(dev: CUdevice) -> CUresult
                => then primary_released(dev);
            cuDevicePrimaryCtxRelease_v2 ["cuDevicePrimaryCtxRelease", 11000, any, ends_context] fn(dev: CUdevice) -> CUresult
                => then primary_released(dev);
            cuDevicePrimaryCtxReset ["cuDevicePrimaryCtxReset", 7000, any, ends_context] fn(dev: CUdevice) -> CUresult
                => then primary_reset(dev);
            cuDevicePrimaryCtxReset_v2 ["cuDevicePrimaryCtxReset", 11000, any, ends_context] fn(dev: CUdevice) -> CUresult
                => then primary_reset(dev);
            cuCtxCreate_v2 ["cuCtxCreate", 3020, any]
                fn(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult
                => body create_context(pctx, dev);
            cuCtxCreate_v3 ["cuCtxCreate", 11040, any]
                fn(pctx: *mut CUcontext, params: CUexecAffinityParamPtr, num_params: c_int, flags: c_uint,
                   dev: CUdevice) -> CUresult
                => body create_context(pctx, dev);
            cuCtxCreate_v4 ["cuCtxCreate", 12050, any]
                fn(pctx: *mut CUcontext, params: CUctxCreateParamsPtr, flags: c_uint, dev: CUdevice) -> CUresult
                => body create_context(pctx, dev);
            cuCtxDestroy ["cuCtxDestroy", 2000, any, ends_context] fn(ctx: CUcontext) -> CUresult
                => then context_destroyed(ctx);
            cuCtxDestroy_v2 ["cuCtxDestroy", 4000, any, ends_context] fn(ctx: CUcontext) -> CUresult
                => then context_destroyed(ctx);

            // Modules and libraries: their code takes device memory, charged as module memory
            // by reconciling with NVML's per-process used memory after each load and unload.
            cuModuleLoad ["cuModuleLoad", 2000, any] fn(module: *mut CUmodule, fname: *const c_char) -> CUresult
                => then module_loaded(module);
            cuModuleLoadData ["cuModuleLoadData", 2000, any]
                fn(module: *mut CUmodule, image: *const c_void) -> CUresult
                => then module_loaded(module);
            cuModuleLoadDataEx ["cuModuleLoadDataEx", 2010, any]
                fn(module: *mut CUmodule, image: *const c_void, num_options: c_uint, options: *mut CUjit_option,
                   option_values: *mut *mut c_void) -> CUresult => then module_loaded(module);
            cuModuleLoadFatBinary ["cuModuleLoadFatBinary", 2000, any]
                fn(module: *mut CUmodule, fat_cubin: *const c_void) -> CUresult
                => then module_loaded(module);
            cuModuleUnload ["cuModuleUnload", 2000, any] fn(hmod: CUmodule) -> CUresult
                => then code_unloaded();
            cuLibraryLoadData ["cuLibraryLoadData", 12000, any]
                fn(library: *mut CUlibrary, code: *const c_void, jit_options: *mut CUjit_option,
                   jit_options_values: *mut *mut c_void, num_jit_options: c_uint,
                   library_options: *mut CUlibraryOption, library_option_values: *mut *mut c_void,
                   num_library_options: c_uint) -> CUresult => then library_loaded(library);
            cuLibraryLoadFromFile ["cuLibraryLoadFromFile", 12000, any]
                fn(library: *mut CUlibrary, file_name: *const c_char, jit_options: *mut CUjit_option,
                   jit_options_values: *mut *mut c_void, num_jit_options: c_uint,
                   library_options: *mut CUlibraryOption, library_option_values: *mut *mut c_void,
                   num_library_options: c_uint) -> CUresult => then library_loaded(library);
            cuLibraryUnload ["cuLibraryUnload", 12000, any] fn(library: CUlibrary) -> CUresult
                => then code_unloaded();

            // Graph memory.
            cuGraphAddMemAllocNode ["cuGraphAddMemAllocNode", 11040, any]
                fn(node: *mut CUgraphNode, graph: CUgraph, dependencies: *const CUgraphNode,
                   num_dependencies: usize, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> CUresult;
            cuDeviceGraphMemTrim ["cuDeviceGraphMemTrim", 11040, any] fn(dev: CUdevice) -> CUresult
                => then graph_mem_trimmed(dev);
            // Uploading a graph reserves its memory ahead of its first launch.
            cuGraphUpload ["cuGraphUpload", 11010, legacy, touches] fn(exec: CUgraphExec, stream: CUstream) -> CUresult
                => then graph_launched(stream);
            cuGraphUpload_ptsz ["cuGraphUpload", 11010, ptsz, touches] fn(exec: CUgraphExec, stream: CUstream) -> CUresult
                => then graph_launched(stream);

            // Work submission (the SM limit's entry points).
            cuLaunchKernel ["cuLaunchKernel", 4000, legacy, touches]
                fn(f: CUfunction, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint, block_x: c_uint,
                   block_y: c_uint, block_z: c_uint, shared_mem_bytes: c_uint, stream: CUstream,
                   kernel_params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult
                => body(f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes, stream);
            cuLaunchKernel_ptsz ["cuLaunchKernel", 7000, ptsz, touches]
                fn(f: CUfunction, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint, block_x: c_uint,
                   block_y: c_uint, block_z: c_uint, shared_mem_bytes: c_uint, stream: CUstream,
                   kernel_params: *mut *mut c_void, extra: *mut *mut c_void) -> CUresult
                => twin cuLaunchKernel(f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes, stream);
            cuLaunchKernelEx ["cuLaunchKernelEx", 11060, legacy, touches]
                fn(config: *const CUlaunchConfig, f: CUfunction, kernel_params: *mut *mut c_void,
                   extra: *mut *mut c_void) -> CUresult => body(config, f);
            cuLaunchKernelEx_ptsz ["cuLaunchKernelEx", 11060, ptsz, touches]
                fn(config: *const CUlaunchConfig, f: CUfunction, kernel_params: *mut *mut c_void,
                   extra: *mut *mut c_void) -> CUresult => twin cuLaunchKernelEx(config, f);
            cuLaunchCooperativeKernel ["cuLaunchCooperativeKernel", 9000, legacy, touches]
                fn(f: CUfunction, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint, block_x: c_uint,
                   block_y: c_uint, block_z: c_uint, shared_mem_bytes: c_uint, stream: CUstream,
                   kernel_params: *mut *mut c_void) -> CUresult
                => body(f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes, stream);
            cuLaunchCooperativeKernel_ptsz ["cuLaunchCooperativeKernel", 9000, ptsz, touches]
                fn(f: CUfunction, grid_x: c_uint, grid_y: c_uint, grid_z: c_uint, block_x: c_uint,
                   block_y: c_uint, block_z: c_uint, shared_mem_bytes: c_uint, stream: CUstream,
                   kernel_params: *mut *mut c_void) -> CUresult
                => twin cuLaunchCooperativeKernel(f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes, stream);
            cuGraphLaunch ["cuGraphLaunch", 10000, legacy, touches] fn(exec: CUgraphExec, stream: CUstream) -> CUresult
                => body(exec, stream);
            cuGraphLaunch_ptsz ["cuGraphLaunch", 10000, ptsz, touches] fn(exec: CUgraphExec, stream: CUstream) -> CUresult
                => twin cuGraphLaunch(exec, stream);

            // Copies and memsets: passed through, behind the swap gate (docs/swap.md). The
            // synchronous ones' per-thread variants are `_ptds`, the asynchronous ones' `_ptsz`.
            cuMemcpy ["cuMemcpy", 4000, legacy, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult => pass;
            cuMemcpy_ptds ["cuMemcpy", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult => pass;
            cuMemcpyHtoD_v2 ["cuMemcpyHtoD", 3020, legacy, touches]
                fn(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult => pass;
            cuMemcpyHtoD_v2_ptds ["cuMemcpyHtoD", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult => pass;
            cuMemcpyDtoH_v2 ["cuMemcpyDtoH", 3020, legacy, touches]
                fn(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult => pass;
            cuMemcpyDtoH_v2_ptds ["cuMemcpyDtoH", 7000, ptsz, touches]
                fn(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult => pass;
            cuMemcpyDtoD_v2 ["cuMemcpyDtoD", 3020, legacy, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult => pass;
            cuMemcpyDtoD_v2_ptds ["cuMemcpyDtoD", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult => pass;
            cuMemsetD8_v2 ["cuMemsetD8", 3020, legacy, touches]
                fn(dst: CUdeviceptr, value: u8, count: usize) -> CUresult => pass;
            cuMemsetD8_v2_ptds ["cuMemsetD8", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, value: u8, count: usize) -> CUresult => pass;
            cuMemsetD16_v2 ["cuMemsetD16", 3020, legacy, touches]
                fn(dst: CUdeviceptr, value: u16, count: usize) -> CUresult => pass;
            cuMemsetD16_v2_ptds ["cuMemsetD16", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, value: u16, count: usize) -> CUresult => pass;
            cuMemsetD32_v2 ["cuMemsetD32", 3020, legacy, touches]
                fn(dst: CUdeviceptr, value: c_uint, count: usize) -> CUresult => pass;
            cuMemsetD32_v2_ptds ["cuMemsetD32", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, value: c_uint, count: usize) -> CUresult => pass;
            cuMemcpyAsync ["cuMemcpyAsync", 4000, legacy, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyAsync_ptsz ["cuMemcpyAsync", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyHtoDAsync_v2 ["cuMemcpyHtoDAsync", 3020, legacy, touches]
                fn(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyHtoDAsync_v2_ptsz ["cuMemcpyHtoDAsync", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, src: *const c_void, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyDtoHAsync_v2 ["cuMemcpyDtoHAsync", 3020, legacy, touches]
                fn(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyDtoHAsync_v2_ptsz ["cuMemcpyDtoHAsync", 7000, ptsz, touches]
                fn(dst: *mut c_void, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyDtoDAsync_v2 ["cuMemcpyDtoDAsync", 3020, legacy, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemcpyDtoDAsync_v2_ptsz ["cuMemcpyDtoDAsync", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> CUresult => pass;
            cuMemsetD8Async ["cuMemsetD8Async", 3020, legacy, touches]
                fn(dst: CUdeviceptr, value: u8, count: usize, stream: CUstream) -> CUresult => pass;
            cuMemsetD8Async_ptsz ["cuMemsetD8Async", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, value: u8, count: usize, stream: CUstream) -> CUresult => pass;
            cuMemsetD32Async ["cuMemsetD32Async", 3020, legacy, touches]
                fn(dst: CUdeviceptr, value: c_uint, count: usize, stream: CUstream) -> CUresult => pass;
            cuMemsetD32Async_ptsz ["cuMemsetD32Async", 7000, ptsz, touches]
                fn(dst: CUdeviceptr, value: c_uint, count: usize, stream: CUstream) -> CUresult => pass;
        }
    };
}

/// Hands a hooked list to its callback, with the shapes (`[with_shapes callback]`) or
/// without them (`[callback]`).
#[doc(hidden)]
#[macro_export]
macro_rules! __shapes {
    ([with_shapes $callback:ident] $($entries:tt)*) => {
        $callback! { $($entries)* }
    };
    ([$callback:ident]
     $( $name:ident [$base:literal, $ver:literal, $kind:ident $(, $touches:ident)?] fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty
        $(=> $verb:ident $($target:ident)? $(($($shape_arg:ident),*))?)?; )*) => {
        $callback! { $( $name [$base, $ver, $kind $(, $touches)?] fn($($arg: $ty),*) -> $ret; )* }
    };
}

/// Driver functions the hook calls but does not intercept (same entry format as
/// [`cuda_hooked_functions!`]). The simulated driver must implement these too.
#[macro_export]
macro_rules! cuda_used_functions {
    ($callback:ident) => {
        $callback! {
            cuDriverGetVersion ["cuDriverGetVersion", 2020, any] fn(version: *mut c_int) -> CUresult;
            cuDeviceGet ["cuDeviceGet", 2000, any] fn(dev: *mut CUdevice, ordinal: c_int) -> CUresult;
            cuDeviceGetCount ["cuDeviceGetCount", 2000, any] fn(count: *mut c_int) -> CUresult;
            cuDeviceGetUuid ["cuDeviceGetUuid", 9020, any] fn(uuid: *mut CUuuid, dev: CUdevice) -> CUresult;
            cuDeviceGetUuid_v2 ["cuDeviceGetUuid", 11040, any] fn(uuid: *mut CUuuid, dev: CUdevice) -> CUresult;
            cuCtxGetCurrent ["cuCtxGetCurrent", 4000, any] fn(pctx: *mut CUcontext) -> CUresult;
            cuCtxGetDevice ["cuCtxGetDevice", 2000, any] fn(dev: *mut CUdevice) -> CUresult;
            cuCtxPushCurrent_v2 ["cuCtxPushCurrent", 4000, any] fn(ctx: CUcontext) -> CUresult;
            cuCtxPopCurrent_v2 ["cuCtxPopCurrent", 4000, any] fn(pctx: *mut CUcontext) -> CUresult;
            cuStreamGetCtx ["cuStreamGetCtx", 9020, legacy] fn(stream: CUstream, pctx: *mut CUcontext) -> CUresult;
            cuStreamIsCapturing ["cuStreamIsCapturing", 10000, legacy]
                fn(stream: CUstream, status: *mut CUstreamCaptureStatus) -> CUresult;
            cuEventCreate ["cuEventCreate", 2000, any] fn(event: *mut CUevent, flags: c_uint) -> CUresult;
            cuEventDestroy ["cuEventDestroy", 2000, any] fn(event: CUevent) -> CUresult;
            cuEventDestroy_v2 ["cuEventDestroy", 4000, any] fn(event: CUevent) -> CUresult;
            cuEventRecord ["cuEventRecord", 2000, legacy] fn(event: CUevent, stream: CUstream) -> CUresult;
            cuEventQuery ["cuEventQuery", 2000, any] fn(event: CUevent) -> CUresult;
            cuEventElapsedTime ["cuEventElapsedTime", 2000, any]
                fn(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult;
            cuEventElapsedTime_v2 ["cuEventElapsedTime", 12080, any]
                fn(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult;
            // The SM limiter's sample gate (docs/sm-limit.md): a stream wait on a host word.
            cuStreamWaitValue32_v2 ["cuStreamWaitValue32", 12000, legacy]
                fn(stream: CUstream, addr: CUdeviceptr, value: c_uint, flags: c_uint) -> CUresult;
            cuMemHostRegister_v2 ["cuMemHostRegister", 6050, any]
                fn(p: *mut c_void, size: usize, flags: c_uint) -> CUresult;
            cuMemHostGetDevicePointer_v2 ["cuMemHostGetDevicePointer", 3020, any]
                fn(dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) -> CUresult;
            cuMemGetAllocationGranularity ["cuMemGetAllocationGranularity", 10020, any]
                fn(granularity: *mut usize, prop: *const CUmemAllocationProp,
                   option: CUmemAllocationGranularity_flags) -> CUresult;
            cuMemPoolGetAttribute ["cuMemPoolGetAttribute", 11020, any]
                fn(pool: CUmemoryPool, attr: CUmemPool_attribute, value: *mut c_void) -> CUresult;
            cuDeviceGetDefaultMemPool ["cuDeviceGetDefaultMemPool", 11020, any]
                fn(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult;
            cuDeviceGetMemPool ["cuDeviceGetMemPool", 11020, any]
                fn(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult;
            cuDeviceGetGraphMemAttribute ["cuDeviceGetGraphMemAttribute", 11040, any]
                fn(dev: CUdevice, attr: CUgraphMem_attribute, value: *mut c_void) -> CUresult;
            cuDevicePrimaryCtxGetState ["cuDevicePrimaryCtxGetState", 7000, any]
                fn(dev: CUdevice, flags: *mut c_uint, active: *mut c_int) -> CUresult;
            // Host-backed memory (docs/oversubscription.md): a reserved address mapped to
            // host-located memory, later remapped to device memory after a copy.
            cuMemAddressReserve ["cuMemAddressReserve", 10020, any]
                fn(ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr,
                   flags: c_ulonglong) -> CUresult;
            cuMemAddressFree ["cuMemAddressFree", 10020, any]
                fn(ptr: CUdeviceptr, size: usize) -> CUresult;
            // `cuMemMap`, `cuMemUnmap` and `cuMemSetAccess` are hooked (the program's own
            // mappings, docs/swap.md); the hook's own calls use their real functions.
        }
    };
}

/// Every NVML symbol `libvgpu.so` intercepts (same entry format; version and stream kind unused).
#[macro_export]
macro_rules! nvml_hooked_functions {
    ($($callback:ident)+) => {
        $crate::__shapes! { [$($callback)+]
            nvmlDeviceGetMemoryInfo ["nvmlDeviceGetMemoryInfo", 0, any]
                fn(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t
                => then nvml_memory_view(device, memory);
            nvmlDeviceGetMemoryInfo_v2 ["nvmlDeviceGetMemoryInfo_v2", 0, any]
                fn(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t
                => then nvml_memory_view(device, memory);
        }
    };
}

/// NVML functions the hook calls but does not intercept.
#[macro_export]
macro_rules! nvml_used_functions {
    ($callback:ident) => {
        $callback! {
            nvmlInit_v2 ["nvmlInit_v2", 0, any] fn() -> nvmlReturn_t;
            nvmlDeviceGetCount_v2 ["nvmlDeviceGetCount_v2", 0, any] fn(count: *mut c_uint) -> nvmlReturn_t;
            nvmlDeviceGetHandleByIndex_v2 ["nvmlDeviceGetHandleByIndex_v2", 0, any]
                fn(index: c_uint, device: *mut nvmlDevice_t) -> nvmlReturn_t;
            nvmlDeviceGetUUID ["nvmlDeviceGetUUID", 0, any]
                fn(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) -> nvmlReturn_t;
            nvmlDeviceGetHandleByUUID ["nvmlDeviceGetHandleByUUID", 0, any]
                fn(uuid: *const c_char, device: *mut nvmlDevice_t) -> nvmlReturn_t;
            nvmlDeviceGetComputeRunningProcesses_v3 ["nvmlDeviceGetComputeRunningProcesses_v3", 0, any]
                fn(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
            nvmlDeviceGetComputeRunningProcesses_v2 ["nvmlDeviceGetComputeRunningProcesses_v2", 0, any]
                fn(device: nvmlDevice_t, count: *mut c_uint, infos: *mut nvmlProcessInfo_t) -> nvmlReturn_t;
        }
    };
}

/// Which default stream a symbol variant uses (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// The function has no default-stream variants.
    Any,
    /// The legacy-default-stream variant of a function that also has a `_ptsz` one.
    Legacy,
    /// The per-thread-default-stream variant (`_ptsz` / `_ptds`).
    PerThread,
}

/// One entry of a declaration list, as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SymbolInfo {
    /// Exported symbol name (`cuMemAlloc_v2`).
    pub name: &'static str,
    /// The same, NUL-terminated, for `dlsym`.
    pub c_name: &'static core::ffi::CStr,
    /// The name programs pass to `cuGetProcAddress` (`cuMemAlloc`).
    pub base: &'static str,
    /// Lowest requested CUDA version that gets this variant.
    pub min_version: i32,
    /// Default-stream flavour.
    pub stream: StreamKind,
    /// The call can touch device memory (it runs or orders work on the device: launches,
    /// copies, memsets, graph launches, stream and event operations): a swapped-out process
    /// brings its memory back before it (docs/swap.md). Written `touches` in the entry.
    pub touches_device_memory: bool,
}

#[doc(hidden)]
#[macro_export]
macro_rules! __stream_kind {
    (any) => {
        $crate::StreamKind::Any
    };
    (legacy) => {
        $crate::StreamKind::Legacy
    };
    (ptsz) => {
        $crate::StreamKind::PerThread
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __touches {
    () => {
        false
    };
    (touches) => {
        true
    };
    (ends_context) => {
        false
    };
}

macro_rules! symbol_table {
    ($( $name:ident [$base:literal, $ver:literal, $kind:ident $(, $touches:ident)?] fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty; )*) => {
        &[$(SymbolInfo {
            name: stringify!($name),
            c_name: match core::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                Ok(s) => s,
                Err(_) => panic!("symbol name with NUL"),
            },
            base: $base,
            min_version: $ver,
            stream: __stream_kind!($kind),
            touches_device_memory: __touches!($($touches)?),
        },)*]
    };
}

/// Every hooked driver symbol, as data (from [`cuda_hooked_functions!`]).
pub const CUDA_HOOKED_SYMBOLS: &[SymbolInfo] = cuda_hooked_functions!(symbol_table);
/// Every driver symbol the hook calls without hooking (from [`cuda_used_functions!`]).
pub const CUDA_USED_SYMBOLS: &[SymbolInfo] = cuda_used_functions!(symbol_table);
/// Every hooked NVML symbol (from [`nvml_hooked_functions!`]).
pub const NVML_HOOKED_SYMBOLS: &[SymbolInfo] = nvml_hooked_functions!(symbol_table);
/// Every NVML symbol the hook calls without hooking (from [`nvml_used_functions!`]).
pub const NVML_USED_SYMBOLS: &[SymbolInfo] = nvml_used_functions!(symbol_table);

/// The driver API's families (name prefixes, from `cuda.h`) whose functions can touch device
/// memory: they run, copy or set memory on a device, or wait for such work. Every hooked
/// entry of these families is `touches`, and a process that resolved a function of them that
/// the hook does not list (through `dlsym` or `cuGetProcAddress`) is never swapped out: its
/// calls would pass no gate. Not here: what only orders work or observes it without touching
/// memory (`cuEventRecord`, `cuStreamWaitEvent`, `cuStreamQuery`, `cuEventQuery`): the work
/// it orders was queued through a gated call.
///
/// The virtual memory management calls that name a handle or change what maps where
/// (`cuMemMap`, `cuMemUnmap`, `cuMemSetAccess`, `cuMemRelease`, …) do not touch memory's
/// contents, but they are here too: the program's own handles move under swapping
/// (docs/swap.md), so these calls must never run while one moves, and must find it resident.
pub const TOUCHING_FAMILIES: &[&str] = &[
    "cuLaunch",
    "cuGraphLaunch",
    "cuGraphUpload",
    "cuMemcpy",
    "cuMemset",
    "cuMemPrefetch",
    "cuMemDiscard",
    "cuSignalExternalSemaphores",
    "cuWaitExternalSemaphores",
    "cuStreamWaitValue",
    "cuStreamWriteValue",
    "cuStreamBatchMemOp",
    "cuStreamSynchronize",
    "cuStreamAddCallback",
    "cuEventSynchronize",
    "cuCtxSynchronize",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemRelease",
    "cuMemRetainAllocationHandle",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMulticastBindMem",
];

/// Whether the driver function `name` can touch device memory ([`TOUCHING_FAMILIES`]).
pub fn can_touch_device_memory(name: &str) -> bool {
    TOUCHING_FAMILIES.iter().any(|f| name.starts_with(f))
}

/// Picks the variant `cuGetProcAddress(base, cuda_version, flags)` resolves to among
/// `symbols`: the newest variant whose `min_version <= cuda_version`, preferring the
/// per-thread variant when `flags` has `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`
/// (and never returning one otherwise).
pub fn select_variant(
    symbols: &'static [SymbolInfo],
    base: &str,
    cuda_version: i32,
    flags: u64,
) -> Option<&'static SymbolInfo> {
    let per_thread = flags & crate::proc_address_flags::PER_THREAD_DEFAULT_STREAM != 0;
    let best = |want_ptsz: bool| {
        symbols
            .iter()
            .filter(|s| s.base == base && s.min_version <= cuda_version)
            .filter(|s| (s.stream == StreamKind::PerThread) == want_ptsz)
            .max_by_key(|s| s.min_version)
    };
    if per_thread {
        best(true).or_else(|| best(false))
    } else {
        best(false)
    }
}

/// Looks a symbol up by exact exported name.
pub fn find_symbol(symbols: &'static [SymbolInfo], name: &str) -> Option<&'static SymbolInfo> {
    symbols.iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc_address_flags::{DEFAULT, LEGACY_STREAM, PER_THREAD_DEFAULT_STREAM};

    fn pick(base: &str, v: i32, flags: u64) -> Option<&'static str> {
        select_variant(CUDA_HOOKED_SYMBOLS, base, v, flags).map(|s| s.name)
    }

    /// `(base, cuda_version, flags, expected variant)`, checked by [`pick`].
    fn check(cases: &[(&str, i32, u64, Option<&str>)]) {
        for &(base, version, flags, want) in cases {
            assert_eq!(pick(base, version, flags), want, "{base} {version} {flags}");
        }
    }

    #[test]
    fn versions_pick_the_newest_not_newer_than_requested() {
        check(&[
            ("cuMemAlloc", 12040, DEFAULT, Some("cuMemAlloc_v2")),
            // v1 (32-bit) is not hooked.
            ("cuMemAlloc", 3000, DEFAULT, None),
            ("cuCtxCreate", 11000, DEFAULT, Some("cuCtxCreate_v2")),
            ("cuCtxCreate", 11040, DEFAULT, Some("cuCtxCreate_v3")),
            ("cuCtxCreate", 13000, DEFAULT, Some("cuCtxCreate_v4")),
            (
                "cuDevicePrimaryCtxRelease",
                10020,
                DEFAULT,
                Some("cuDevicePrimaryCtxRelease"),
            ),
            (
                "cuDevicePrimaryCtxRelease",
                12000,
                DEFAULT,
                Some("cuDevicePrimaryCtxRelease_v2"),
            ),
            (
                "cuGetProcAddress",
                12000,
                DEFAULT,
                Some("cuGetProcAddress_v2"),
            ),
            ("cuGetProcAddress", 11080, DEFAULT, Some("cuGetProcAddress")),
            ("cuMemcpy2D", 12000, DEFAULT, None),
        ]);
    }

    #[test]
    fn per_thread_flag_picks_ptsz_variants_only_when_asked() {
        check(&[
            (
                "cuLaunchKernel",
                12000,
                PER_THREAD_DEFAULT_STREAM,
                Some("cuLaunchKernel_ptsz"),
            ),
            (
                "cuLaunchKernel",
                12000,
                LEGACY_STREAM,
                Some("cuLaunchKernel"),
            ),
            ("cuLaunchKernel", 12000, DEFAULT, Some("cuLaunchKernel")),
            (
                "cuMemAllocAsync",
                12000,
                PER_THREAD_DEFAULT_STREAM,
                Some("cuMemAllocAsync_ptsz"),
            ),
            // No stream variants: the per-thread request still gets the function.
            (
                "cuMemAlloc",
                12000,
                PER_THREAD_DEFAULT_STREAM,
                Some("cuMemAlloc_v2"),
            ),
        ]);
    }

    #[test]
    fn names_are_unique_and_bases_are_prefixes() {
        for list in [
            CUDA_HOOKED_SYMBOLS,
            CUDA_USED_SYMBOLS,
            NVML_HOOKED_SYMBOLS,
            NVML_USED_SYMBOLS,
        ] {
            for (i, s) in list.iter().enumerate() {
                assert!(s.name.starts_with(s.base), "{} / {}", s.name, s.base);
                assert_eq!(s.c_name.to_str().unwrap(), s.name);
                assert!(
                    list[i + 1..].iter().all(|t| t.name != s.name),
                    "duplicate {}",
                    s.name
                );
                assert_eq!(
                    s.stream == StreamKind::PerThread,
                    s.name.ends_with("_ptsz") || s.name.ends_with("_ptds"),
                    "{}",
                    s.name
                );
            }
        }
        // Hooked and merely used lists must not overlap: a used function would bypass the hook.
        for s in CUDA_USED_SYMBOLS {
            assert!(
                find_symbol(CUDA_HOOKED_SYMBOLS, s.name).is_none(),
                "{}",
                s.name
            );
        }
        for s in NVML_USED_SYMBOLS {
            assert!(
                find_symbol(NVML_HOOKED_SYMBOLS, s.name).is_none(),
                "{}",
                s.name
            );
        }
    }

    /// `(name, shape verb, shape target)` of every hooked entry (`""` where absent).
    macro_rules! shape_table {
        ($( $name:ident [$base:literal, $ver:literal, $kind:ident $(, $touches:ident)?] fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty
            $(=> $verb:ident $($target:ident)? $(($($shape_arg:ident),*))?)?; )*) => {
            &[$((
                stringify!($name),
                concat!("" $(, stringify!($verb))?),
                concat!("" $($(, stringify!($target))?)?),
            ),)*]
        };
    }

    #[test]
    fn shapes_are_known_and_twins_name_their_legacy_sibling() {
        const CUDA: &[(&str, &str, &str)] = cuda_hooked_functions!(with_shapes shape_table);
        const NVML: &[(&str, &str, &str)] = nvml_hooked_functions!(with_shapes shape_table);
        assert_eq!(CUDA.len(), CUDA_HOOKED_SYMBOLS.len());
        assert_eq!(NVML.len(), NVML_HOOKED_SYMBOLS.len());
        for &(name, verb, target) in CUDA.iter().chain(NVML) {
            assert!(
                ["", "then", "finally", "twin", "body", "pass"].contains(&verb),
                "{name}: unknown shape {verb}"
            );
            assert!(
                if verb.is_empty() {
                    target.is_empty()
                } else {
                    verb == "body" || verb == "pass" || !target.is_empty()
                },
                "{name}: only `body` and `pass` go without a target"
            );
            let info = find_symbol(CUDA_HOOKED_SYMBOLS, name)
                .or_else(|| find_symbol(NVML_HOOKED_SYMBOLS, name))
                .unwrap();
            if verb == "twin" {
                assert_eq!(info.stream, StreamKind::PerThread, "{name}");
                assert_eq!(format!("{target}_ptsz"), name);
                let sibling = CUDA.iter().find(|e| e.0 == target).unwrap();
                assert!(
                    sibling.1.is_empty() || sibling.1 == "body",
                    "{name}: a twin's sibling is hand-written"
                );
            }
            if info.stream == StreamKind::PerThread {
                assert!(
                    !verb.is_empty() && verb != "body",
                    "{name}: a _ptsz entry needs a shape"
                );
            }
        }
    }

    #[test]
    fn every_ptsz_variant_has_a_legacy_sibling() {
        for s in CUDA_HOOKED_SYMBOLS
            .iter()
            .filter(|s| s.stream == StreamKind::PerThread)
        {
            let legacy = CUDA_HOOKED_SYMBOLS
                .iter()
                .find(|t| t.base == s.base && t.stream == StreamKind::Legacy)
                .unwrap_or_else(|| panic!("no legacy variant for {}", s.name));
            assert!(
                [
                    format!("{}_ptsz", legacy.name),
                    format!("{}_ptds", legacy.name)
                ]
                .contains(&s.name.to_owned()),
                "{}",
                s.name
            );
        }
    }

    #[test]
    fn every_hooked_entry_that_can_touch_device_memory_is_gated_and_no_other() {
        for s in CUDA_HOOKED_SYMBOLS {
            assert_eq!(
                s.touches_device_memory,
                can_touch_device_memory(s.name),
                "{}: `touches` must follow TOUCHING_FAMILIES",
                s.name
            );
        }
        for s in NVML_HOOKED_SYMBOLS {
            assert!(!s.touches_device_memory, "{}", s.name);
        }
        assert!(!can_touch_device_memory("cuEventRecord"));
        assert!(can_touch_device_memory("cuMemcpy3DPeerAsync"));
    }
}
