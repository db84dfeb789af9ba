//! Cost of `Allocator::free` with N allocations live, for measuring under callgrind
//! (instruction counts and simulated cache misses do not depend on machine load):
//!
//! `free_cost <live> <frees> <sub|direct> <random|newest> <0|1>` allocates live+frees
//! allocations, picks `frees` victims (random, or the newest) and frees them when the
//! last argument is 1. The difference between the runs with 1 and 0, divided by `frees`,
//! is the cost of one free. `docs/benchmarks.md` shows the script.

use vgpu_alloc_core::{Allocator, ContextId, DeviceIndex, DevicePtr};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [live, frees, kind, pattern, run] = &args[..] else {
        eprintln!("usage: free_cost <live> <frees> <sub|direct> <random|newest> <0|1>");
        std::process::exit(2);
    };
    let live: usize = live.parse().expect("live");
    let frees: usize = frees.parse().expect("frees");
    let size = if kind == "sub" { 1024 } else { 2 << 20 };
    let a = Allocator::over_mock(Some(1 << 50));
    let mut ptrs: Vec<DevicePtr> = (0..live + frees)
        .map(|_| {
            a.allocate(DeviceIndex(0), ContextId(1), size)
                .expect("allocate")
                .ptr
        })
        .collect();
    let victims: Vec<DevicePtr> = if pattern == "newest" {
        ptrs.split_off(live).into_iter().rev().collect()
    } else {
        // Fisher-Yates with a fixed xorshift seed: both runs pick the same victims.
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for i in (1..ptrs.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ptrs.swap(i, (x % (i as u64 + 1)) as usize);
        }
        ptrs.truncate(frees);
        ptrs
    };
    if run == "1" {
        for p in &victims {
            a.free(*p).expect("free");
        }
    }
    assert_eq!(
        a.stats().live_allocations,
        live + frees * usize::from(run != "1")
    );
}
