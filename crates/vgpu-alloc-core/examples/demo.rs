//! The core deciding allocations against a limit, with a mock device:
//! `cargo run -p vgpu-alloc-core --example demo`.

use vgpu_alloc_core::{
    AllocError, AllocationKind, Allocator, AllocatorConfig, ContextId, DeviceIndex, InMemoryLedger,
    MAX_DEVICES, MockBackend,
};

const MIB: u64 = 1 << 20;

fn mib(bytes: u64) -> String {
    if bytes < MIB {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The limits a HAMi device plugin would set (`CUDA_DEVICE_MEMORY_LIMIT=1g`,
    // `CUDA_DEVICE_MEMORY_LIMIT_1=512Mi`; vgpu-env parses those in the hook).
    let mut limits = [Some(1 << 30); MAX_DEVICES];
    limits[1] = Some(512 * MIB);
    println!("device 0 limit {:?} bytes", limits[0]);

    let ledger = InMemoryLedger::new(limits);
    let alloc = Allocator::new(AllocatorConfig::default(), MockBackend::new(), ledger)?;
    let (dev, ctx) = (DeviceIndex(0), ContextId(1));

    // A mix of small (sub-allocated) and large (direct) requests until the limit refuses.
    let sizes = [
        4096,
        100,
        300 * MIB,
        1_000_000,
        2 * MIB,
        256 * MIB,
        7 * MIB + 1,
        512 * MIB,
    ];
    let mut live = Vec::new();
    for &size in sizes.iter().cycle() {
        match alloc.allocate(dev, ctx, size) {
            Ok(a) => {
                let how = match a.kind {
                    AllocationKind::SubAllocated => {
                        "sub-allocated: whole 512-byte chunks of a 128 MiB region charged once"
                    }
                    _ => "direct",
                };
                println!(
                    "allocate {size:>10} bytes -> {} ({how}, accounted {}); device 0 in use {}",
                    a.ptr,
                    mib(a.accounted),
                    mib(alloc.usage(dev).used)
                );
                live.push(a.ptr);
            }
            Err(AllocError::OutOfMemory(oom)) => {
                println!("allocate {size:>10} bytes -> refused");
                println!("[vgpu] {oom}");
                break;
            }
            Err(e) => return Err(e.into()),
        }
    }
    println!("zero bytes -> {}", alloc.allocate(dev, ctx, 0).unwrap_err());

    let n = live.len();
    for p in live {
        alloc.free(p)?;
    }
    println!(
        "freed {n} allocations; in use {} (one empty region kept warm for reuse)",
        mib(alloc.usage(dev).used)
    );
    alloc.trim();
    let used = alloc.usage(dev).used;
    println!(
        "after trim: in use {used} bytes, {} regions",
        alloc.stats().regions
    );
    if used != 0 {
        return Err("usage did not return to 0".into());
    }
    Ok(())
}
