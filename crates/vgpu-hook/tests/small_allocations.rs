//! End to end: small allocations near the limit, through `libvgpu.so` on the simulated
//! driver (Issue 12, defect 10).
//!
//! A program takes a context (64 MiB on the simulated device), holds some memory with one
//! large allocation, then allocates 4 KiB at a time until the driver answers out of memory.
//! Under a limit of `L`, about `(L - context - held) / 4 KiB` of them must fit (within one
//! 2 MiB page), and the first small allocation of a program must not charge more than one
//! page. Needs `libvgpu.so` and `libvgpusim.so` built in the target directory (`cargo xtask
//! test` does that).

use std::process::Command;
use std::sync::OnceLock;

use support::Standalone;

mod support;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;
const SMALL: u64 = 4096;

const PROGRAM: &str = r#"
#include "standalone.h"

typedef unsigned long long P;

int main(int argc, char **argv) {
  if (argc < 3) return 1;
  P held = strtoull(argv[1], 0, 0), small = strtoull(argv[2], 0, 0);
  P max = argc > 3 ? strtoull(argv[3], 0, 0) : ~0ULL;
  int loaded = load_driver();
  if (loaded) return loaded;
  CUresult (*cuCtxCreate_v2)(H *, unsigned, int);
  CUresult (*cuMemAlloc_v2)(P *, size_t);
  CUresult (*cuMemGetInfo_v2)(size_t *, size_t *);
  NEED(cuCtxCreate_v2); NEED(cuMemAlloc_v2); NEED(cuMemGetInfo_v2);
  int dev; H ctx; P p; size_t free0, free1, total;
  CHECK(cuInit(0));
  CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuCtxCreate_v2(&ctx, 0, dev));
  if (held) CHECK(cuMemAlloc_v2(&p, held));
  CHECK(cuMemGetInfo_v2(&free0, &total));
  CHECK(cuMemAlloc_v2(&p, small));
  CHECK(cuMemGetInfo_v2(&free1, &total));
  unsigned long long n = 1;
  CUresult r = 0;
  while (n < max && (r = cuMemAlloc_v2(&p, small)) == 0) n++;
  printf("first_charge=%llu\nfits=%llu\nlast=%d\n", (P)(free0 - free1), n, n < max ? r : 0);
  CHECK(cuMemGetInfo_v2(&free1, &total));
  printf("free_at_end=%llu\n", (P)free1);
  return 0;
}
"#;

fn env() -> &'static Standalone {
    static ENV: OnceLock<Standalone> = OnceLock::new();
    ENV.get_or_init(|| support::standalone("small-allocs", "fill", PROGRAM))
}

/// Runs the program under `limit` holding `held` bytes; returns its `key=value` lines.
/// Stops after `max` small allocations (when given).
fn fill(limit: &str, held: u64, max: Option<u64>) -> support::Out {
    let e = env();
    let mut cmd = Command::new(&e.program);
    vgpu_testkit::clear_runner_settings(&mut cmd);
    cmd.arg(held.to_string()).arg(SMALL.to_string());
    if let Some(max) = max {
        cmd.arg(max.to_string());
    }
    let out = cmd
        .env("LD_PRELOAD", &e.hook)
        .env("LD_LIBRARY_PATH", &e.dir)
        .env("CUDA_DEVICE_MEMORY_LIMIT", limit)
        .env(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            e.dir.join(format!("{limit}-{held}.cache")),
        )
        .env("VGPU_SIM_TOTAL_MEM", "4g")
        .env("VGPU_SIM_CTX_OVERHEAD", "64m")
        .env("VGPU_SIM_MODULE_OVERHEAD", "0")
        .output()
        .expect("run the test program");
    let o = support::Out::parse(
        &String::from_utf8_lossy(&out.stdout),
        &String::from_utf8_lossy(&out.stderr),
        out.status.code(),
    );
    assert_eq!(o.status, Some(0), "{o}");
    o
}

#[test]
fn near_the_limit_small_allocations_fill_it_to_within_one_page() {
    // 300 MiB limit, a 64 MiB context, 200 MiB held: 36 MiB remain for 4 KiB requests.
    let o = fill("300m", 200 * MIB, None);
    let room = 300 * MIB - 64 * MIB - 200 * MIB;
    let fits = o.u("fits");
    assert_eq!(o.get("last"), "2", "stopped by CUDA_ERROR_OUT_OF_MEMORY");
    assert!(
        fits * SMALL <= room,
        "{fits} allocations of 4 KiB exceed the {room} bytes left"
    );
    assert!(
        fits * SMALL + PAGE >= room,
        "only {fits} allocations of 4 KiB fit in {room} bytes (about {} should)",
        room / SMALL
    );
    assert!(
        o.u("free_at_end") < PAGE,
        "less than a page left: {}",
        o.stdout
    );
}

#[test]
fn the_first_small_allocation_charges_one_page_not_a_region() {
    let o = fill("1g", 0, Some(1));
    assert!(
        o.u("first_charge") <= PAGE,
        "a 4 KiB allocation charged {} bytes",
        o.u("first_charge")
    );
}
