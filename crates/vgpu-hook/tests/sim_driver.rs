//! End to end: `libvgpu.so` preloaded into C programs that run on the simulated driver.
//!
//! Each test runs `tests/programs/probe.c` (built here with `cc`) as a child process with
//! `LD_PRELOAD=libvgpu.so`, the simulated `libcuda.so.1`/`libnvidia-ml.so.1` on
//! `LD_LIBRARY_PATH`, HAMi's environment variables and a fresh shared file. The probe reaches
//! the driver the way `VGPU_VIA` says: linked symbols, `dlopen`+`dlsym`, or `cuGetProcAddress`
//! (with and without the per-thread-default-stream flag).
//!
//! Every test checks something the bare driver does not do, so each fails without the hook;
//! `without_the_hook_these_checks_fail` shows that for the main ones. Needs `libvgpu.so` and
//! `libvgpusim.so` in the target directory: run `cargo xtask test`.

mod support;

use support::*;

/// The hook is in effect in this environment: the device's total is the limit.
fn assert_hooked(run: &Run, limit: u64) {
    let o = run.run(&["info"]);
    assert_eq!(
        o.u("dev0_total_mem"),
        limit,
        "the hook is not in effect:\n{}",
        o.stdout
    );
}

#[test]
fn views_show_the_limit_whichever_way_the_driver_is_reached() {
    for via in VIAS {
        let o = Run::hooked("256m").via(via).run(&["info"]);
        assert_eq!(o.get("init"), "0");
        assert_eq!(
            o.u("dev0_total_mem"),
            256 * MIB,
            "cuDeviceTotalMem via {via}"
        );
        assert_eq!(o.u("dev0_total"), 256 * MIB, "cuMemGetInfo total via {via}");
        assert_eq!(o.u("dev0_free"), 256 * MIB, "cuMemGetInfo free via {via}");
        assert_eq!(
            o.u("nvml0_total"),
            256 * MIB,
            "nvmlDeviceGetMemoryInfo total"
        );
        assert_eq!(o.u("nvml0_free"), 256 * MIB, "nvmlDeviceGetMemoryInfo free");
        assert_eq!(o.u("nvml0_used"), 0, "nvmlDeviceGetMemoryInfo used");
        assert_eq!(o.get("nvml0_v2_rc"), "0");
        assert_eq!(
            o.u("nvml0_v2_total"),
            256 * MIB,
            "nvmlDeviceGetMemoryInfo_v2 total"
        );
        assert_eq!(o.u("nvml0_v2_used"), 0, "nvmlDeviceGetMemoryInfo_v2 used");
    }
}

#[test]
fn free_memory_is_the_smaller_of_limit_headroom_and_physical_free() {
    // 900 MiB of the 1 GiB device are used by someone outside the container.
    let o = Run::hooked("256m")
        .var("VGPU_SIM_OTHER_USED", "900m")
        .run(&["info"]);
    assert_eq!(o.u("dev0_total"), 256 * MIB);
    assert_eq!(
        o.u("dev0_free"),
        124 * MIB,
        "physical free (124 MiB) is below the limit headroom"
    );
    // A limit above the physical memory: the total shows the physical memory.
    let o = Run::hooked("4g").run(&["info"]);
    assert_eq!(o.u("dev0_total_mem"), 1 << 30);
    assert_eq!(o.u("dev0_total"), 1 << 30);
}

#[test]
fn past_the_limit_is_out_of_memory_with_one_log_line() {
    let run = Run::hooked("256m");
    let o = run.run(&["try", "314572800"]);
    assert_eq!(o.get("alloc"), "2", "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(o.get("name"), "CUDA_ERROR_OUT_OF_MEMORY");
    let lines: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.contains("314572800"))
        .collect();
    assert_eq!(
        lines.len(),
        1,
        "one log line naming the request:\n{}",
        o.stderr
    );
    assert!(
        lines[0].contains("268435456"),
        "the line names the limit: {}",
        lines[0]
    );
    // Just under the limit works.
    assert_eq!(run.run(&["try", "268435456"]).get("alloc"), "0");
    // LIBCUDA_LOG_LEVEL=0 keeps only errors: the refusal is still a refusal, but silent.
    let o = run
        .clone()
        .var("LIBCUDA_LOG_LEVEL", "0")
        .run(&["try", "314572800"]);
    assert_eq!(o.get("alloc"), "2");
    assert!(!o.stderr.contains("314572800"), "{}", o.stderr);
}

#[test]
fn a_refusal_by_the_limit_is_counted_in_the_file_and_a_success_is_not() {
    let run = Run::hooked("256m");
    let refusals = || file_without_sweep(&run.cache()).devices[0].oom_refusals;
    assert_eq!(run.run(&["try", "268435456"]).get("alloc"), "0");
    assert_eq!(refusals(), 0, "a successful allocation counts nothing");
    assert_eq!(run.run(&["try", "314572800"]).get("alloc"), "2");
    assert_eq!(refusals(), 1);
    assert_eq!(run.run(&["try", "268435456"]).get("alloc"), "0");
    assert_eq!(refusals(), 1, "a successful allocation counts nothing");
    assert_eq!(run.run(&["try", "314572800"]).get("alloc"), "2");
    assert_eq!(refusals(), 2);
}

/// Takes 48 MiB by `path` under a 64 MiB limit: a 32 MiB cuMemAlloc must be refused while it
/// is held and succeed once it is given back, and usage returns to where it started.
fn check_path(path: &str, via: &str) {
    check_path_with(path, via, Run::hooked("64m"));
}

fn check_path_with(path: &str, via: &str, run: Run) {
    let o = run.via(via).run(&["counted", path, "50331648", "33554432"]);
    let ctx = format!("path {path} via {via}:\n{o}");
    assert_eq!(o.get("take"), "0", "{ctx}");
    assert_eq!(o.get("probe_held"), "2", "not counted: {ctx}");
    assert_eq!(o.get("give"), "0", "{ctx}");
    assert_eq!(o.get("probe_after"), "0", "not released: {ctx}");
    assert!(o.u("used_held") >= 48 * MIB, "{ctx}");
    assert_eq!(o.u("used_after"), o.u("used_before"), "leaked: {ctx}");
}

const PATHS: [&str; 12] = [
    "alloc_freeasync",
    "alloc",
    "pitch",
    "managed",
    "vmm",
    "async",
    "async_memfree",
    "pool",
    "array",
    "array3d",
    "mipmap",
    "graph",
];

#[test]
fn every_allocation_path_is_counted_and_released_linked() {
    for p in PATHS {
        check_path(p, "link");
    }
}

#[test]
fn every_allocation_path_is_counted_and_released_through_dlsym() {
    for p in PATHS {
        check_path(p, "dlsym");
    }
}

#[test]
fn every_allocation_path_is_counted_and_released_through_get_proc_address() {
    for p in PATHS {
        check_path(p, "procaddr");
        check_path(p, "ptsz");
    }
}

#[test]
fn a_stream_ordered_allocation_captured_into_a_graph_is_counted() {
    // cuMemAllocAsync on a capturing stream becomes a graph memory node; the memory is taken
    // when the graph is launched. In the default (global) capture mode the driver refuses
    // some calls during a capture and invalidates it (seen on the H200: cuMemPoolGetAttribute
    // does), so a hook that measures pools there breaks the program's capture. Relaxed mode
    // allows them; both must work and be counted.
    for mode in ["0", "2"] {
        for via in ["link", "procaddr"] {
            check_path_with(
                "capture_async",
                via,
                Run::hooked("64m").var("VGPU_CAPTURE_MODE", mode),
            );
        }
    }
}

#[test]
fn contexts_are_measured_and_counted() {
    // Each context takes 24 MiB of the simulated device; the limit is 96 MiB. The primary
    // context plus a created one (48 MiB) leave no room for 64 MiB until the second is gone.
    for via in ["link", "procaddr"] {
        let o = Run::hooked("96m")
            .var("VGPU_SIM_CTX_OVERHEAD", "24m")
            .via(via)
            .run(&["counted", "ctx", "0", "67108864"]);
        let ctx = format!("via {via}:\n{o}");
        assert_eq!(o.get("take"), "0", "{ctx}");
        assert_eq!(
            o.get("probe_held"),
            "2",
            "created context not counted: {ctx}"
        );
        assert_eq!(
            o.get("probe_after"),
            "0",
            "destroyed context not released: {ctx}"
        );
        assert_eq!(o.u("used_before"), 24 * MIB, "primary context: {ctx}");
        assert_eq!(o.u("used_held"), 48 * MIB, "{ctx}");
        assert_eq!(o.u("used_after"), 24 * MIB, "{ctx}");
    }
}

#[test]
fn processes_share_one_limit_and_a_killed_one_gives_its_memory_back() {
    let run = Run::hooked("64m");
    let mut a = run.spawn(&["hold", "41943040"]);
    assert_eq!(a.wait_for("hold="), "hold=0");
    let o = run.run(&["try", "33554432"]);
    assert_eq!(
        o.get("alloc"),
        "2",
        "the other process's 40 MiB count against this one"
    );
    assert_eq!(
        o.u("used"),
        40 * MIB,
        "cuMemGetInfo shows the container's usage"
    );
    a.finish();
    assert_eq!(run.run(&["try", "33554432"]).get("alloc"), "0");

    // A process killed while holding memory does not keep it.
    let mut b = run.spawn(&["hold", "41943040"]);
    assert_eq!(b.wait_for("hold="), "hold=0");
    b.kill();
    let o = run.run(&["try", "33554432"]);
    assert_eq!(
        o.get("alloc"),
        "0",
        "a dead process's usage still counted:\n{o}"
    );
}

#[test]
fn a_process_that_exits_without_freeing_leaves_nothing_behind() {
    let run = Run::hooked("64m");
    let o = run.run(&["leak", "4194304"]);
    for p in [
        "alloc", "pitch", "managed", "vmm", "async", "array", "mipmap", "small",
    ] {
        assert_eq!(o.get(&format!("leak_{p}")), "0", "{p}");
    }
    assert!(o.u("used") >= 28 * MIB);
    let o = run.run(&["info"]);
    assert_eq!(o.u("dev0_total"), 64 * MIB);
    assert_eq!(
        o.u("dev0_free"),
        64 * MIB,
        "usage of the exited process is still counted"
    );
}

#[test]
fn fork_keeps_the_parents_usage_and_an_exec_child_cleans_up() {
    // The limit leaves the exec'd child room for a whole sub-allocator region (its 1 MiB
    // request), so a child that exits without its usage leaving the table is seen.
    let run = Run::hooked("1g");
    assert_hooked(&run, 1 << 30);
    let o = run.run(&["fork", "8388608"]);
    let before = o.u("used_before");
    assert!(before >= 8 * MIB, "{}", o.stdout);
    assert_eq!(
        o.u("used_after_child"),
        before,
        "a child exiting took the parent's usage"
    );
    assert_eq!(
        o.u("used_after_exec_child"),
        before,
        "an exec'd child left usage behind"
    );
    assert_eq!(o.get("exec_status"), "0");
    assert_eq!(o.u("used_end"), 0);
}

#[test]
fn sixty_four_threads_allocate_and_free_without_errors_or_leaks() {
    // 128 MiB for 64 threads of up to 8 live allocations of up to 4 MiB: many refusals.
    let run = Run::hooked("128m");
    assert_hooked(&run, 128 * MIB);
    for via in ["link", "procaddr"] {
        let o = run
            .clone()
            .via(via)
            .var("LIBCUDA_LOG_LEVEL", "0")
            .run(&["threads", "64", "300"]);
        assert_eq!(o.get("errors"), "0", "{}", o.stdout);
        assert_eq!(o.u("used_before"), 0);
        // The hook may keep one empty sub-allocator region warm (counted as used); it must
        // give way when the memory is needed.
        assert_eq!(
            o.get("full_alloc"),
            "0",
            "leaked under concurrency via {via}: {}",
            o.stdout
        );
        assert_eq!(
            o.u("full_alloc_size"),
            (128 * MIB - o.u("used_before")) & !(2 * MIB - 1)
        );
    }
    assert_eq!(run.run(&["info"]).u("dev0_free"), 128 * MIB);
}

#[test]
fn sub_allocations_answer_their_own_range_and_refuse_ipc() {
    let o = Run::hooked("256m").run(&["range"]);
    // (probe key, expected value, what it checks)
    for (key, want, what) in [
        ("range_rc", "0", "cuMemGetAddressRange succeeds"),
        (
            "range_base_off",
            "0",
            "cuMemGetAddressRange of a sub-allocation",
        ),
        (
            "range_size",
            "3000",
            "cuMemGetAddressRange of a sub-allocation",
        ),
        ("attr_rc", "0,0", "cuPointerGetAttribute succeeds"),
        (
            "attr_start_off",
            "0",
            "CU_POINTER_ATTRIBUTE_RANGE_START_ADDR of a sub-allocation",
        ),
        (
            "attr_size",
            "3000",
            "CU_POINTER_ATTRIBUTE_RANGE_SIZE of a sub-allocation",
        ),
        ("copy_ok", "1", "a copy into a sub-allocation"),
        (
            "neighbour_ok",
            "1",
            "a copy into one sub-allocation touched another",
        ),
        ("ipc_big", "0", "cuIpcGetMemHandle of a direct allocation"),
        ("double_free_small", "1", "double free of a sub-allocation"),
        ("double_free_big", "1", "double free of a direct allocation"),
        ("interior_free", "1", "free of an interior pointer"),
    ] {
        assert_eq!(o.get(key), want, "{key}: {what}");
    }
    assert_ne!(
        o.get("ipc_small"),
        "0",
        "cuIpcGetMemHandle must refuse a sub-allocated pointer"
    );
    assert!(
        o.stderr.contains("VGPU_SUBALLOC=0"),
        "the refusal says how to turn sub-allocation off:\n{}",
        o.stderr
    );
    assert_eq!(
        o.get("full_alloc"),
        "0",
        "memory not given back: {}",
        o.stdout
    );
    assert_eq!(o.u("full_alloc_size"), 256 * MIB);
    // With sub-allocation off, IPC works for small allocations too.
    let o = Run::hooked("256m")
        .var("VGPU_SUBALLOC", "0")
        .run(&["range"]);
    assert_eq!(o.get("ipc_small"), "0");
}

#[test]
fn visible_devices_by_index_map_limits_usage_and_views_to_the_right_device() {
    // `_<i>` is the container's (NVML's) GPU i, whatever CUDA_VISIBLE_DEVICES says.
    let run = Run::hooked("0")
        .var("VGPU_SIM_DEVICE_COUNT", "3")
        .var("CUDA_DEVICE_MEMORY_LIMIT_2", "100m")
        .var("CUDA_DEVICE_MEMORY_LIMIT_0", "200m")
        .var("CUDA_VISIBLE_DEVICES", "2,0");
    let o = run.run(&["devices", "10485760"]);
    assert_eq!(o.get("count"), "2");
    assert_eq!(
        o.u("dev0_total_mem"),
        100 * MIB,
        "ordinal 0 (physical 2) has limit _2"
    );
    assert_eq!(
        o.u("dev1_total_mem"),
        200 * MIB,
        "ordinal 1 (physical 0) has limit _0"
    );
    assert_eq!(o.get("dev0_alloc"), "0");
    assert_eq!(o.u("dev0_used"), 10 * MIB);
    assert_eq!(o.u("dev1_used"), 20 * MIB);
    // NVML (all physical devices): each visible one shows its container usage and limit.
    assert_eq!(o.u("nvml2_used"), 10 * MIB);
    assert_eq!(o.u("nvml2_total"), 100 * MIB);
    assert_eq!(o.u("nvml0_used"), 20 * MIB);
    assert_eq!(o.u("nvml0_total"), 200 * MIB);
    assert_eq!(o.u("nvml1_used"), 0);
    // Past a device's own limit.
    let o = run.run(&["devices", "110100480"]);
    assert_eq!(o.get("dev0_alloc"), "2", "105 MiB on a 100 MiB device");
}

#[test]
fn visible_devices_by_uuid_map_to_the_named_device() {
    let run = Run::hooked("100m").var("VGPU_SIM_DEVICE_COUNT", "3").var(
        "CUDA_VISIBLE_DEVICES",
        "GPU-5a1e5130-0000-4000-8000-00000000d001",
    );
    let o = run.run(&["devices", "10485760"]);
    assert_eq!(o.get("count"), "1");
    assert_eq!(o.u("dev0_total_mem"), 100 * MIB);
    assert_eq!(
        o.u("nvml1_used"),
        10 * MIB,
        "usage must land on physical device 1:\n{}",
        o.stdout
    );
    assert_eq!(o.u("nvml1_total"), 100 * MIB);
    assert_eq!(o.u("nvml0_used"), 0);
    assert_eq!(
        o.u("nvml0_total"),
        100 * MIB,
        "device 0 is the container's too, under its limit"
    );
}

#[test]
fn a_malformed_limit_is_a_clear_error_not_unlimited() {
    let o = Run::hooked("lots")
        .var("VGPU_SIM_TOTAL_MEM", "4g")
        .run(&["try", "2147483648"]);
    assert!(
        o.stderr.contains("CUDA_DEVICE_MEMORY_LIMIT"),
        "no message naming the variable:\n{}",
        o.stderr
    );
    assert!(
        o.get("init") != "0" || o.get("alloc") != "0",
        "a 2 GiB allocation went through:\n{}",
        o.stdout
    );
}

#[test]
fn driver_errors_are_forwarded_intact_and_leave_no_usage() {
    // A code from a newer driver that nobody knows, on small (sub-allocated) and large requests.
    let run = Run::hooked("256m").var("VGPU_SIM_FAULTS", "cuMemAlloc_v2:*:1234");
    assert_hooked(&run, 256 * MIB);
    for size in ["100", "67108864"] {
        let o = run.run(&["try", size]);
        assert_eq!(o.get("alloc"), "1234", "size {size}");
        assert_eq!(o.u("used"), 0, "a failed allocation left usage behind");
    }
    // The driver's own out-of-memory.
    let o = Run::hooked("256m")
        .var("VGPU_SIM_FAULTS", "cuMemAlloc_v2:1:2")
        .run(&["try", "67108864"]);
    assert_eq!(o.get("alloc"), "2");
    assert_eq!(o.u("used"), 0);
    // A failing cuMemCreate and cuMemAllocAsync. The probes are direct (2 MiB): a smaller one
    // would leave its empty sub-allocator region warm, charged on purpose.
    let o = Run::hooked("64m")
        .var("VGPU_SIM_FAULTS", "cuMemCreate:1:999")
        .run(&["counted", "vmm", "4194304", "2097152"]);
    assert_eq!(o.get("take"), "999");
    assert_eq!(o.u("used_after"), 0);
    let o = Run::hooked("64m")
        .var("VGPU_SIM_FAULTS", "cuMemAllocAsync:1:4321")
        .run(&["counted", "async", "4194304", "2097152"]);
    assert_eq!(o.get("take"), "4321");
    assert_eq!(o.u("used_after"), 0);
}

#[test]
fn kernels_launch_every_way_under_the_hook() {
    for via in VIAS {
        let run = Run::hooked("256m").via(via);
        assert_hooked(&run, 256 * MIB);
        let o = run.run(&["launch", "200"]);
        let ctx = format!("via {via}:\n{o}");
        assert_eq!(o.get("fill"), "0", "{ctx}");
        assert_eq!(o.get("fill_ok"), "1", "{ctx}");
        assert_eq!(o.get("launch_errors"), "0", "{ctx}");
        assert_eq!(o.get("launch_ex"), "0", "{ctx}");
        assert_eq!(o.get("launch_coop"), "0", "{ctx}");
        assert_eq!(o.get("launch_default_stream"), "0", "{ctx}");
        assert_eq!(o.get("graph"), "0,0,0,0", "{ctx}");
        assert_eq!(o.get("graph_node"), "0,0,0,0", "{ctx}");
        assert_eq!(o.get("graph_node_ok"), "1", "{ctx}");
        let ms: f64 = o.get("spin20_ms").parse().unwrap();
        assert!(ms >= 19.0, "a 20 ms kernel took {ms} ms: {ctx}");
    }
}

#[test]
fn without_the_hook_these_checks_fail() {
    // The same environments, bare: the tests above would fail, so they test the hook.
    let bare = Run::hooked("256m").bare();
    assert_eq!(bare.run(&["info"]).u("dev0_total_mem"), 1 << 30);
    assert_eq!(bare.run(&["try", "314572800"]).get("alloc"), "0");
    let o = Run::hooked("64m")
        .bare()
        .via("procaddr")
        .run(&["counted", "vmm", "50331648", "33554432"]);
    assert_eq!(o.get("probe_held"), "0");
    assert_eq!(
        Run::hooked("256m").bare().run(&["range"]).get("ipc_small"),
        "0"
    );
}

#[test]
fn the_simulators_proc_address_pointers_cannot_be_interposed() {
    // A preloaded library defining cuMemAlloc_v2 catches linked calls, but not the pointer the
    // simulator's cuGetProcAddress returns: a hook must answer cuGetProcAddress itself, as with
    // the real driver, or the tests above would see it bypassed.
    let mut run = Run::hooked("0").bare();
    run.preload = Some(env().interposer.clone());
    assert_eq!(
        run.clone().via("link").run(&["try", "4096"]).get("alloc"),
        "777"
    );
    assert_eq!(
        run.clone()
            .via("procaddr")
            .run(&["try", "4096"])
            .get("alloc"),
        "0"
    );
}

/// (context, data, total) the shared file (HAMi layout 1.2) charges to `pid` on device 0.
/// Device 0 usage of process `pid` in a HAMi shared file, as the monitor reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotUsage {
    context: u64,
    module: u64,
    data: u64,
    total: u64,
}

/// Byte offset of process `pid`'s HAMi slot in the shared file.
fn slot_offset(cache: &str, pid: u32) -> Option<usize> {
    let b = std::fs::read(cache).ok()?;
    let proc_num = i32::from_le_bytes(b[2_008_896..2_008_900].try_into().unwrap());
    (0..proc_num.clamp(0, 1024) as usize)
        .map(|i| 1856 + i * 1960)
        .find(|&base| i32::from_le_bytes(b[base..base + 4].try_into().unwrap()) == pid as i32)
}

fn slot_usage(cache: &str, pid: u32) -> Option<SlotUsage> {
    let base = slot_offset(cache, pid)?;
    let b = std::fs::read(cache).ok()?;
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    Some(SlotUsage {
        context: u64_at(base + 8),
        module: u64_at(base + 16),
        data: u64_at(base + 24),
        total: u64_at(base + 40),
    })
}

#[test]
fn accounted_usage_of_a_process_matches_what_nvml_reports_for_it() {
    // Each context takes 24 MiB of the simulated device; the process holds 40 MiB more.
    let run = Run::hooked("256m").var("VGPU_SIM_CTX_OVERHEAD", "24m");
    let mut a = run.spawn(&["hold", "41943040"]);
    let nvml_line = a.wait_for("nvml_self_used=");
    assert_eq!(a.wait_for("hold="), "hold=0");
    let slot =
        slot_usage(&run.cache(), a.pid()).expect("no slot for the process in the shared file");
    a.finish();
    let nvml: u64 = nvml_line
        .trim_start_matches("nvml_self_used=")
        .parse()
        .unwrap();
    assert_eq!(nvml, 64 * MIB, "the simulated NVML figure");
    assert_eq!(slot.context, 24 * MIB, "context charge");
    assert_eq!(slot.data, 40 * MIB, "data charge");
    assert_eq!(slot.total, nvml, "accounted total against NVML");
}

/// Runs `probe code API SIZE` held at its two pauses: `at_ctx` runs once the context exists
/// (before the load), `at_loaded` once the code was launched (before the unload), with the
/// process's slot. Returns the probe's whole output.
fn run_code(
    run: Run,
    api: &str,
    size: u64,
    at_ctx: impl FnOnce(&Run, u32),
    at_loaded: impl FnOnce(SlotUsage),
) -> Out {
    let run = run.var("VGPU_HOLD", "1");
    let mut p = run.spawn(&["code", api, &size.to_string()]);
    let mut all = p.read_until("ctx_ready=");
    at_ctx(&run, p.pid());
    p.send("go");
    all.push_str(&p.read_until("loaded="));
    at_loaded(slot_usage(&run.cache(), p.pid()).expect("no slot for the probe"));
    all.push_str(&p.finish());
    Out::parse(&all, "", Some(0))
}

const CODE: u64 = 32 * MIB;

/// 128 MiB limit, 32 MiB of module code: a 112 MiB allocation fits without the code only.
fn code_run(loading: &str, via: &str) -> Run {
    Run::hooked("128m")
        .var("VGPU_SIM_MODULE_OVERHEAD", "32m")
        .var("CUDA_MODULE_LOADING", loading)
        .via(via)
}

const FITS_WITHOUT_CODE: u64 = 112 * MIB;

#[test]
fn an_eagerly_loaded_module_is_charged_as_module_memory_limited_and_released() {
    for api in ["module", "library"] {
        for via in ["link", "procaddr"] {
            // An hour between rate-limited reconciliations: only the load and unload count.
            let run = code_run("EAGER", via).var("VGPU_RECONCILE_MS", "3600000");
            let mut module = 0;
            let o = run_code(
                run,
                api,
                FITS_WITHOUT_CODE,
                |_, _| {},
                |s| {
                    module = s.module;
                    assert_eq!(s.total, s.context + s.module + s.data, "{s:?}");
                },
            );
            let ctx = format!("{api} via {via}:\n{}", o.stdout);
            assert_eq!(o.get("load"), "0", "{ctx}");
            assert_eq!(module, CODE, "module_size in the shared file: {ctx}");
            assert_eq!(o.u("used_loaded"), CODE, "{ctx}");
            assert_eq!(
                o.get("alloc_loaded"),
                "2",
                "the limit counts the code: {ctx}"
            );
            assert_eq!(o.get("alloc_launched"), "2", "{ctx}");
            assert_eq!(o.get("unload"), "0", "{ctx}");
            assert_eq!(o.u("used_unloaded"), 0, "unloading releases it: {ctx}");
            assert_eq!(o.get("alloc_unloaded"), "0", "{ctx}");
        }
    }
}

#[test]
fn lazily_loaded_code_is_charged_once_it_reaches_the_device() {
    for api in ["module", "library"] {
        // Every eligible call reconciles (the views here).
        let run = code_run("LAZY", "link").var("VGPU_RECONCILE_MS", "0");
        let mut slot = None;
        let o = run_code(run, api, FITS_WITHOUT_CODE, |_, _| {}, |s| slot = Some(s));
        let slot = slot.unwrap();
        let ctx = format!("{api}:\n{}\n{slot:?}", o.stdout);
        assert_eq!(o.u("used_loaded"), 0, "no code on the device yet: {ctx}");
        assert_eq!(o.get("alloc_loaded"), "0", "{ctx}");
        assert_eq!(o.get("launch"), "0", "{ctx}");
        assert_eq!(
            o.u("used_launched"),
            CODE,
            "the first launch loaded it: {ctx}"
        );
        assert_eq!(o.get("alloc_launched"), "2", "the limit counts it: {ctx}");
        assert_eq!(slot.module, CODE, "{ctx}");
        assert_eq!(
            slot.total,
            o.u("nvml_self_used"),
            "accounted total against NVML's figure for the process: {ctx}"
        );
        assert_eq!(o.u("used_unloaded"), 0, "{ctx}");
        assert_eq!(o.get("alloc_unloaded"), "0", "{ctx}");
    }
}

#[test]
fn without_reconciliation_module_code_is_not_counted() {
    // The negative control of the two tests above: with reconciliation off the same runs
    // leave module_size at 0 and let the allocation through, so those tests can fail.
    for loading in ["EAGER", "LAZY"] {
        let run = code_run(loading, "link").var("VGPU_RECONCILE_MS", "off");
        let mut module = u64::MAX;
        let o = run_code(
            run,
            "module",
            FITS_WITHOUT_CODE,
            |_, _| {},
            |s| module = s.module,
        );
        assert_eq!(module, 0, "{loading}: {}", o.stdout);
        assert_eq!(o.get("alloc_launched"), "0", "{loading}: {}", o.stdout);
    }
}

#[test]
fn code_past_the_limit_is_refused_when_loaded_and_charged_anyway_when_lazy() {
    // Eager: the load is undone and fails with out of memory, leaving nothing charged.
    let run = Run::hooked("16m")
        .var("VGPU_SIM_MODULE_OVERHEAD", "32m")
        .var("CUDA_MODULE_LOADING", "EAGER");
    let o = run.run(&["code", "module", "4194304"]);
    assert_eq!(o.get("load"), "2", "{o}");
    assert_eq!(o.u("used_loaded"), 0, "{}", o.stdout);
    assert!(
        o.stderr.contains("out of memory on device 0"),
        "{}",
        o.stderr
    );
    // Lazy: the code is already on the device when it is seen, so it is charged above the
    // limit (said once) and further allocations are refused.
    let run = Run::hooked("16m")
        .var("VGPU_SIM_MODULE_OVERHEAD", "32m")
        .var("CUDA_MODULE_LOADING", "LAZY")
        .var("VGPU_RECONCILE_MS", "0");
    let mut module = 0;
    let o = run_code(run, "module", 4 * MIB, |_, _| {}, |s| module = s.module);
    assert_eq!(o.get("launch"), "0");
    assert_eq!(module, CODE, "charged above the limit");
    assert_eq!(o.get("alloc_launched"), "2", "{}", o.stdout);
    assert_eq!(o.get("alloc_unloaded"), "0", "{}", o.stdout);
}

#[test]
fn charging_over_the_limit_is_said_once() {
    let o = Run::hooked("16m")
        .var("VGPU_SIM_MODULE_OVERHEAD", "32m")
        .var("CUDA_MODULE_LOADING", "LAZY")
        .var("VGPU_RECONCILE_MS", "0")
        .run(&["code", "module", "4194304"]);
    assert_eq!(o.get("alloc_launched"), "2", "{}", o.stdout);
    let said = o.stderr.matches("over the limit").count();
    assert_eq!(said, 1, "{}", o.stderr);
}

#[test]
fn hot_paths_make_no_nvml_query_and_direct_allocations_are_rate_limited() {
    // Reconciling on every eligible call: sub-allocations and launches are not eligible.
    let o = Run::hooked("1g")
        .var("VGPU_SIM_MODULE_OVERHEAD", "2m")
        .var("VGPU_RECONCILE_MS", "0")
        .run(&["hot", "2000"]);
    let ctx = o.to_string();
    assert_eq!(o.get("hot_errors"), "0", "{ctx}");
    assert_eq!(o.num("nvml_hot"), 0, "a hot path queried NVML: {ctx}");
    assert!(
        o.num("nvml_direct") >= 2000,
        "direct allocations reconcile when due (and the counter counts): {ctx}"
    );
    // The default interval: at most one query per 100 ms of direct allocations.
    let o = Run::hooked("1g")
        .var("VGPU_SIM_MODULE_OVERHEAD", "2m")
        .run(&["hot", "2000"]);
    let ctx = o.to_string();
    assert_eq!(o.num("nvml_hot"), 0, "{ctx}");
    let ms: f64 = o.get("direct_ms").parse().unwrap();
    assert!(
        o.num("nvml_direct") as f64 <= ms / 100.0 + 2.0,
        "rate limit: {ctx}"
    );
}

#[test]
fn a_process_nvml_does_not_list_is_said_once_and_the_monitors_hostpid_fixes_it() {
    // NVML lists this process under another pid (a container's PID namespace).
    let run = code_run("EAGER", "link")
        .var("VGPU_SIM_NVML_PID", "999999")
        .var("VGPU_RECONCILE_MS", "0");
    let o = run.run(&["code", "module", "4194304"]);
    assert_eq!(o.get("load"), "0");
    assert_eq!(o.u("used_loaded"), 0, "not reconciled: {}", o.stdout);
    assert_eq!(
        o.stderr.matches("NVML does not list this process").count(),
        1,
        "said once: {}",
        o.stderr
    );
    // The monitor writes the host pid into the process's HAMi slot: reconciled again.
    let mut module = 0;
    let o = run_code(
        run,
        "module",
        4 * MIB,
        |run, pid| {
            use std::os::unix::fs::FileExt;
            let base = slot_offset(&run.cache(), pid).expect("slot");
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(run.cache())
                .unwrap();
            f.write_all_at(&999999i32.to_le_bytes(), (base + 4) as u64)
                .unwrap();
        },
        |s| module = s.module,
    );
    assert_eq!(module, CODE, "{}", o.stdout);
    assert_eq!(o.u("used_loaded"), CODE, "{}", o.stdout);
}

/// The shared file as a reader that never sweeps sees it (`vgpu status` on a read-only
/// handle): a process that exited without leaving the table is still listed there.
fn file_without_sweep(cache: &str) -> vgpu_shm::TableSnapshot {
    vgpu_shm::UsageTable::open_read_only(cache)
        .expect("open the shared file read-only")
        .snapshot()
}

#[test]
fn a_process_that_exits_normally_leaves_the_table_at_once() {
    for how in ["return", "thread", "pthread_exit"] {
        let run = Run::hooked("256m");
        let o = run.run(&["exit", how, "8388608"]);
        let ctx = format!("exit by {how}:\n{o}");
        assert!(o.u("used") >= 8 * MIB, "{ctx}");
        if how == "thread" {
            // Another thread was allocating and freeing while exit() ran.
            assert!(o.u("exiting_loops") >= 200, "{ctx}");
            assert_eq!(o.get("alloc_errors"), "0", "{ctx}");
        }
        if how == "pthread_exit" {
            assert_eq!(o.get("thread_alloc"), "0", "{ctx}");
        }
        assert!(!o.stderr.contains("panic"), "{ctx}");
        let snap = file_without_sweep(&run.cache());
        assert!(
            snap.processes.is_empty(),
            "still registered: {:?}\n{ctx}",
            snap.processes
        );
        assert_eq!(snap.proc_num, 0, "{ctx}");
        assert_eq!(snap.devices[0].used, 0, "usage still counted: {ctx}");
    }
}

#[test]
fn a_forked_child_exiting_normally_keeps_the_parents_usage() {
    let run = Run::hooked("256m");
    let mut parent = run.spawn(&["exit", "fork", "8388608"]);
    assert_eq!(parent.wait_for("child_status="), "child_status=0");
    assert_eq!(parent.wait_for("hold="), "hold=0");
    let snap = file_without_sweep(&run.cache());
    assert_eq!(snap.processes.len(), 1, "{:?}", snap.processes);
    let p = &snap.processes[0];
    assert_eq!(p.pid, parent.pid() as i32);
    assert!(p.alive);
    assert!(
        p.devices[0].total() >= 8 * MIB,
        "the child's exit took the parent's usage: {p:?}"
    );
    assert_eq!(snap.devices[0].used, p.devices[0].total());
    parent.finish();
    // The parent's own normal exit then leaves the table.
    let snap = file_without_sweep(&run.cache());
    assert!(snap.processes.is_empty(), "{:?}", snap.processes);
    assert_eq!(snap.devices[0].used, 0);
}

#[test]
fn an_unindexed_sm_limit_is_logged_once_not_per_possible_device() {
    let limit_lines = |o: &Out| {
        o.stderr
            .lines()
            .filter(|l| l.contains("SM limit"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let o = Run::hooked("256m")
        .var("CUDA_DEVICE_SM_LIMIT", "50")
        .var("LIBCUDA_LOG_LEVEL", "3")
        .run(&["info"]);
    let lines = limit_lines(&o);
    assert_eq!(lines.len(), 1, "{}", o.stderr);
    assert!(
        lines[0].contains("SM limit 50% on every device"),
        "{}",
        lines[0]
    );
    // Per-device limits stay one line each, naming the device.
    let o = Run::hooked("256m")
        .var("CUDA_DEVICE_SM_LIMIT_0", "50")
        .var("CUDA_DEVICE_SM_LIMIT_1", "30")
        .var("LIBCUDA_LOG_LEVEL", "3")
        .run(&["info"]);
    let lines = limit_lines(&o);
    assert_eq!(lines.len(), 2, "{}", o.stderr);
    assert!(lines[0].contains("device 0: SM limit 50%"), "{}", lines[0]);
    assert!(lines[1].contains("device 1: SM limit 30%"), "{}", lines[1]);
}
