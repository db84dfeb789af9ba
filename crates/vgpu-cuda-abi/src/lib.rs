//! CUDA driver and NVML ABI for vgpu: `#[repr(transparent)]` driver types with exact C
//! layouts, and THE declaration list of hooked symbols ([`cuda_hooked_functions!`],
//! [`nvml_hooked_functions!`]) that drives the hook's exports, its real-function table and
//! its `dlsym`/`cuGetProcAddress` tables, and that the simulated driver reuses.
//!
//! Layout: `symbols` (the declaration lists, [`SymbolInfo`] and the `cuGetProcAddress`
//! variant choice), `types` (the driver and NVML types, constants and flags), and [`pfn`]
//! (one function-pointer type per listed symbol, generated from the lists).
//!
//! This crate only declares; it contains no code that calls into a driver, and no unsafe
//! code (the lint holds where its macros expand: in the crate that invokes them).

#![forbid(unsafe_code)]
#![allow(non_camel_case_types, non_snake_case)]

mod symbols;
mod types;

pub use core::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
pub use symbols::*;
pub use types::*;

/// `unsafe extern "C" fn` pointer types of every listed function, named after the symbol
/// (`pfn::cuMemAlloc_v2`).
pub mod pfn {
    use crate::*;

    macro_rules! pfn_types {
        ($( $name:ident [$base:literal, $ver:literal, $kind:ident $(, $touches:ident)?] fn($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty; )*) => {
            $(
                #[doc = concat!("`", stringify!($name), "`")]
                pub type $name = unsafe extern "C" fn($($ty),*) -> $ret;
            )*
        };
    }

    cuda_hooked_functions!(pfn_types);
    cuda_used_functions!(pfn_types);
    nvml_hooked_functions!(pfn_types);
    nvml_used_functions!(pfn_types);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_codes_survive_a_round_trip() {
        let newer = CUresult(12345);
        assert!(!newer.is_success());
        assert_eq!(newer.name(), None);
        assert_eq!(format!("{newer:?}"), "CUresult(12345)");
        assert_eq!(format!("{:?}", CUresult::OUT_OF_MEMORY), "OUT_OF_MEMORY(2)");
        assert_eq!(CUresult::SUCCESS.ok(), Ok(()));
        assert_eq!(CUresult::INVALID_VALUE.ok(), Err(CUresult::INVALID_VALUE));
    }

    #[test]
    fn uuid_formats_like_nvml() {
        let mut u = CUuuid::default();
        for (i, b) in u.bytes.iter_mut().enumerate() {
            *b = (i as u8 * 17) as c_char;
        }
        assert_eq!(
            format_gpu_uuid(&u),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn nvml_memory_v2_version_matches_nvml_h() {
        // NVML_STRUCT_VERSION(Memory, 2) = sizeof(nvmlMemory_v2_t) | 2 << 24.
        assert_eq!(NVML_MEMORY_V2_VERSION, 0x0200_0028);
    }
}
