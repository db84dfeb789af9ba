//! Driver and NVML types with their exact C layouts.
//!
//! Codes and enumerations are `#[repr(transparent)]` integers with named constants, never
//! Rust enums: a newer driver may hand us a value this crate has never heard of, and
//! forwarding it must not be undefined behaviour.

#![allow(non_camel_case_types, non_snake_case)]

use core::ffi::{c_char, c_int, c_uint, c_ushort, c_void};
use core::fmt;

/// Declares a `#[repr(transparent)]` integer newtype with named constants, one line a value:
/// `NAME = value,` documents the constant as the C constant `prefix` + `NAME`, and
/// `NAME = value as C_NAME,` names the C constant where it does not follow the prefix (the
/// bindgen/ZLUDA table of a C enum, without restating each C name). Doc lines above a value
/// follow its C name.
macro_rules! c_enum {
    (
        $(#[$m:meta])* $name:ident($int:ty), $prefix:literal {
            $($(#[$cm:meta])* $c:ident = $v:literal $(as $c_name:ident)?,)*
        }
    ) => {
        $(#[$m])*
        #[repr(transparent)]
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(pub $int);

        impl $name {
            $(
                #[doc = c_name!($prefix, $c $(, $c_name)?)]
                #[doc = ""]
                $(#[$cm])*
                pub const $c: Self = Self($v);
            )*

            /// The constant's name, if this value has one here.
            pub fn name(self) -> Option<&'static str> {
                match self {
                    $(Self::$c => Some(stringify!($c)),)*
                    _ => None,
                }
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(n) => write!(f, "{}({})", n, self.0),
                    None => write!(f, "{}({})", stringify!($name), self.0),
                }
            }
        }
    };
}

/// The C name a [`c_enum!`] constant documents: `prefix` + its name, or the one given.
macro_rules! c_name {
    ($prefix:literal, $c:ident) => {
        concat!("`", $prefix, stringify!($c), "`")
    };
    ($prefix:literal, $c:ident, $c_name:ident) => {
        concat!("`", stringify!($c_name), "`")
    };
}

c_enum! {
    /// `CUresult`: any status code, including ones a newer driver invents.
    CUresult(u32), "CUDA_ERROR_" {
        SUCCESS = 0 as CUDA_SUCCESS,
        INVALID_VALUE = 1,
        OUT_OF_MEMORY = 2,
        NOT_INITIALIZED = 3,
        DEINITIALIZED = 4,
        STUB_LIBRARY = 34,
        NO_DEVICE = 100,
        INVALID_DEVICE = 101,
        INVALID_CONTEXT = 201,
        SHARED_OBJECT_SYMBOL_NOT_FOUND = 302,
        SHARED_OBJECT_INIT_FAILED = 303,
        OPERATING_SYSTEM = 304,
        INVALID_HANDLE = 400,
        ILLEGAL_STATE = 401,
        NOT_FOUND = 500,
        NOT_READY = 600,
        NOT_PERMITTED = 800,
        NOT_SUPPORTED = 801,
        STREAM_CAPTURE_UNSUPPORTED = 900,
        UNKNOWN = 999,
    }
}

impl CUresult {
    /// `true` for `CUDA_SUCCESS`.
    #[inline]
    pub fn is_success(self) -> bool {
        self.0 == 0
    }

    /// `Ok(())` for success, the code otherwise.
    #[inline]
    pub fn ok(self) -> Result<(), CUresult> {
        if self.is_success() { Ok(()) } else { Err(self) }
    }
}

/// `CUdevice`: a device ordinal as the process sees it.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct CUdevice(pub c_int);

/// `CUdeviceptr`: a device virtual address.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct CUdeviceptr(pub u64);

/// `CUmemGenericAllocationHandle` (`cuMemCreate`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CUmemGenericAllocationHandle(pub u64);

/// `cuuint64_t`.
pub type cuuint64_t = u64;

macro_rules! opaque_handles {
    ($($(#[$m:meta])* $alias:ident => $st:ident;)*) => {$(
        $(#[$m])*
        pub type $alias = *mut $st;
        #[doc = concat!("The opaque driver struct behind [`", stringify!($alias), "`].")]
        #[repr(C)]
        #[derive(Debug)]
        pub struct $st {
            _private: [u8; 0],
        }
    )*};
}

opaque_handles! {
    /// `CUcontext`
    CUcontext => CUctx_st;
    /// `CUstream`
    CUstream => CUstream_st;
    /// `CUevent`
    CUevent => CUevent_st;
    /// `CUmodule`
    CUmodule => CUmod_st;
    /// `CUfunction`
    CUfunction => CUfunc_st;
    /// `CUkernel`
    CUkernel => CUkern_st;
    /// `CUlibrary`
    CUlibrary => CUlib_st;
    /// `CUarray`
    CUarray => CUarray_st;
    /// `CUmipmappedArray`
    CUmipmappedArray => CUmipmappedArray_st;
    /// `CUmemoryPool`
    CUmemoryPool => CUmemPoolHandle_st;
    /// `CUgraph`
    CUgraph => CUgraph_st;
    /// `CUgraphNode`
    CUgraphNode => CUgraphNode_st;
    /// `CUgraphExec`
    CUgraphExec => CUgraphExec_st;
    /// `CUctxCreateParams *` (only passed through)
    CUctxCreateParamsPtr => CUctxCreateParams_st;
    /// `CUexecAffinityParam *` (only passed through)
    CUexecAffinityParamPtr => CUexecAffinityParam_st;
    /// `nvmlDevice_t`
    nvmlDevice_t => nvmlDevice_st;
}

c_enum! {
    /// `CUpointer_attribute`
    CUpointer_attribute(c_uint), "CU_POINTER_ATTRIBUTE_" {
        CONTEXT = 1,
        MEMORY_TYPE = 2,
        DEVICE_POINTER = 3,
        HOST_POINTER = 4,
        BUFFER_ID = 7,
        IS_MANAGED = 8,
        DEVICE_ORDINAL = 9,
        RANGE_START_ADDR = 11,
        RANGE_SIZE = 12,
        MEMPOOL_HANDLE = 17,
    }
}

c_enum! {
    /// `CUmemorytype`
    CUmemorytype(c_uint), "CU_MEMORYTYPE_" {
        HOST = 1,
        DEVICE = 2,
        ARRAY = 3,
        UNIFIED = 4,
    }
}

c_enum! {
    /// `CUmemPool_attribute`; every value's type is `cuuint64_t`.
    CUmemPool_attribute(c_uint), "CU_MEMPOOL_ATTR_" {
        RELEASE_THRESHOLD = 4,
        /// What the pool holds from the device.
        RESERVED_MEM_CURRENT = 5,
        RESERVED_MEM_HIGH = 6,
        /// What is handed out to the program.
        USED_MEM_CURRENT = 7,
        USED_MEM_HIGH = 8,
    }
}

c_enum! {
    /// `CUgraphMem_attribute` (`cuDeviceGetGraphMemAttribute`); every value's type is
    /// `cuuint64_t`.
    CUgraphMem_attribute(c_uint), "CU_GRAPH_MEM_ATTR_" {
        USED_MEM_CURRENT = 0,
        USED_MEM_HIGH = 1,
        /// Graph memory held from the device.
        RESERVED_MEM_CURRENT = 2,
        RESERVED_MEM_HIGH = 3,
    }
}

c_enum! {
    /// `CUstreamCaptureStatus`
    CUstreamCaptureStatus(c_uint), "CU_STREAM_CAPTURE_STATUS_" {
        NONE = 0,
        ACTIVE = 1,
        INVALIDATED = 2,
    }
}

c_enum! {
    /// `CUmemLocationType`
    CUmemLocationType(c_uint), "CU_MEM_LOCATION_TYPE_" {
        INVALID = 0,
        /// [`CUmemLocation::id`] is a device ordinal.
        DEVICE = 1,
        HOST = 2,
        HOST_NUMA = 3,
        HOST_NUMA_CURRENT = 4,
    }
}

c_enum! {
    /// `CUmemAllocationType`
    CUmemAllocationType(c_uint), "CU_MEM_ALLOCATION_TYPE_" {
        INVALID = 0,
        PINNED = 1,
    }
}

c_enum! {
    /// `CUmemAllocationGranularity_flags`
    CUmemAllocationGranularity_flags(c_uint), "CU_MEM_ALLOC_GRANULARITY_" {
        MINIMUM = 0,
        RECOMMENDED = 1,
    }
}

c_enum! {
    /// `CUarray_format`
    CUarray_format(c_uint), "CU_AD_FORMAT_" {
        UNSIGNED_INT8 = 0x01,
        UNSIGNED_INT16 = 0x02,
        UNSIGNED_INT32 = 0x03,
        SIGNED_INT8 = 0x08,
        SIGNED_INT16 = 0x09,
        SIGNED_INT32 = 0x0a,
        HALF = 0x10,
        FLOAT = 0x20,
        /// 8 bytes per 4×4 block.
        BC1_UNORM = 0x91,
        BC1_UNORM_SRGB = 0x92,
        /// 16 bytes per 4×4 block.
        BC2_UNORM = 0x93,
        BC2_UNORM_SRGB = 0x94,
        BC3_UNORM = 0x95,
        BC3_UNORM_SRGB = 0x96,
        /// 8 bytes per block.
        BC4_UNORM = 0x97,
        BC4_SNORM = 0x98,
        /// 16 bytes per block.
        BC5_UNORM = 0x99,
        BC5_SNORM = 0x9a,
        BC6H_UF16 = 0x9b,
        BC6H_SF16 = 0x9c,
        BC7_UNORM = 0x9d,
        BC7_UNORM_SRGB = 0x9e,
        /// 4:2:0, 1.5 bytes per pixel.
        NV12 = 0xb0,
        UNORM_INT8X1 = 0xc0,
        UNORM_INT8X2 = 0xc1,
        UNORM_INT8X4 = 0xc2,
        UNORM_INT16X1 = 0xc3,
        UNORM_INT16X2 = 0xc4,
        UNORM_INT16X4 = 0xc5,
        SNORM_INT8X1 = 0xc6,
        SNORM_INT8X2 = 0xc7,
        SNORM_INT8X4 = 0xc8,
        SNORM_INT16X1 = 0xc9,
        SNORM_INT16X2 = 0xca,
        SNORM_INT16X4 = 0xcb,
    }
}

/// `CUDA_ARRAY3D_*` flags of [`CUDA_ARRAY3D_DESCRIPTOR::Flags`].
pub mod array3d_flags {
    /// `CUDA_ARRAY3D_LAYERED`: `Depth` is a layer count.
    pub const LAYERED: u32 = 0x01;
    /// `CUDA_ARRAY3D_CUBEMAP`: six faces (times `Depth / 6` layers when layered).
    pub const CUBEMAP: u32 = 0x04;
    /// `CUDA_ARRAY3D_SPARSE`: no memory until mapped.
    pub const SPARSE: u32 = 0x40;
    /// `CUDA_ARRAY3D_DEFERRED_MAPPING`: no memory until mapped.
    pub const DEFERRED_MAPPING: u32 = 0x80;
}

/// `cuMemAllocManaged` attach flags.
pub mod mem_attach {
    /// `CU_MEM_ATTACH_GLOBAL`
    pub const GLOBAL: u32 = 0x1;
    /// `CU_MEM_ATTACH_HOST`
    pub const HOST: u32 = 0x2;
}

/// `cuGetProcAddress` flags (`CUdriverProcAddress_flags`).
pub mod proc_address_flags {
    /// `CU_GET_PROC_ADDRESS_DEFAULT`
    pub const DEFAULT: u64 = 0;
    /// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`
    pub const LEGACY_STREAM: u64 = 1;
    /// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`: ask for the `_ptsz`/`_ptds` variants.
    pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;
}

c_enum! {
    /// `CUdriverProcAddressQueryResult` (`cuGetProcAddress_v2`'s `symbolStatus`).
    CUdriverProcAddressQueryResult(c_uint), "CU_GET_PROC_ADDRESS_" {
        SUCCESS = 0,
        SYMBOL_NOT_FOUND = 1,
        VERSION_NOT_SUFFICIENT = 2,
    }
}

/// `CUuuid`
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CUuuid {
    /// The 16 raw bytes.
    pub bytes: [c_char; 16],
}

/// `CUipcMemHandle`
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUipcMemHandle {
    /// Opaque handle bytes.
    pub reserved: [c_char; 64],
}

/// `CUDA_ARRAY_DESCRIPTOR` (`cuArrayCreate_v2`)
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    /// Width in elements.
    pub Width: usize,
    /// Height in elements (0 for 1-D).
    pub Height: usize,
    /// Element format.
    pub Format: CUarray_format,
    /// Channels per element (1, 2 or 4).
    pub NumChannels: c_uint,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`cuArray3DCreate_v2`, `cuMipmappedArrayCreate`)
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    /// Width in elements.
    pub Width: usize,
    /// Height in elements (0 for 1-D).
    pub Height: usize,
    /// Depth, or layer count when layered (0 for 1-D/2-D).
    pub Depth: usize,
    /// Element format.
    pub Format: CUarray_format,
    /// Channels per element (1, 2 or 4).
    pub NumChannels: c_uint,
    /// `CUDA_ARRAY3D_*` flags, see [`array3d_flags`].
    pub Flags: c_uint,
}

/// `CUmemLocation` (CUDA 13 turned `id` into a union of the same size).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUmemLocation {
    /// Where the memory lives.
    pub type_: CUmemLocationType,
    /// Device ordinal (for [`CUmemLocationType::DEVICE`]) or NUMA id.
    pub id: c_int,
}

/// `CUmemAllocationProp::allocFlags`
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUmemAllocationPropFlags {
    /// `compressionType`
    pub compressionType: u8,
    /// `gpuDirectRDMACapable`
    pub gpuDirectRDMACapable: u8,
    /// `usage`
    pub usage: c_ushort,
    /// `reserved`
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (`cuMemCreate`, `cuMemGetAllocationGranularity`)
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    /// `type`
    pub type_: CUmemAllocationType,
    /// `requestedHandleTypes`
    pub requestedHandleTypes: c_uint,
    /// Where the memory is created.
    pub location: CUmemLocation,
    /// `win32HandleMetaData`
    pub win32HandleMetaData: *mut c_void,
    /// `allocFlags`
    pub allocFlags: CUmemAllocationPropFlags,
}

/// `CUmemPoolProps` (`cuMemPoolCreate`, graph memory nodes)
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemPoolProps {
    /// `allocType`
    pub allocType: CUmemAllocationType,
    /// `handleTypes`
    pub handleTypes: c_uint,
    /// Where the pool's memory lives.
    pub location: CUmemLocation,
    /// `win32SecurityAttributes`
    pub win32SecurityAttributes: *mut c_void,
    /// `maxSize` (CUDA 12.2+; 0 = default)
    pub maxSize: usize,
    /// `usage` (CUDA 12.6+)
    pub usage: c_ushort,
    /// `reserved`
    pub reserved: [u8; 54],
}

/// `CUmemAccessDesc`
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CUmemAccessDesc {
    /// The accessing location.
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`
    pub flags: c_uint,
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1, `cuGraphAddMemAllocNode`)
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_MEM_ALLOC_NODE_PARAMS {
    /// Pool properties; `location` names the device.
    pub poolProps: CUmemPoolProps,
    /// `accessDescs`
    pub accessDescs: *const CUmemAccessDesc,
    /// `accessDescCount`
    pub accessDescCount: usize,
    /// Requested size.
    pub bytesize: usize,
    /// Out: the node's address.
    pub dptr: CUdeviceptr,
}

/// `CUlaunchAttribute` (only passed through; 72 bytes: id, padding, 64-byte value union).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUlaunchAttribute {
    /// `CUlaunchAttributeID`
    pub id: c_uint,
    /// `pad`
    pub pad: [c_char; 4],
    /// `CUlaunchAttributeValue`, 64 bytes.
    pub value: [u64; 8],
}

/// `CUlaunchConfig` (`cuLaunchKernelEx`)
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUlaunchConfig {
    /// `gridDimX`
    pub gridDimX: c_uint,
    /// `gridDimY`
    pub gridDimY: c_uint,
    /// `gridDimZ`
    pub gridDimZ: c_uint,
    /// `blockDimX`
    pub blockDimX: c_uint,
    /// `blockDimY`
    pub blockDimY: c_uint,
    /// `blockDimZ`
    pub blockDimZ: c_uint,
    /// `sharedMemBytes`
    pub sharedMemBytes: c_uint,
    /// The stream the kernel goes to.
    pub hStream: CUstream,
    /// `attrs`
    pub attrs: *mut CUlaunchAttribute,
    /// `numAttrs`
    pub numAttrs: c_uint,
}

/// `CUDA_KERNEL_NODE_PARAMS_v1` (`cuGraphAddKernelNode`); also the start of `_v2`
/// (`cuGraphAddKernelNode_v2`), which appends `kern` and `ctx`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUDA_KERNEL_NODE_PARAMS_v1 {
    /// `func`
    pub func: CUfunction,
    /// `gridDimX`
    pub gridDimX: c_uint,
    /// `gridDimY`
    pub gridDimY: c_uint,
    /// `gridDimZ`
    pub gridDimZ: c_uint,
    /// `blockDimX`
    pub blockDimX: c_uint,
    /// `blockDimY`
    pub blockDimY: c_uint,
    /// `blockDimZ`
    pub blockDimZ: c_uint,
    /// `sharedMemBytes`
    pub sharedMemBytes: c_uint,
    /// `kernelParams`
    pub kernelParams: *mut *mut c_void,
    /// `extra`
    pub extra: *mut *mut c_void,
}

c_enum! {
    /// `nvmlReturn_t`: any NVML status code.
    nvmlReturn_t(u32), "NVML_ERROR_" {
        SUCCESS = 0 as NVML_SUCCESS,
        UNINITIALIZED = 1,
        INVALID_ARGUMENT = 2,
        NOT_SUPPORTED = 3,
        NO_PERMISSION = 4,
        NOT_FOUND = 6,
        INSUFFICIENT_SIZE = 7,
        DRIVER_NOT_LOADED = 9,
        LIBRARY_NOT_FOUND = 12,
        FUNCTION_NOT_FOUND = 13,
        ARGUMENT_VERSION_MISMATCH = 25,
        UNKNOWN = 999,
    }
}

impl nvmlReturn_t {
    /// `true` for `NVML_SUCCESS`.
    #[inline]
    pub fn is_success(self) -> bool {
        self.0 == 0
    }

    /// `Ok(())` for success, the code otherwise.
    #[inline]
    pub fn ok(self) -> Result<(), nvmlReturn_t> {
        if self.is_success() { Ok(()) } else { Err(self) }
    }
}

/// `CUjit_option` (only passed through, so a plain integer).
pub type CUjit_option = c_uint;
/// `CUlibraryOption` (only passed through, so a plain integer).
pub type CUlibraryOption = c_uint;

/// `nvmlProcessInfo_t` of `nvmlDeviceGetComputeRunningProcesses_v2`/`_v3`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct nvmlProcessInfo_t {
    /// Process id (in the host's PID namespace).
    pub pid: c_uint,
    /// Device memory the process uses, in bytes; [`NVML_VALUE_NOT_AVAILABLE`] when unknown.
    pub usedGpuMemory: u64,
    /// MIG GPU instance (`u32::MAX` when not MIG).
    pub gpuInstanceId: c_uint,
    /// MIG compute instance (`u32::MAX` when not MIG).
    pub computeInstanceId: c_uint,
}

/// NVML's "value not available" (`NVML_VALUE_NOT_AVAILABLE`, `(unsigned long long)-1`).
pub const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;

/// `nvmlMemory_t` (`nvmlDeviceGetMemoryInfo`)
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct nvmlMemory_t {
    /// Total physical memory in bytes.
    pub total: u64,
    /// Unallocated memory in bytes.
    pub free: u64,
    /// Allocated memory in bytes.
    pub used: u64,
}

/// `nvmlMemory_v2_t` (`nvmlDeviceGetMemoryInfo_v2`)
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct nvmlMemory_v2_t {
    /// Must be [`NVML_MEMORY_V2_VERSION`].
    pub version: c_uint,
    /// Total physical memory in bytes.
    pub total: u64,
    /// Memory reserved by the system.
    pub reserved: u64,
    /// Unallocated memory in bytes.
    pub free: u64,
    /// Allocated memory in bytes.
    pub used: u64,
}

/// `nvmlUtilization_t` (`nvmlDeviceGetUtilizationRates`): percentages over the driver's
/// last sample period, which is between 1/6 s and 1 s depending on the product.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct nvmlUtilization_t {
    /// Percent of the period during which one or more kernels ran.
    pub gpu: c_uint,
    /// Percent of the period during which device memory was read or written.
    pub memory: c_uint,
}

/// `nvmlProcessUtilizationSample_t` (`nvmlDeviceGetProcessUtilization`): one process's
/// utilization in one of the driver's sample periods.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct nvmlProcessUtilizationSample_t {
    /// Process id (the host's).
    pub pid: c_uint,
    /// Sample time, microseconds since the epoch.
    pub timeStamp: u64,
    /// SM utilization percent.
    pub smUtil: c_uint,
    /// Memory utilization percent.
    pub memUtil: c_uint,
    /// Encoder utilization percent.
    pub encUtil: c_uint,
    /// Decoder utilization percent.
    pub decUtil: c_uint,
}

/// `nvmlMemory_v2` as `NVML_STRUCT_VERSION(Memory, 2)`: size | (2 << 24).
pub const NVML_MEMORY_V2_VERSION: c_uint =
    core::mem::size_of::<nvmlMemory_v2_t>() as c_uint | (2 << 24);

/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`
pub const NVML_DEVICE_UUID_V2_BUFFER_SIZE: usize = 96;

/// Formats a `CUuuid` the way NVML prints UUIDs: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_gpu_uuid(uuid: &CUuuid) -> String {
    let b = uuid.bytes.map(|c| c.to_ne_bytes()[0]); // c_char: i8 or u8 by target
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (i, byte) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        s.push_str(&format!("{byte:02x}"));
    }
    s
}

// Exact C layouts (x86_64 / aarch64 LP64).
const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<CUresult>() == 4);
    assert!(size_of::<CUdevice>() == 4);
    assert!(size_of::<CUdeviceptr>() == 8);
    assert!(size_of::<CUmemGenericAllocationHandle>() == 8);
    assert!(size_of::<CUuuid>() == 16);
    assert!(size_of::<CUipcMemHandle>() == 64);
    assert!(size_of::<CUDA_ARRAY_DESCRIPTOR>() == 24);
    assert!(offset_of!(CUDA_ARRAY_DESCRIPTOR, Format) == 16);
    assert!(offset_of!(CUDA_ARRAY_DESCRIPTOR, NumChannels) == 20);
    assert!(size_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 40);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, Depth) == 16);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, Format) == 24);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, NumChannels) == 28);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, Flags) == 32);
    assert!(size_of::<CUmemLocation>() == 8);
    assert!(size_of::<CUmemAllocationPropFlags>() == 8);
    assert!(size_of::<CUmemAllocationProp>() == 32);
    assert!(offset_of!(CUmemAllocationProp, location) == 8);
    assert!(offset_of!(CUmemAllocationProp, win32HandleMetaData) == 16);
    assert!(offset_of!(CUmemAllocationProp, allocFlags) == 24);
    assert!(size_of::<CUmemPoolProps>() == 88);
    assert!(offset_of!(CUmemPoolProps, location) == 8);
    assert!(offset_of!(CUmemPoolProps, maxSize) == 24);
    assert!(offset_of!(CUmemPoolProps, usage) == 32);
    assert!(size_of::<CUmemAccessDesc>() == 12);
    assert!(size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>() == 120);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, accessDescs) == 88);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize) == 104);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, dptr) == 112);
    assert!(size_of::<CUlaunchAttribute>() == 72);
    assert!(size_of::<CUlaunchConfig>() == 56);
    assert!(offset_of!(CUlaunchConfig, sharedMemBytes) == 24);
    assert!(offset_of!(CUlaunchConfig, hStream) == 32);
    assert!(offset_of!(CUlaunchConfig, attrs) == 40);
    assert!(offset_of!(CUlaunchConfig, numAttrs) == 48);
    assert!(size_of::<CUDA_KERNEL_NODE_PARAMS_v1>() == 56);
    assert!(offset_of!(CUDA_KERNEL_NODE_PARAMS_v1, kernelParams) == 40);
    assert!(size_of::<nvmlReturn_t>() == 4);
    assert!(size_of::<nvmlMemory_t>() == 24);
    assert!(size_of::<nvmlProcessInfo_t>() == 24);
    assert!(offset_of!(nvmlProcessInfo_t, usedGpuMemory) == 8);
    assert!(size_of::<nvmlMemory_v2_t>() == 40);
    assert!(offset_of!(nvmlMemory_v2_t, total) == 8);
    assert!(offset_of!(nvmlMemory_v2_t, used) == 32);
    assert!(size_of::<nvmlUtilization_t>() == 8);
    assert!(offset_of!(nvmlUtilization_t, memory) == 4);
    assert!(size_of::<nvmlProcessUtilizationSample_t>() == 32);
    assert!(offset_of!(nvmlProcessUtilizationSample_t, smUtil) == 16);
    assert!(align_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 8);
};
