use super::*;
use crate::machine::SimConfig;
use std::collections::HashMap;

fn sim(pairs: &[(&str, &str)]) -> &'static Sim {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let s: &'static Sim = Box::leak(Box::new(Sim::new(
        SimConfig::from_lookup(|k| m.get(k).cloned()).unwrap(),
    )));
    s.init(0).unwrap();
    s
}

/// A test's own buffer as a copy's host side.
#[allow(unsafe_code)]
/// (`buf` is the memory itself: a slice or a plain value, never a `Vec`.)
fn host_ptr<T: ?Sized>(buf: &mut T) -> Addr {
    // SAFETY: each test's synchronous copy uses the buffer within its borrow.
    Addr::Host(unsafe { HostPtr::new(buf as *mut T as *mut u8 as u64) })
}

fn used(s: &Sim, p: usize) -> u64 {
    s.devices[p].used.load(Ordering::SeqCst)
}

/// A simulator configured by `pairs`, with a context created (and current) on device 0.
fn in_context(pairs: &[(&str, &str)]) -> &'static Sim {
    let s = sim(pairs);
    s.ctx_create(0, 0).unwrap();
    s
}

/// A new stream of the current context, capturing in `mode`.
fn capturing(s: &Sim, mode: u32) -> u64 {
    let st = s.stream_create(0).unwrap();
    s.begin_capture(st, mode).unwrap();
    st
}

#[test]
fn allocations_are_counted_limited_and_freed() {
    let s = sim(&[
        ("VGPU_SIM_TOTAL_MEM", "1g"),
        ("VGPU_SIM_CTX_OVERHEAD", "1m"),
    ]);
    assert_eq!(s.mem_alloc(10), Err(CUDA_ERROR_INVALID_CONTEXT));
    let ctx = s.primary_retain(0).unwrap();
    s.set_current(ctx).unwrap();
    assert_eq!(used(s, 0), 1 << 20);
    let a = s.mem_alloc(1000).unwrap();
    assert_eq!(used(s, 0), (1 << 20) + 1024);
    assert_eq!(s.mem_alloc(1 << 30), Err(CUDA_ERROR_OUT_OF_MEMORY));
    assert_eq!(s.address_range(a + 999).unwrap(), (a, 1000));
    s.memset(a, 7, 1, 1000).unwrap();
    let mut host = vec![0u8; 1000];
    s.memcpy(host_ptr(host.as_mut_slice()), Addr::Device(a), 1000)
        .unwrap();
    assert!(host.iter().all(|&b| b == 7));
    assert_eq!(
        s.memcpy(host_ptr(host.as_mut_slice()), Addr::Device(a), 5000),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(s.mem_free(a + 1), Err(CUDA_ERROR_INVALID_VALUE));
    s.mem_free(a).unwrap();
    assert_eq!(s.mem_free(a), Err(CUDA_ERROR_INVALID_VALUE));
    s.primary_release(0).unwrap();
    assert_eq!(used(s, 0), 0);
}

#[test]
fn destroying_a_context_frees_what_it_owns() {
    let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let c = s.ctx_create(0, 0).unwrap();
    s.mem_alloc(1 << 20).unwrap();
    s.array_create(ArrayDesc {
        width: 64,
        height: 64,
        format: 0x20,
        channels: 4,
        ..Default::default()
    })
    .unwrap();
    assert!(used(s, 0) > 0);
    s.ctx_destroy(c).unwrap();
    assert_eq!(used(s, 0), 0);
    assert_eq!(s.current(), Err(CUDA_ERROR_INVALID_CONTEXT));
}

#[test]
fn vmm_counts_on_create_and_frees_after_release_and_unmap() {
    let s = sim(&[
        ("VGPU_SIM_DEVICE_COUNT", "2"),
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
    ]);
    let c = s.ctx_create(0, 0).unwrap();
    assert_eq!(
        s.mem_create(1 << 20, Some(1), [0; 32]),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    let h = s.mem_create(4 << 20, Some(1), [0; 32]).unwrap();
    assert_eq!(used(s, 1), 4 << 20);
    let va = s.address_reserve(8 << 20, 0).unwrap();
    s.mem_map(va, 4 << 20, 0, h).unwrap();
    s.mem_map(va + (4 << 20), 4 << 20, 0, h).unwrap();
    s.set_access(va, 8 << 20).unwrap();
    s.memset(va, 0xabcd, 4, 1).unwrap();
    let mut w = 0u32;
    s.memcpy(host_ptr(&mut w), Addr::Device(va + (4 << 20)), 4)
        .unwrap();
    assert_eq!(w, 0xabcd, "both mappings alias one physical allocation");
    assert_eq!(s.address_range(va + 5).unwrap(), (va, 4 << 20));
    s.mem_release(h).unwrap();
    assert_eq!(used(s, 1), 4 << 20, "still mapped");
    s.mem_unmap(va, 8 << 20).unwrap();
    assert_eq!(used(s, 1), 0);
    s.address_free(va, 8 << 20).unwrap();
    s.ctx_destroy(c).unwrap();
}

#[test]
fn pools_reserve_blocks_and_release_at_sync() {
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let pool = s.default_pool(0).unwrap();
    let a = s.alloc_async(1000, 0, StreamArg::legacy(0)).unwrap();
    assert_eq!(s.pool_get_attr(pool, 5).unwrap(), GRANULARITY);
    assert_eq!(s.pool_get_attr(pool, 7).unwrap(), GRANULARITY);
    s.pool_set_attr(pool, 4, u64::MAX).unwrap();
    s.free_async(a, StreamArg::legacy(0)).unwrap();
    s.stream_sync(StreamArg::legacy(0)).unwrap();
    assert_eq!(s.pool_get_attr(pool, 7).unwrap(), 0);
    assert_eq!(
        s.pool_get_attr(pool, 5).unwrap(),
        GRANULARITY,
        "kept below the threshold"
    );
    assert_eq!(used(s, 0), GRANULARITY);
    let b = s.alloc_async(10, 0, StreamArg::legacy(0)).unwrap();
    assert_eq!(b, a, "block reused");
    s.mem_free(b).unwrap();
    s.pool_trim(pool, 0).unwrap();
    assert_eq!(used(s, 0), 0);
}

#[test]
fn a_pool_block_costs_its_overhead_outside_what_the_pool_reports() {
    let s = in_context(&[
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
        ("VGPU_SIM_POOL_BLOCK_OVERHEAD", "2m"),
    ]);
    let pool = s.default_pool(0).unwrap();
    let a = s.alloc_async(3 << 20, 0, StreamArg::legacy(0)).unwrap();
    let b = s.alloc_async(1 << 20, 0, StreamArg::legacy(0)).unwrap();
    let reserved = s.pool_get_attr(pool, 5).unwrap();
    assert_eq!(reserved, 6 << 20, "two blocks: 4 MiB and 2 MiB");
    assert_eq!(used(s, 0), reserved + (4 << 20), "2 MiB more per block");
    s.free_async(a, StreamArg::legacy(0)).unwrap();
    s.free_async(b, StreamArg::legacy(0)).unwrap();
    s.stream_sync(StreamArg::legacy(0)).unwrap();
    s.pool_trim(pool, 0).unwrap();
    assert_eq!(used(s, 0), 0, "the overhead goes with its block");
}

#[test]
fn module_code_takes_memory_at_load_when_eager_and_at_first_launch_when_lazy() {
    const MOD: u64 = 8 << 20;
    let launch_fill = |s: &'static Sim, f: u64| {
        let (kernel, dev) = s.function_to_launch(f)?;
        let l = Launch {
            kernel,
            dev,
            grid: [1; 3],
            block: [1; 3],
            args: vec![0; 20],
        };
        s.launch(l, StreamArg::legacy(0))
    };
    let eager = sim(&[
        ("CUDA_MODULE_LOADING", "EAGER"),
        ("VGPU_SIM_MODULE_OVERHEAD", "8m"),
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
    ]);
    eager.ctx_create(0, 0).unwrap();
    let m = eager.module_load(b"vgpusim-module: fill").unwrap();
    assert_eq!(used(eager, 0), MOD);
    eager.module_unload(m).unwrap();
    assert_eq!(used(eager, 0), 0);

    let lazy = sim(&[
        ("VGPU_SIM_MODULE_OVERHEAD", "8m"),
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
        ("VGPU_SIM_TOTAL_MEM", "12m"),
    ]);
    assert!(
        lazy.cfg.lazy_loading,
        "lazy is the default, as with the real driver"
    );
    lazy.ctx_create(0, 0).unwrap();
    let m = lazy.module_load(b"vgpusim-module: fill").unwrap();
    let f = lazy.get_function(m, "fill").unwrap();
    assert_eq!(
        used(lazy, 0),
        0,
        "nothing on the device before the first launch"
    );
    launch_fill(lazy, f).unwrap();
    assert_eq!(used(lazy, 0), MOD, "loaded by the first launch");
    launch_fill(lazy, f).unwrap();
    assert_eq!(used(lazy, 0), MOD, "once");
    lazy.module_unload(m).unwrap();
    assert_eq!(used(lazy, 0), 0);
    // A device too full for the code: the launch fails with out of memory.
    let big = lazy.mem_alloc(8 << 20).unwrap();
    let m = lazy.module_load(b"vgpusim-module: fill").unwrap();
    let f = lazy.get_function(m, "fill").unwrap();
    assert_eq!(launch_fill(lazy, f), Err(CUDA_ERROR_OUT_OF_MEMORY));
    lazy.mem_free(big).unwrap();
    launch_fill(lazy, f).unwrap();
    assert_eq!(used(lazy, 0), MOD);
}

/// Queues `spin` for `ms` milliseconds on `stream` through the launch call's path.
fn spin_on(s: &'static Sim, f: u64, stream: u64, ms: u64) -> CuResult<()> {
    let (kernel, dev) = s.function_for_launch_call(f)?;
    let args = (ms * 1_000_000).to_le_bytes().to_vec();
    let l = Launch {
        kernel,
        dev,
        grid: [1; 3],
        block: [1; 3],
        args,
    };
    s.launch(l, StreamArg::legacy(stream))
}

#[test]
fn a_functions_first_launch_waits_for_the_context_when_lazy() {
    for eager in [false, true] {
        let pairs: &[(&str, &str)] = if eager {
            &[("CUDA_MODULE_LOADING", "EAGER")]
        } else {
            &[("CUDA_MODULE_LOADING", "LAZY")]
        };
        let s = in_context(pairs);
        let m = s.module_load(b"vgpusim-module: spin other").unwrap();
        let spin = s.get_function(m, "spin").unwrap();
        let other = s.get_function(m, "other").unwrap();
        let (a, b) = (s.stream_create(0).unwrap(), s.stream_create(0).unwrap());
        let busy = |q: u64| s.stream_query(StreamArg::legacy(q)) == Err(CUDA_ERROR_NOT_READY);
        // Eager: launches queue and return at once, whatever runs.
        spin_on(s, spin, a, 300).unwrap();
        spin_on(s, spin, b, 0).unwrap();
        if eager {
            assert!(busy(a), "eager: no launch waits");
            s.ctx_sync(0).unwrap();
            continue;
        }
        // Lazy: spin's first launch (on `a`, idle) loads it; its second (on `b`) and a second
        // handle to it need no load.
        assert!(busy(a), "the first launch found nothing queued to wait for");
        let again = s.get_function(m, "spin").unwrap();
        spin_on(s, again, b, 0).unwrap();
        assert!(busy(a), "spin is loaded: no wait");
        // `other`'s first launch, on another stream, waits for every stream of the context.
        let (kernel, _) = s.function_for_launch_call(other).unwrap();
        assert_eq!(kernel, Kernel::Noop);
        assert!(!busy(a) && !busy(b), "the context drained inside the call");
        spin_on(s, spin, a, 300).unwrap();
        s.function_for_launch_call(other).unwrap();
        assert!(busy(a), "once only");
        s.ctx_sync(0).unwrap();
        // Per context: the same module image loaded in another context loads anew.
        let ctx2 = s.ctx_create(0, 0).unwrap();
        let m2 = s.module_load(b"vgpusim-module: spin other").unwrap();
        let other2 = s.get_function(m2, "other").unwrap();
        let c = s.stream_create(0).unwrap();
        spin_on(s, s.get_function(m2, "spin").unwrap(), c, 300).unwrap();
        s.function_for_launch_call(other2).unwrap();
        assert!(!busy(c), "a first launch in the new context");
        s.ctx_destroy(ctx2).unwrap();
    }
}

#[test]
fn a_first_launch_behind_a_stream_waiting_for_the_caller_hangs_when_lazy() {
    // What hung PyTorch on the H200 under the SM limiter's gate: a stream waits on a host
    // word the launching thread writes only after the launch call returns. Here another
    // thread writes it late, and the call returns only then.
    let s = in_context(&[]);
    let m = s.module_load(b"vgpusim-module: spin").unwrap();
    let spin = s.get_function(m, "spin").unwrap();
    let st = s.stream_create(0).unwrap();
    let word = s.host_alloc(4096, 0).unwrap();
    s.stream_wait_value32(StreamArg::legacy(st), word, 1, 0)
        .unwrap();
    let opened = Arc::new(AtomicBool::new(false));
    let opener = {
        let opened = opened.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            opened.store(true, Ordering::SeqCst);
            s.set_now(word, 1, 4, 1).unwrap();
        })
    };
    spin_on(s, spin, st, 0).unwrap();
    assert!(
        opened.load(Ordering::SeqCst),
        "the first launch returned before the stream's wait was met"
    );
    opener.join().unwrap();
    // Loaded now: the same wait no longer holds a launch call.
    s.stream_wait_value32(StreamArg::legacy(st), word, 2, 0)
        .unwrap();
    spin_on(s, spin, st, 0).unwrap();
    assert_eq!(
        s.stream_query(StreamArg::legacy(st)),
        Err(CUDA_ERROR_NOT_READY)
    );
    s.set_now(word, 2, 4, 1).unwrap();
    s.stream_sync(StreamArg::legacy(st)).unwrap();
}

#[test]
fn kernels_run_on_streams_and_events_time_them() {
    let s = in_context(&[]);
    let m = s.module_load(b"vgpusim-module: spin fill").unwrap();
    let f = s.get_function(m, "spin").unwrap();
    assert_eq!(s.get_function(m, "nope"), Err(CUDA_ERROR_NOT_FOUND));
    let (k, dev) = s.function(f).unwrap();
    let st = s.stream_create(0).unwrap();
    let (e1, e2) = (s.event_create(0).unwrap(), s.event_create(0).unwrap());
    s.event_record(e1, StreamArg::legacy(st)).unwrap();
    let l = Launch {
        kernel: k,
        dev,
        grid: [1; 3],
        block: [1; 3],
        args: 20_000_000u64.to_le_bytes().to_vec(),
    };
    s.launch(l, StreamArg::legacy(st)).unwrap();
    s.event_record(e2, StreamArg::legacy(st)).unwrap();
    assert_eq!(s.event_query(e2), Err(CUDA_ERROR_NOT_READY));
    s.event_sync(e2).unwrap();
    let ms = s.event_elapsed(e1, e2).unwrap();
    assert!((19.0..200.0).contains(&ms), "{ms}");
    assert!(s.devices[0].busy.percent(Duration::from_secs(1)) >= 1);
}

#[test]
fn ptx_images_name_their_entries() {
    let ptx = b".version 7.0\n.visible .entry spin(\n.param .u64 a)\n{}\n.visible .entry fill(.param .u64 p)";
    assert_eq!(Sim::parse_image(ptx).unwrap(), vec!["spin", "fill"]);
    assert_eq!(Sim::parse_image(b"\x7fELF"), Err(CUDA_ERROR_INVALID_IMAGE));
}

#[test]
fn capture_and_graph_memory() {
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let st = capturing(s, 0);
    let l = Launch {
        kernel: Kernel::Noop,
        dev: 0,
        grid: [1; 3],
        block: [1; 3],
        args: vec![],
    };
    s.launch(l, StreamArg::legacy(st)).unwrap();
    let g = s.end_capture(st).unwrap();
    assert_eq!(s.graph_nodes(g).unwrap().len(), 1);
    let (_, p) = s.graph_add_mem_alloc(g, 0, 3 << 20).unwrap();
    s.graph_add_mem_free(g, p).unwrap();
    let e = s.graph_instantiate(g).unwrap();
    s.graph_upload(e, StreamArg::legacy(st)).unwrap();
    assert_eq!(used(s, 0), 4 << 20, "uploading takes the graph's memory");
    assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0, "reserved, not in use");
    s.graph_launch(e, StreamArg::legacy(st)).unwrap();
    assert_eq!(used(s, 0), 4 << 20);
    s.stream_sync(StreamArg::legacy(st)).unwrap();
    assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0);
    assert_eq!(s.graph_mem_attr(0, 2).unwrap(), 4 << 20);
    s.graph_mem_trim(0).unwrap();
    assert_eq!(used(s, 0), 0);
}

#[test]
fn stream_ordered_allocation_in_a_capture_becomes_graph_memory() {
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let st = capturing(s, 0);
    let p = s.alloc_async(3 << 20, 0, StreamArg::legacy(st)).unwrap();
    assert_eq!(used(s, 0), 0, "nothing is taken while capturing");
    let g = s.end_capture(st).unwrap();
    let e = s.graph_instantiate(g).unwrap();
    s.graph_launch(e, StreamArg::legacy(st)).unwrap();
    s.stream_sync(StreamArg::legacy(st)).unwrap();
    assert_eq!(used(s, 0), 4 << 20);
    s.memset(p, 1, 1, 3 << 20).unwrap();
    // Freed outside its graph, it stays reserved for graphs until trimmed.
    s.free_async(p, StreamArg::legacy(st)).unwrap();
    s.stream_sync(StreamArg::legacy(st)).unwrap();
    assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0);
    assert_eq!(used(s, 0), 4 << 20);
    s.graph_mem_trim(0).unwrap();
    assert_eq!(used(s, 0), 0);
}

#[test]
fn pool_queries_invalidate_a_global_capture_but_not_a_relaxed_one() {
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let pool = s.default_pool(0).unwrap();
    let st = capturing(s, 0);
    assert_eq!(
        s.pool_get_attr(pool, 5),
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    );
    assert_eq!(s.is_capturing(st), Ok(2));
    assert_eq!(
        s.end_capture(st),
        Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    );
    s.begin_capture(st, 2).unwrap();
    assert_eq!(s.pool_get_attr(pool, 5), Ok(0));
    assert!(s.end_capture(st).is_ok());
    assert_eq!(
        s.pool_get_attr(pool, 5),
        Ok(0),
        "no capture, no restriction"
    );
}

#[test]
fn faults_fire_on_the_nth_call() {
    let s = sim(&[("VGPU_SIM_FAULTS", "cuMemAlloc_v2:2:1234")]);
    assert_eq!(s.fault("cuMemAlloc_v2", true), Ok(()));
    assert_eq!(s.fault("cuMemAlloc_v2", true), Err(1234));
    assert_eq!(s.fault("cuMemAlloc_v2", true), Ok(()));
}

/// A recognizable pattern of `n` bytes.
fn pattern(n: u64, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8 ^ seed)
        .collect()
}

/// The `n` bytes at device address `p`.
fn read_back(s: &Sim, p: u64, n: u64) -> Vec<u8> {
    let mut out = vec![0u8; n as usize];
    s.memcpy(host_ptr(out.as_mut_slice()), Addr::Device(p), n)
        .unwrap();
    out
}

#[test]
fn a_small_device_is_full_at_its_size_and_host_memory_does_not_count() {
    let s = in_context(&[
        ("VGPU_SIM_TOTAL_MEM", "64m"),
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
    ]);
    assert_eq!(s.mem_info().unwrap(), (64 << 20, 64 << 20));
    let a = s.mem_alloc(48 << 20).unwrap();
    assert_eq!(s.mem_alloc(32 << 20), Err(CUDA_ERROR_OUT_OF_MEMORY));
    // Past the device's size, host memory still works and is not device memory.
    let pinned = s.host_alloc(32 << 20, 0).unwrap();
    let located = s.mem_create(32 << 20, None, [0; 32]).unwrap();
    assert_eq!(used(s, 0), 48 << 20, "neither is counted on the device");
    assert_eq!(s.mem_info().unwrap(), (16 << 20, 64 << 20));
    assert_eq!(s.nvml_memory(0), (64 << 20, 16 << 20, 48 << 20));
    assert_eq!(s.process_usage(0).0, 48 << 20);
    assert_eq!(s.host.used(), 64 << 20, "both are counted on the host");
    s.host_free(pinned).unwrap();
    s.mem_release(located).unwrap();
    s.mem_free(a).unwrap();
    assert_eq!((used(s, 0), s.host.used()), (0, 0));
}

#[test]
fn pinned_host_memory_is_reachable_at_its_device_pointer() {
    let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    assert_eq!(s.host_alloc(4096, 2), Err(CUDA_ERROR_INVALID_CONTEXT));
    s.ctx_create(0, 0).unwrap();
    assert_eq!(s.host_alloc(4096, 0x8), Err(CUDA_ERROR_INVALID_VALUE));
    let h = s.host_alloc(3 << 20, 0x3).unwrap();
    assert_eq!(s.host_flags(h + 5), Ok(0x3));
    let d = s.host_device_pointer(h + 4096, 0).unwrap();
    assert_eq!(
        d,
        h + 4096,
        "unified addressing: the device pointer is the host address"
    );
    assert_eq!(s.host_device_pointer(h, 1), Err(CUDA_ERROR_INVALID_VALUE));
    let mut pageable = vec![0u8; 64];
    let pageable_addr = pageable.as_mut_ptr() as u64;
    assert_eq!(
        s.host_device_pointer(pageable_addr, 0),
        Err(CUDA_ERROR_INVALID_VALUE),
        "pageable memory has no device pointer"
    );
    // Device-side writes (memset, the fill kernel) land in the host memory.
    s.memset(d, 0x7e, 1, 4096).unwrap();
    let l = Launch {
        kernel: Kernel::Fill,
        dev: 0,
        grid: [1; 3],
        block: [1; 3],
        args: [d + 4096, 0xdead_beef_u32 as u64]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .take(12)
            .chain(2u64.to_le_bytes())
            .collect(),
    };
    s.launch(l, StreamArg::legacy(0)).unwrap();
    s.ctx_sync(0).unwrap();
    assert!(read_back(s, h + 4096, 4096).iter().all(|&b| b == 0x7e));
    assert_eq!(
        read_back(s, h + 8192, 8),
        [0xef, 0xbe, 0xad, 0xde, 0xef, 0xbe, 0xad, 0xde]
    );
    assert_eq!(
        s.memset(h + (3 << 20) - 4, 0, 1, 8),
        Err(CUDA_ERROR_INVALID_VALUE),
        "past the allocation"
    );
    assert_eq!(
        s.pointer_attr(2, d),
        Ok(PtrAttr::U32(1)),
        "CU_MEMORYTYPE_HOST"
    );
    assert_eq!(s.pointer_attr(4, d), Ok(PtrAttr::U64(d)));
    assert_eq!(s.pointer_attr(11, d), Ok(PtrAttr::U64(h)));
    assert_eq!(used(s, 0), 0, "pinned memory is not device memory");
    s.host_free(h).unwrap();
    assert_eq!(s.host_device_pointer(d, 0), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(s.host.used(), 0);
}

#[test]
fn registered_host_memory_is_reachable_and_registered_once() {
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let mut buf = vec![0u8; 3 * 4096];
    let p = buf.as_mut_ptr() as u64;
    #[allow(unsafe_code)]
    // SAFETY: `buf` outlives the registration (unregistered below, before it drops).
    let ptr = unsafe { HostPtr::new(p) };
    s.host_register(ptr, 8192, 0x2).unwrap();
    assert!(s.host.used() >= 8192, "page-rounded on the host");
    assert_eq!(
        s.host_register(ptr, 4096, 0),
        Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    );
    assert_eq!(s.host_device_pointer(p + 100, 0), Ok(p + 100));
    s.memset(p + 100, 0x11, 1, 50).unwrap();
    assert_eq!(
        s.memset(p + 8190, 0, 1, 4),
        Err(CUDA_ERROR_INVALID_VALUE),
        "past the registered range"
    );
    assert_eq!(
        s.host_unregister(p + 1),
        Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
    );
    s.host_unregister(p).unwrap();
    assert_eq!(s.host.used(), 0);
    assert_eq!(s.host_device_pointer(p, 0), Err(CUDA_ERROR_INVALID_VALUE));
    assert!(buf[100..150].iter().all(|&b| b == 0x11));
    assert_eq!((buf[99], buf[150]), (0, 0));
}

#[test]
fn a_vmm_allocation_moves_between_host_and_device_at_one_address() {
    const SZ: u64 = 8 << 20;
    let s = in_context(&[
        ("VGPU_SIM_TOTAL_MEM", "16m"),
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
    ]);
    let data = pattern(SZ, 0x5a);
    // Start on the host, mapped at `va`.
    let on_host = s.mem_create(SZ, None, [0; 32]).unwrap();
    let va = s.address_reserve(SZ, 0).unwrap();
    s.mem_map(va, SZ, 0, on_host).unwrap();
    s.set_access(va, SZ).unwrap();
    let mut src = data.clone();
    s.memcpy(Addr::Device(va), host_ptr(src.as_mut_slice()), SZ)
        .unwrap();
    assert_eq!((used(s, 0), s.host.used()), (0, SZ));

    // Move onto the device: copy through a staging address, then remap `va`.
    let move_to = |from: u64, to_dev: Option<i32>| -> u64 {
        let to = s.mem_create(SZ, to_dev, [0; 32]).unwrap();
        let stage = s.address_reserve(SZ, 0).unwrap();
        s.mem_map(stage, SZ, 0, to).unwrap();
        s.memcpy(Addr::Device(stage), Addr::Device(va), SZ).unwrap();
        s.mem_unmap(va, SZ).unwrap();
        s.mem_release(from).unwrap();
        s.mem_map(va, SZ, 0, to).unwrap();
        s.mem_unmap(stage, SZ).unwrap();
        s.address_free(stage, SZ).unwrap();
        to
    };
    let on_dev = move_to(on_host, Some(0));
    assert_eq!((used(s, 0), s.host.used()), (SZ, 0));
    assert!(
        read_back(s, va, SZ) == data,
        "contents intact on the device"
    );
    assert_eq!(s.address_range(va + 1).unwrap(), (va, SZ));

    // And back to the host, after the device changed a byte.
    s.memset(va + 7, 0xee, 1, 1).unwrap();
    let mut changed = data.clone();
    changed[7] = 0xee;
    let back = move_to(on_dev, None);
    assert_eq!((used(s, 0), s.host.used()), (0, SZ));
    assert!(
        read_back(s, va, SZ) == changed,
        "contents intact on the host"
    );
    s.mem_unmap(va, SZ).unwrap();
    s.mem_release(back).unwrap();
    s.address_free(va, SZ).unwrap();
    assert_eq!((used(s, 0), s.host.used()), (0, 0));
}

#[test]
fn the_host_limit_refuses_pinned_and_host_located_memory_with_out_of_memory() {
    let s = in_context(&[
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
        ("VGPU_SIM_HOST_PINNED_LIMIT", "8m"),
    ]);
    let h = s.mem_create(6 << 20, None, [0; 32]).unwrap();
    assert_eq!(
        s.mem_create(4 << 20, None, [0; 32]),
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    );
    assert_eq!(s.host_alloc(4 << 20, 0), Err(CUDA_ERROR_OUT_OF_MEMORY));
    let mut buf = vec![0u8; 4 << 20];
    #[allow(unsafe_code)]
    // SAFETY: never registered (refused), so never used past `buf`'s life.
    let ptr = unsafe { HostPtr::new(buf.as_mut_ptr() as u64) };
    assert_eq!(
        s.host_register(ptr, 4 << 20, 0),
        Err(CUDA_ERROR_OUT_OF_MEMORY)
    );
    let d = s.mem_create(4 << 20, Some(0), [0; 32]).unwrap();
    assert_eq!(
        s.host.used(),
        6 << 20,
        "device memory is not held against the host"
    );
    let p = s.host_alloc(2 << 20, 0).unwrap();
    s.mem_release(h).unwrap();
    let h = s.mem_create(6 << 20, None, [0; 32]).unwrap();
    for x in [h, d] {
        s.mem_release(x).unwrap();
    }
    s.host_free(p).unwrap();
    assert_eq!(s.host.used(), 0);
}

/// A queue's job that sleeps `ms` and then says it ran.
fn slow_job(queue: &Arc<crate::engine::StreamQueue>, ms: u64) -> Arc<AtomicBool> {
    let ran = Arc::new(AtomicBool::new(false));
    let done = ran.clone();
    queue.submit(Box::new(move || {
        std::thread::sleep(Duration::from_millis(ms));
        done.store(true, Ordering::SeqCst);
    }));
    ran
}

#[test]
fn an_unmap_waits_for_its_own_contexts_work_not_for_another_contexts() {
    // The H200 (driver 580, gpu-tests/vmm_spill.py's probe): a cuMemUnmap in one context
    // returned in under a millisecond while another context had a 1 s kernel queued.
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let first = s.current().unwrap();
    s.ctx_create(0, 0).unwrap(); // a second context, current now
    let second = s.current().unwrap();
    let h = s.mem_create(GRANULARITY, None, [0; 32]).unwrap();
    let va = s.address_reserve(GRANULARITY, 0).unwrap();
    s.mem_map(va, GRANULARITY, 0, h).unwrap();
    let other = slow_job(&s.st().ctxs[&first].null_stream.clone(), 600);
    let own = slow_job(&s.st().ctxs[&second].null_stream.clone(), 50);
    s.mem_unmap(va, GRANULARITY).unwrap();
    assert!(
        own.load(Ordering::SeqCst),
        "the unmap returned before its own context's queued work ran"
    );
    assert!(
        !other.load(Ordering::SeqCst),
        "the unmap waited for another context's queued work"
    );
    s.mem_release(h).unwrap();
    s.address_free(va, GRANULARITY).unwrap();
    s.st().ctxs[&first].null_stream.clone().drain();
}

#[test]
fn host_located_memory_refuses_the_gpudirect_rdma_flag_and_shareable_handles() {
    // The H200 (driver 580, gpu-tests/vmm_spill.py's probe) answered a host-located
    // cuMemCreate with error 1 for the RDMA flag, for POSIX fd handles and for both.
    let s = in_context(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    let mut rdma = [0u8; 32];
    rdma[PROP_GPU_DIRECT_RDMA] = 1;
    let mut posix_fd = [0u8; 32];
    posix_fd[4] = 1;
    let mut both = rdma;
    both[4] = 1;
    for prop in [rdma, posix_fd, both] {
        assert_eq!(
            s.mem_create(GRANULARITY, None, prop),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
    }
    assert_eq!(s.host.used(), 0, "nothing taken");
    let shareable_on_device = s.mem_create(GRANULARITY, Some(0), both).unwrap();
    s.mem_release(shareable_on_device).unwrap();
    let on_device = s.mem_create(GRANULARITY, Some(0), rdma).unwrap();
    let plain = s.mem_create(GRANULARITY, None, [0; 32]).unwrap();
    for h in [on_device, plain] {
        s.mem_release(h).unwrap();
    }
}

#[test]
fn vmm_handle_values_come_back_only_when_asked_and_never_while_mapped() {
    let s = in_context(&[]);
    let a = s.mem_create(2 << 20, Some(0), [0; 32]).unwrap();
    s.mem_release(a).unwrap();
    let b = s.mem_create(2 << 20, Some(0), [0; 32]).unwrap();
    assert_ne!(a, b, "values are not reused by default");
    let s = in_context(&[("VGPU_SIM_REUSE_HANDLES", "1")]);
    let a = s.mem_create(2 << 20, Some(0), [0; 32]).unwrap();
    let va = s.address_reserve(2 << 20, 0).unwrap();
    s.mem_map(va, 2 << 20, 0, a).unwrap();
    s.mem_release(a).unwrap();
    let b = s.mem_create(2 << 20, Some(0), [0; 32]).unwrap();
    assert_ne!(
        a, b,
        "released but still mapped: the memory and its value live on"
    );
    s.mem_unmap(va, 2 << 20).unwrap();
    let c = s.mem_create(2 << 20, Some(0), [0; 32]).unwrap();
    assert_eq!(a, c, "freed: its value comes back");
}

#[test]
fn a_copy_with_pageable_host_memory_runs_at_the_pageable_rate_and_a_pinned_one_at_once() {
    // 4 MiB at 20 MB/s: about 210 ms each way through pageable memory.
    let s = in_context(&[
        ("VGPU_SIM_CTX_OVERHEAD", "0"),
        ("VGPU_SIM_PAGEABLE_MBPS", "20"),
    ]);
    const N: u64 = 4 << 20;
    let d = s.mem_alloc(N).unwrap();
    s.memset(d, 7, 4, N / 4).unwrap();
    let mut buf = vec![0u8; N as usize];
    let t = std::time::Instant::now();
    s.memcpy(host_ptr(&mut buf[..]), Addr::Device(d), N)
        .unwrap();
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(150),
        "{:?}",
        t.elapsed()
    );
    assert!(buf.iter().step_by(4).all(|&b| b == 7));
    let t = std::time::Instant::now();
    s.memcpy(Addr::Device(d), host_ptr(&mut buf[..]), N)
        .unwrap();
    assert!(
        t.elapsed() >= std::time::Duration::from_millis(150),
        "{:?}",
        t.elapsed()
    );
    let p = s.host_alloc(N, 0).unwrap();
    #[allow(unsafe_code)]
    // SAFETY: the pinned allocation just made, N bytes, freed after the copy.
    let pinned = Addr::Host(unsafe { HostPtr::new(p) });
    let t = std::time::Instant::now();
    s.memcpy(pinned, Addr::Device(d), N).unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    s.host_free(p).unwrap();
}
