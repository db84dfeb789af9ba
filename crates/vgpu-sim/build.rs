//! Link flags for the simulated driver.
//!
//! `-Bsymbolic-functions` binds the library's own references to its own functions, as the real
//! `libcuda.so` does: the pointers `cuGetProcAddress` hands out cannot then be interposed by a
//! preloaded library's symbols of the same name, so a hook that misses `cuGetProcAddress` is seen
//! to miss it. The soname is the real driver's, so programs linked with `-lcuda` against the
//! symlinked library record `libcuda.so.1`, as they would against the real one.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
