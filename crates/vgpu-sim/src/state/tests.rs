use super::*;
use crate::config::SimConfig;
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
    let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    s.ctx_create(0, 0).unwrap();
    let pool = s.default_pool(0).unwrap();
    let a = s.alloc_async(1000, 0, 0, false).unwrap();
    assert_eq!(s.pool_get_attr(pool, 5).unwrap(), GRANULARITY);
    assert_eq!(s.pool_get_attr(pool, 7).unwrap(), GRANULARITY);
    s.pool_set_attr(pool, 4, u64::MAX).unwrap();
    s.free_async(a, 0, false).unwrap();
    s.stream_sync(0, false).unwrap();
    assert_eq!(s.pool_get_attr(pool, 7).unwrap(), 0);
    assert_eq!(
        s.pool_get_attr(pool, 5).unwrap(),
        GRANULARITY,
        "kept below the threshold"
    );
    assert_eq!(used(s, 0), GRANULARITY);
    let b = s.alloc_async(10, 0, 0, false).unwrap();
    assert_eq!(b, a, "block reused");
    s.mem_free(b).unwrap();
    s.pool_trim(pool, 0).unwrap();
    assert_eq!(used(s, 0), 0);
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
        s.launch(l, 0, false)
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

#[test]
fn kernels_run_on_streams_and_events_time_them() {
    let s = sim(&[]);
    s.ctx_create(0, 0).unwrap();
    let m = s.module_load(b"vgpusim-module: spin fill").unwrap();
    let f = s.get_function(m, "spin").unwrap();
    assert_eq!(s.get_function(m, "nope"), Err(CUDA_ERROR_NOT_FOUND));
    let (k, dev) = s.function(f).unwrap();
    let st = s.stream_create(0).unwrap();
    let (e1, e2) = (s.event_create(0).unwrap(), s.event_create(0).unwrap());
    s.event_record(e1, st, false).unwrap();
    let l = Launch {
        kernel: k,
        dev,
        grid: [1; 3],
        block: [1; 3],
        args: 20_000_000u64.to_le_bytes().to_vec(),
    };
    s.launch(l, st, false).unwrap();
    s.event_record(e2, st, false).unwrap();
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
    let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    s.ctx_create(0, 0).unwrap();
    let st = s.stream_create(0).unwrap();
    s.begin_capture(st, 0).unwrap();
    let l = Launch {
        kernel: Kernel::Noop,
        dev: 0,
        grid: [1; 3],
        block: [1; 3],
        args: vec![],
    };
    s.launch(l, st, false).unwrap();
    let g = s.end_capture(st).unwrap();
    assert_eq!(s.graph_nodes(g).unwrap().len(), 1);
    let (_, p) = s.graph_add_mem_alloc(g, 0, 3 << 20).unwrap();
    s.graph_add_mem_free(g, p).unwrap();
    let e = s.graph_instantiate(g).unwrap();
    s.graph_upload(e, st, false).unwrap();
    assert_eq!(used(s, 0), 4 << 20, "uploading takes the graph's memory");
    assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0, "reserved, not in use");
    s.graph_launch(e, st, false).unwrap();
    assert_eq!(used(s, 0), 4 << 20);
    s.stream_sync(st, false).unwrap();
    assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0);
    assert_eq!(s.graph_mem_attr(0, 2).unwrap(), 4 << 20);
    s.graph_mem_trim(0).unwrap();
    assert_eq!(used(s, 0), 0);
}

#[test]
fn stream_ordered_allocation_in_a_capture_becomes_graph_memory() {
    let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    s.ctx_create(0, 0).unwrap();
    let st = s.stream_create(0).unwrap();
    s.begin_capture(st, 0).unwrap();
    let p = s.alloc_async(3 << 20, 0, st, false).unwrap();
    assert_eq!(used(s, 0), 0, "nothing is taken while capturing");
    let g = s.end_capture(st).unwrap();
    let e = s.graph_instantiate(g).unwrap();
    s.graph_launch(e, st, false).unwrap();
    s.stream_sync(st, false).unwrap();
    assert_eq!(used(s, 0), 4 << 20);
    s.memset(p, 1, 1, 3 << 20).unwrap();
    // Freed outside its graph, it stays reserved for graphs until trimmed.
    s.free_async(p, st, false).unwrap();
    s.stream_sync(st, false).unwrap();
    assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0);
    assert_eq!(used(s, 0), 4 << 20);
    s.graph_mem_trim(0).unwrap();
    assert_eq!(used(s, 0), 0);
}

#[test]
fn pool_queries_invalidate_a_global_capture_but_not_a_relaxed_one() {
    let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
    s.ctx_create(0, 0).unwrap();
    let pool = s.default_pool(0).unwrap();
    let st = s.stream_create(0).unwrap();
    s.begin_capture(st, 0).unwrap();
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
