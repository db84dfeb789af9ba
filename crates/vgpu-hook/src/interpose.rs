//! Which function a lookup should return: the three ways a program reaches the driver
//! (linked symbols are handled by the exports themselves; `dlsym` and `cuGetProcAddress`
//! are handled here).
//!
//! Rule: a pointer that *is* the real driver's implementation of a hooked symbol is
//! replaced by our wrapper of that same symbol (same ABI by construction). For
//! `cuGetProcAddress` a pointer the real driver returns that is not one of its exported
//! symbols (an internal entry point) falls back to a name + version + stream-flavour
//! lookup in the declaration list. Everything else passes through untouched.
//!
//! Our wrappers' addresses are given (`crate::exports` builds the tables and asks here), so
//! these decisions are tested against any table.

use vgpu_cuda_abi::*;

use crate::ffi::ExportAddrs;
use crate::log::{DEBUG, vlog};
use crate::real;

/// The first driver function the program resolved that can touch device memory and that
/// the hook does not list: its calls would pass no swap gate, so the process is never
/// swapped out (docs/swap.md).
static UNCOVERED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// See [`UNCOVERED`].
pub(crate) fn uncovered_touching() -> Option<&'static str> {
    UNCOVERED.get().map(String::as_str)
}

/// A lookup of `name` answered `answer`: an unlisted function that can touch device memory
/// is answered by a gated slot while this process may swap (`crate::swap::unlisted`); where
/// it has none, the process remembers that it will call such a function ungated.
fn gate_unlisted(name: &[u8], answer: *mut c_void, exports: &ExportAddrs) -> *mut c_void {
    if answer.is_null() || exports.index_of(answer).is_some() {
        return answer;
    }
    let Ok(name) = std::str::from_utf8(name) else {
        return answer;
    };
    if !can_touch_device_memory(name) {
        return answer;
    }
    if crate::swap::unlisted::may_swap()
        && let Some(slot) = crate::swap::unlisted::slot_for(answer)
    {
        vlog!(
            DEBUG,
            "{name}: resolved, can touch device memory: gated by a slot"
        );
        return slot;
    }
    if UNCOVERED.set(name.to_owned()).is_ok() {
        vlog!(
            DEBUG,
            "{name}: resolved, can touch device memory and has no swap gate: no swap-out"
        );
    }
    answer
}

/// Our wrapper for `found`, the real `dlsym` result for `name`, or `found` itself;
/// `cuda_exports` and `nvml_exports` are our exports' addresses.
pub(crate) fn substitute_dlsym(
    name: &[u8],
    found: *mut c_void,
    cuda_exports: &ExportAddrs,
    nvml_exports: &ExportAddrs,
) -> *mut c_void {
    if name.starts_with(b"cu") {
        // The handle may be libcuda itself, opened by the program: loading our table from
        // it is then only a reference-count bump.
        let answer = substitute(name, found, CUDA_HOOKED_SYMBOLS, cuda_exports, || {
            real::cuda().ok().map(|c| |i| c.hooked_addr(i))
        });
        gate_unlisted(name, answer, cuda_exports)
    } else if name.starts_with(b"nvml") {
        substitute(name, found, NVML_HOOKED_SYMBOLS, nvml_exports, || {
            real::nvml().ok().map(|n| |i| n.hooked_addr(i))
        })
    } else {
        found
    }
}

/// The dlsym rule for one library: `found` is replaced by our wrapper of `name` when it is
/// the real library's implementation of that very symbol. Asked by the symbol's own index,
/// not by looking the address up: two hooked symbols the library implements at one address
/// (aliases) then each get their own wrapper, where a lookup would find only the first.
fn substitute<A: Fn(usize) -> usize>(
    name: &[u8],
    found: *mut c_void,
    symbols: &[SymbolInfo],
    exports: &ExportAddrs,
    real_addr: impl FnOnce() -> Option<A>,
) -> *mut c_void {
    let Some(index) = symbols.iter().position(|s| s.name.as_bytes() == name) else {
        return found;
    };
    if exports.index_of(found).is_some() {
        return found; // already ours (RTLD_DEFAULT finds the preloaded export first)
    }
    match real_addr() {
        Some(addr) if found as usize != 0 && addr(index) == found as usize => {
            vlog!(DEBUG, "dlsym({}) -> hook", String::from_utf8_lossy(name));
            exports.get(index)
        }
        _ => found,
    }
}

/// Our wrapper for `found`, what the real `cuGetProcAddress(name, cuda_version, flags)`
/// returned, or `found` itself; `exports` are our CUDA exports' addresses.
pub(crate) fn substitute_proc_address(
    cuda: &real::Cuda,
    exports: &ExportAddrs,
    name: &str,
    found: *mut c_void,
    cuda_version: i32,
    flags: u64,
) -> *mut c_void {
    let answer = proc_address_answer(cuda, exports, name, found, cuda_version, flags);
    gate_unlisted(name.as_bytes(), answer, exports)
}

fn proc_address_answer(
    cuda: &real::Cuda,
    exports: &ExportAddrs,
    name: &str,
    found: *mut c_void,
    cuda_version: i32,
    flags: u64,
) -> *mut c_void {
    if found.is_null() {
        return found;
    }
    if let Some(index) = cuda.hooked_index_of(found as usize) {
        return exports.get(index);
    }
    if exports.index_of(found).is_some() {
        return found;
    }
    // Not an exported symbol of the driver: decide by name, version and stream flavour,
    // as the driver does. Only when the driver has that variant, so our wrapper has a
    // real function to forward to.
    if let Some(sym) = select_variant(CUDA_HOOKED_SYMBOLS, name, cuda_version, flags) {
        if let Some(index) = CUDA_HOOKED_SYMBOLS.iter().position(|s| s.name == sym.name) {
            if cuda.hooked_addr(index) != 0 {
                vlog!(
                    DEBUG,
                    "cuGetProcAddress({name}, {cuda_version}, {flags}): internal entry point replaced by hook {}",
                    sym.name
                );
                return exports.get(index);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_cuda_abi::proc_address_flags::{DEFAULT, PER_THREAD_DEFAULT_STREAM};

    const BASE: usize = 0x7000_0000;

    /// A table of our exports for `n` entries at `OURS + 16 * index` (a test needs only
    /// addresses that are ours and distinct from the library's), leaked as the real ones live
    /// for the program's lifetime.
    fn our_exports(n: usize) -> &'static ExportAddrs {
        const OURS: usize = 0x1_0000_0000;
        let addrs: Vec<*const ()> = (0..n).map(|i| (OURS + 16 * i) as *const ()).collect();
        Box::leak(Box::new(ExportAddrs::new(addrs.leak())))
    }

    fn cuda_exports() -> &'static ExportAddrs {
        our_exports(CUDA_HOOKED_SYMBOLS.len())
    }

    #[test]
    fn dlsym_of_aliased_symbols_gives_each_its_own_wrapper() {
        // A library that implements two hooked symbols at one address: each name's dlsym
        // must still reach its own wrapper (a lookup by address found only the first, and
        // the second passed through to the library unhooked).
        let at = |name: &str| {
            NVML_HOOKED_SYMBOLS
                .iter()
                .position(|s| s.name == name)
                .unwrap()
        };
        let (first, second) = (
            at("nvmlDeviceGetMemoryInfo"),
            at("nvmlDeviceGetMemoryInfo_v2"),
        );
        let nvml_exports = our_exports(NVML_HOOKED_SYMBOLS.len());
        let alias = BASE as *mut c_void;
        let addr = |i: usize| if i == first || i == second { BASE } else { 0 };
        for (name, index) in [
            ("nvmlDeviceGetMemoryInfo", first),
            ("nvmlDeviceGetMemoryInfo_v2", second),
        ] {
            let got = substitute(
                name.as_bytes(),
                alias,
                NVML_HOOKED_SYMBOLS,
                nvml_exports,
                || Some(addr),
            );
            assert_eq!(got, nvml_exports.get(index), "{name}");
        }
        // Not the library's implementation of that symbol, a null result, or no library:
        // passed through.
        let other = (BASE + 16) as *mut c_void;
        let name = b"nvmlDeviceGetMemoryInfo";
        assert_eq!(
            substitute(name, other, NVML_HOOKED_SYMBOLS, nvml_exports, || Some(
                addr
            )),
            other
        );
        let null = std::ptr::null_mut();
        assert_eq!(
            substitute(name, null, NVML_HOOKED_SYMBOLS, nvml_exports, || Some(addr)),
            null
        );
        let none: Option<fn(usize) -> usize> = None;
        assert_eq!(
            substitute(name, alias, NVML_HOOKED_SYMBOLS, nvml_exports, || none),
            alias
        );
    }

    /// A fake driver exporting every hooked symbol at BASE + 16 * index.
    fn driver() -> real::Cuda {
        real::Cuda::fake(
            (0..CUDA_HOOKED_SYMBOLS.len())
                .map(|i| BASE + 16 * i)
                .collect(),
        )
    }

    fn index(name: &str) -> usize {
        CUDA_HOOKED_SYMBOLS
            .iter()
            .position(|s| s.name == name)
            .unwrap()
    }

    fn ours(name: &str) -> *mut c_void {
        cuda_exports().get(index(name))
    }

    #[test]
    fn a_real_hooked_pointer_becomes_our_wrapper_of_the_same_symbol() {
        let cuda = driver();
        for s in CUDA_HOOKED_SYMBOLS {
            let real = (BASE + 16 * index(s.name)) as *mut c_void;
            // Whatever name and version the caller used: the pointer decides.
            assert_eq!(
                substitute_proc_address(&cuda, cuda_exports(), s.base, real, 12000, DEFAULT),
                ours(s.name),
                "{}",
                s.name
            );
        }
    }

    #[test]
    fn an_internal_entry_point_falls_back_to_name_version_and_stream_flavour() {
        let cuda = driver();
        let internal = 0x1234_5000 as *mut c_void;
        for (name, version, flags, want) in [
            ("cuMemAlloc", 12000, DEFAULT, ours("cuMemAlloc_v2")),
            ("cuCtxCreate", 11040, DEFAULT, ours("cuCtxCreate_v3")),
            ("cuCtxCreate", 13000, DEFAULT, ours("cuCtxCreate_v4")),
            (
                "cuLaunchKernel",
                12000,
                PER_THREAD_DEFAULT_STREAM,
                ours("cuLaunchKernel_ptsz"),
            ),
            ("cuLaunchKernel", 12000, DEFAULT, ours("cuLaunchKernel")),
            // A version older than any hooked variant (the 32-bit v1 API): untouched.
            ("cuMemAlloc", 3000, DEFAULT, internal),
        ] {
            assert_eq!(
                substitute_proc_address(&cuda, cuda_exports(), name, internal, version, flags),
                want,
                "{name} {version} {flags}"
            );
        }
    }

    #[test]
    fn an_unlisted_function_that_can_touch_device_memory_is_remembered_once_resolved() {
        // One test only: what it remembers is the process's. Swapping is off in the tests'
        // process, so no slot is handed out and the real pointer comes back.
        let cuda = driver();
        let exports = cuda_exports();
        let p = 0x4343_0000 as *mut c_void;
        // Not touching, ours, or not found: nothing to remember.
        let _ = substitute_proc_address(&cuda, exports, "cuCtxGetFlags", p, 12000, DEFAULT);
        gate_unlisted(b"cuMemcpy3D_v2", std::ptr::null_mut(), exports);
        gate_unlisted(b"cuLaunchKernel", exports.get(0), exports);
        assert_eq!(uncovered_touching(), None);
        assert!(!crate::swap::unlisted::may_swap());
        assert_eq!(
            substitute_dlsym(b"cuMemcpy3D_v2", p, exports, cuda_exports()),
            p
        );
        assert_eq!(uncovered_touching(), Some("cuMemcpy3D_v2"));
        let _ = substitute_proc_address(&cuda, exports, "cuMemcpyPeer", p, 12000, DEFAULT);
        assert_eq!(
            uncovered_touching(),
            Some("cuMemcpy3D_v2"),
            "the first one is named"
        );
    }

    #[test]
    fn everything_else_passes_through() {
        let cuda = driver();
        let p = 0x4242_0000 as *mut c_void;
        assert_eq!(
            substitute_proc_address(&cuda, cuda_exports(), "cuCtxGetFlags", p, 12000, DEFAULT),
            p
        );
        assert_eq!(
            substitute_proc_address(
                &cuda,
                cuda_exports(),
                "cuMemAlloc",
                std::ptr::null_mut(),
                12000,
                DEFAULT
            ),
            std::ptr::null_mut()
        );
        // Our own wrapper stays ours.
        assert_eq!(
            substitute_proc_address(
                &cuda,
                cuda_exports(),
                "cuMemAlloc",
                ours("cuMemAlloc_v2"),
                12000,
                DEFAULT
            ),
            ours("cuMemAlloc_v2")
        );
    }

    #[test]
    fn no_fallback_to_a_variant_the_driver_does_not_have() {
        let mut addrs: Vec<usize> = (0..CUDA_HOOKED_SYMBOLS.len())
            .map(|i| BASE + 16 * i)
            .collect();
        addrs[index("cuCtxCreate_v4")] = 0;
        let cuda = real::Cuda::fake(addrs);
        let internal = 0x1234_5000 as *mut c_void;
        assert_eq!(
            substitute_proc_address(
                &cuda,
                cuda_exports(),
                "cuCtxCreate",
                internal,
                13000,
                DEFAULT
            ),
            internal
        );
    }
}
