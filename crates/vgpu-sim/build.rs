//! Link flags for the simulated driver.
//!
//! `-Bsymbolic` binds the library's own references to its own functions, as the real
//! `libcuda.so` does: the pointers `cuGetProcAddress` hands out cannot then be interposed by a
//! preloaded library's symbols of the same name, so a hook that misses `cuGetProcAddress` is seen
//! to miss it. (`-Bsymbolic-functions` would say only that, but zig's linker, which the release
//! build uses for its glibc 2.17 floor, does not take it; the library exports no data, so the
//! two bind the same references.) The soname is the real driver's, so programs linked with `-lcuda` against the
//! symlinked library record `libcuda.so.1`, as they would against the real one.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
