//! Writes the version script that keeps exactly the hooked driver/NVML symbols and `dlsym`
//! global in `libvgpu.so` (everything else, Rust's own symbols included, stays local).
//! Needs no CUDA: the symbol names come from `vgpu-cuda-abi`'s declaration lists.

use std::fmt::Write as _;

fn main() {
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let mut script = String::from("{\n  global:\n    dlsym;\n");
    for s in vgpu_cuda_abi::CUDA_HOOKED_SYMBOLS
        .iter()
        .chain(vgpu_cuda_abi::NVML_HOOKED_SYMBOLS)
    {
        let _ = writeln!(script, "    {};", s.name);
    }
    script.push_str("  local:\n    *;\n};\n");
    let path = out.join("libvgpu.version");
    std::fs::write(&path, script).expect("write version script");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        path.display()
    );
    // dlvsym/dlopen live in libdl on glibc < 2.34 (a stub library on newer ones).
    println!("cargo:rustc-link-lib=dl");
    println!("cargo:rerun-if-changed=build.rs");
}
