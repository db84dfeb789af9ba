//! Cost of one steady-state allocate+free pair, for measuring under callgrind:
//!
//! `pair_cost <pairs> <bytes> [live]` warms one region up, then allocates and frees
//! `bytes` `pairs` times with `live` (default 64) 1 KiB allocations live; with 0 live
//! every free empties the region (the keep-one-warm check runs each time). (run with N − run with 0) / N is the
//! cost of one pair, setup cancelled out. `docs/benchmarks.md` shows the script.

use vgpu_alloc_core::{Allocator, ContextId, DeviceIndex};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (pairs, bytes, live) = match &args[..] {
        [p, b] => (p, b, "64"),
        [p, b, l] => (p, b, l.as_str()),
        _ => {
            eprintln!("usage: pair_cost <pairs> <bytes> [live]");
            std::process::exit(2);
        }
    };
    let live: usize = live.parse().expect("live");
    let pairs: usize = pairs.parse().expect("pairs");
    let bytes: u64 = bytes.parse().expect("bytes");
    let a = Allocator::over_mock(Some(1 << 50));
    let (dev, ctx) = (DeviceIndex(0), ContextId(1));
    let live: Vec<_> = (0..live)
        .map(|_| a.allocate(dev, ctx, 1024).expect("allocate").ptr)
        .collect();
    for _ in 0..pairs {
        let p = a.allocate(dev, ctx, bytes).expect("allocate").ptr;
        a.free(std::hint::black_box(p)).expect("free");
    }
    assert_eq!(a.stats().live_allocations, live.len());
}
