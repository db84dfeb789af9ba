//! Issue 12's defects on the hook's side, end to end on the simulated driver: fork after NVML,
//! enforcement with a bad configuration, a reset primary context, the limits in force, an
//! unlinked cache file, stream-ordered pools and processes seeing different GPUs.
//!
//! Each test fails on the hook before its fix. Needs `libvgpu.so` and `libvgpusim.so` in the
//! target directory: run `cargo xtask test`.

mod support;

use support::*;

/// Runs `probe fork_after <mode>`: the parent does `mode`, a forked child then uses CUDA.
fn fork_after(run: &Run, mode: &str) -> Out {
    run.run(&["fork_after", mode, "67108864", "536870912"])
}

#[test]
fn a_child_forked_after_nvml_uses_cuda_whichever_way_the_driver_is_reached() {
    // With an SM limit too: the limiter must not touch CUDA either.
    let runs = VIAS.into_iter().flat_map(|via| {
        [
            Run::hooked("256m").via(via),
            Run::hooked("256m")
                .var("CUDA_DEVICE_SM_LIMIT", "50")
                .via(via),
        ]
    });
    for run in runs {
        let via = run.via.clone();
        let o = fork_after(&run, "nvml");
        let ctx = format!("via {via}:\n{o}");
        assert_eq!(o.get("parent_nvml_meminfo"), "0", "{ctx}");
        assert_eq!(
            o.u("parent_nvml_total"),
            256 << 20,
            "the parent's NVML view is limited: {ctx}"
        );
        assert_eq!(o.get("child_init"), "0", "cuInit in the child: {ctx}");
        assert_eq!(o.get("child_alloc"), "0", "{ctx}");
        assert_eq!(o.get("child_data_ok"), "1", "{ctx}");
        assert_eq!(o.get("child_over"), "2", "the child is limited too: {ctx}");
        assert_eq!(o.get("child_exit"), "0", "{ctx}");
    }
}

#[test]
fn fork_follows_the_drivers_rule_under_the_hook() {
    for via in VIAS {
        let run = Run::hooked("256m").via(via);
        let o = fork_after(&run, "none");
        assert_eq!(o.get("child_exit"), "0", "via {via}: {}", o.stdout);
        assert_eq!(o.get("child_over"), "2", "via {via}: {}", o.stdout);
        // A parent that initialized CUDA: the child cannot use it, as without the hook.
        let o = fork_after(&run, "cuinit");
        assert_eq!(o.get("parent_init"), "0");
        assert_eq!(o.get("child_init"), "3", "via {via}: {}", o.stdout);
        let bare = fork_after(&run.clone().bare(), "cuinit");
        assert_eq!(bare.get("child_init"), "3");
    }
}

#[test]
fn without_the_hook_a_child_forked_after_nvml_works() {
    // The pattern itself is sound on the driver (and on the H200): only the hook broke it.
    for via in VIAS {
        let o = fork_after(&Run::hooked("256m").via(via).bare(), "nvml");
        assert_eq!(o.get("child_init"), "0", "via {via}: {}", o.stdout);
        assert_eq!(o.get("child_exit"), "0", "via {via}: {}", o.stdout);
        assert_eq!(o.get("child_over"), "0", "no limit without the hook");
    }
}

#[test]
fn with_enforcement_off_nothing_takes_device_memory() {
    // A malformed limit and an unusable file: allocations were refused, but contexts (1,280
    // of them filled a whole simulated device) and module loads were not.
    let garbage = fresh_cache("garbage");
    std::fs::write(&garbage, vec![0x5a; 4096]).expect("write a corrupt file");
    let broken = [
        Run::hooked("abc"),
        Run::hooked("256m").var(
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            garbage.to_str().expect("utf-8 path"),
        ),
    ];
    for run in broken {
        for via in ["link", "procaddr"] {
            let o = run
                .clone()
                .var("VGPU_SIM_CTX_OVERHEAD", "64m")
                .via(via)
                .run(&["takes"]);
            let ctx = format!("via {via} under {:?}:\n{o}", run.vars);
            for what in ["retain", "create", "alloc"] {
                assert_eq!(o.get(what), "2", "{what} must be refused: {ctx}");
            }
            // With no context to load into (refused above), a load fails either way; it
            // must not succeed.
            for what in ["module", "library"] {
                assert_ne!(o.get(what), "0", "{what} must not load: {ctx}");
            }
        }
    }
    // The same program with a working configuration takes all of it.
    let o = Run::hooked("256m").run(&["takes"]);
    for what in ["init", "retain", "create", "module", "library", "alloc"] {
        assert_eq!(o.get(what), "0", "{what}: {o}");
    }
}

#[test]
fn a_reset_primary_context_is_charged_again_when_retained() {
    // 256 MiB limit, 64 MiB per context: after cudaDeviceReset and a new retain, 224 MiB
    // no longer fit (192 MiB are left).
    for via in ["link", "procaddr"] {
        let o = Run::hooked("256m")
            .var("VGPU_SIM_CTX_OVERHEAD", "64m")
            .via(via)
            .run(&["reset", "234881024"]);
        let ctx = format!("via {via}:\n{o}");
        assert_eq!(o.u("used_first"), 64 * MIB, "{ctx}");
        assert_eq!(o.get("reset"), "0", "{ctx}");
        assert_eq!(
            o.u("used_again"),
            64 * MIB,
            "the new context is charged: {ctx}"
        );
        assert_eq!(o.get("alloc"), "2", "{ctx}");
    }
}

/// The lines of `stderr` that say the limits in force differ from the environment's.
fn limits_in_force_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("limits in force"))
        .collect()
}

#[test]
fn limits_in_force_that_differ_from_the_environment_are_said_at_the_default_level() {
    // A leftover file made without a limit: CUDA_DEVICE_MEMORY_LIMIT=1g then ran unlimited
    // without a word at the default level.
    let leftover = Run::hooked("0");
    leftover.run(&["try", "1048576"]);
    let o = leftover
        .clone()
        .var("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .run(&["try", "1048576"]);
    let lines = limits_in_force_lines(&o.stderr);
    assert_eq!(
        lines.len(),
        1,
        "one line at the default level:\n{}",
        o.stderr
    );
    assert!(
        lines[0].contains("unlimited") && lines[0].contains("1073741824"),
        "the line names what is in force and what the environment says: {}",
        lines[0]
    );
    // A file with the environment's own limits: nothing to say.
    let same = Run::hooked("1g");
    same.run(&["try", "1048576"]);
    let o = same.run(&["try", "1048576"]);
    assert!(limits_in_force_lines(&o.stderr).is_empty(), "{}", o.stderr);
    // The level-3 line names the limits in force, not the environment's.
    let stale = Run::hooked("512m");
    stale.run(&["try", "1048576"]);
    let o = stale
        .clone()
        .var("CUDA_DEVICE_MEMORY_LIMIT", "1g")
        .var("LIBCUDA_LOG_LEVEL", "3")
        .run(&["try", "1048576"]);
    let info: Vec<&str> = o
        .stderr
        .lines()
        .filter(|l| l.contains("INFO") && l.contains("memory limits"))
        .collect();
    assert!(!info.is_empty(), "{}", o.stderr);
    assert!(
        info.iter().all(|l| l.contains("0=536870912")),
        "the limits in force are the file's: {info:?}"
    );
}

#[test]
fn a_process_whose_cache_file_was_unlinked_or_replaced_stops_adding_to_the_old_ledger() {
    for replace in [false, true] {
        let run = Run::hooked("256m");
        let mut a = run.spawn(&["two_steps", "67108864", "67108864"]);
        a.wait_for("ready=");
        let cache = run.cache();
        std::fs::remove_file(&cache).expect("unlink the cache file");
        if replace {
            std::fs::write(&cache, b"").expect("an empty file under the same name");
        }
        // A newcomer makes a fresh ledger of its own: 200 MiB fit there.
        let b = run.run(&["try", "209715200"]);
        assert_eq!(b.get("alloc"), "0", "{}\n{}", b.stdout, b.stderr);
        // The first process's next reservation must not go on in the old ledger (64 + 64
        // MiB would fit there, but 200 MiB are held in the container's other ledger). The
        // hook checks the link at most once a second on direct allocations.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        a.send("go");
        let line = a.wait_for("second=");
        assert_eq!(line, "second=2", "replace={replace}");
        a.finish();
    }
}

#[test]
fn stream_ordered_pools_are_reconciled_with_what_the_driver_takes_for_them() {
    // PyTorch's cudaMallocAsync backend holding 300 + 700 + 1500 MiB on the H200: the driver
    // took ~70 MiB for the pool beyond what the pool reports, and the file stayed short by
    // that with NVML read from outside. Here each block a pool reserves costs 2 MiB more.
    let run = Run::hooked("1g").var("VGPU_SIM_POOL_BLOCK_OVERHEAD", "2m");
    let mut held = run.spawn(&["hold_async", "31457280", "73400320", "157286400"]);
    let out = held.read_until("hold=");
    let o = Out::parse(&out, "", None);
    for k in 0..3 {
        assert_eq!(o.get(&format!("async{k}")), "0", "{out}");
    }
    let nvml = o.u("nvml_self_used");
    assert_eq!(
        nvml,
        (30 + 70 + 150 + 3 * 2) * MIB,
        "the simulator's figure: {out}"
    );
    let snap = vgpu_shm::UsageTable::open_read_only(run.cache())
        .expect("open the shared file")
        .snapshot();
    let d = &snap.devices[0];
    assert_eq!(
        d.context + d.module + d.data,
        nvml,
        "the file against NVML read from outside the process: {d:?}"
    );
    held.finish();
}

/// Two simulated GPUs in one container (one shared file), 256 MiB each.
fn two_gpus() -> Run {
    Run::hooked("256m").var("VGPU_SIM_DEVICE_COUNT", "2")
}

#[test]
fn processes_seeing_different_gpus_are_charged_on_their_own_gpu() {
    let run = two_gpus();
    // The container's own view (both GPUs) makes the file, as a launcher does before its
    // ranks; its devices are the container's.
    assert_eq!(run.run(&["try", "1048576"]).get("alloc"), "0");
    let mut a = run
        .clone()
        .var("CUDA_VISIBLE_DEVICES", "0")
        .spawn(&["hold", "209715200"]);
    assert_eq!(a.wait_for("hold="), "hold=0");
    // GPU 1 is idle: a process that sees only it gets its 200 MiB.
    let b = run
        .clone()
        .var("CUDA_VISIBLE_DEVICES", "1")
        .run(&["try", "209715200"]);
    assert_eq!(
        b.get("alloc"),
        "0",
        "GPU 1 is idle:\n{}\n{}",
        b.stdout,
        b.stderr
    );
    // The file says which GPU holds it, under the right UUID (what HAMi's monitor reads).
    let snap = vgpu_shm::UsageTable::open_read_only(run.cache())
        .expect("open the shared file")
        .snapshot();
    assert_eq!(snap.devices.len(), 2, "{snap:?}");
    assert!(snap.devices[0].uuid.ends_with("d000"), "{snap:?}");
    assert!(snap.devices[1].uuid.ends_with("d001"), "{snap:?}");
    assert_eq!(snap.devices[0].data, 200 * MIB, "{snap:?}");
    assert_eq!(snap.devices[1].data, 0, "{snap:?}");
    // A process seeing both: GPU 0 is nearly full, GPU 1 empty, in both APIs.
    let c = run.run(&["info"]);
    assert_eq!(c.u("dev0_free"), 56 * MIB, "{}", c.stdout);
    assert_eq!(c.u("dev1_free"), 256 * MIB, "{}", c.stdout);
    assert_eq!(c.u("nvml0_used"), 200 * MIB, "{}", c.stdout);
    assert_eq!(c.u("nvml1_used"), 0, "{}", c.stdout);
    // One that sees only GPU 1 as its device 0: empty, in both APIs (NVML sees both GPUs).
    let d = run.clone().var("CUDA_VISIBLE_DEVICES", "1").run(&["info"]);
    assert_eq!(d.u("dev0_free"), 256 * MIB, "{}", d.stdout);
    assert_eq!(d.u("nvml0_used"), 200 * MIB, "{}", d.stdout);
    assert_eq!(d.u("nvml1_used"), 0, "{}", d.stdout);
    a.finish();
}

#[test]
fn per_device_limits_follow_the_gpu_not_the_process_ordinal() {
    // CUDA_DEVICE_MEMORY_LIMIT_<i> is the container's device i (docs/compatibility.md): a
    // process that sees only GPU 1 gets GPU 1's limit on its device 0.
    let run = two_gpus()
        .var("CUDA_DEVICE_MEMORY_LIMIT_0", "256m")
        .var("CUDA_DEVICE_MEMORY_LIMIT_1", "128m");
    assert_eq!(run.run(&["try", "1048576"]).get("alloc"), "0");
    let one = run.clone().var("CUDA_VISIBLE_DEVICES", "1");
    let o = one.run(&["info"]);
    assert_eq!(o.u("dev0_total_mem"), 128 * MIB, "{o}");
    assert_eq!(one.run(&["try", "209715200"]).get("alloc"), "2");
    let zero = run.clone().var("CUDA_VISIBLE_DEVICES", "0");
    assert_eq!(zero.run(&["try", "209715200"]).get("alloc"), "0");
    // Reversed order: device 0 of this process is GPU 1.
    let reversed = run.clone().var("CUDA_VISIBLE_DEVICES", "1,0");
    let o = reversed.run(&["info"]);
    assert_eq!(o.u("dev0_total_mem"), 128 * MIB, "{}", o.stdout);
    assert_eq!(o.u("dev1_total_mem"), 256 * MIB, "{}", o.stdout);
}

#[test]
fn workers_given_one_gpu_each_get_the_container_s_gpus_and_each_gpu_s_limit() {
    // A Ray-style launcher: no process of the container saw both GPUs before the workers,
    // each given one (`CUDA_VISIBLE_DEVICES`). The first one, on GPU 1, makes the file: its
    // GPUs are still the container's (NVML's, whatever CUDA_VISIBLE_DEVICES says), each
    // `_<i>` on the container's device i.
    let run = two_gpus()
        .var("CUDA_DEVICE_MEMORY_LIMIT_0", "256m")
        .var("CUDA_DEVICE_MEMORY_LIMIT_1", "128m");
    let on_gpu1 = run.clone().var("CUDA_VISIBLE_DEVICES", "1");
    let o = on_gpu1.run(&["try", "209715200"]);
    assert_eq!(o.get("alloc"), "2", "GPU 1's limit is 128 MiB:\n{o}");
    let snap = vgpu_shm::UsageTable::open_read_only(run.cache())
        .expect("open the shared file")
        .snapshot();
    let listed: Vec<(&str, Option<u64>)> = snap
        .devices
        .iter()
        .map(|d| (&d.uuid[d.uuid.len() - 4..], d.limit))
        .collect();
    assert_eq!(
        listed,
        [("d000", Some(256 * MIB)), ("d001", Some(128 * MIB))],
        "{snap:?}"
    );
    // The worker on GPU 0 is in the file too, under GPU 0's limit.
    let on_gpu0 = run.clone().var("CUDA_VISIBLE_DEVICES", "0");
    let o = on_gpu0.run(&["try", "209715200"]);
    assert_eq!(o.get("alloc"), "0", "{o}");
    assert_eq!(on_gpu1.run(&["info"]).u("dev0_total_mem"), 128 * MIB);
    assert_eq!(on_gpu0.run(&["info"]).u("dev0_total_mem"), 256 * MIB);
}

#[test]
fn a_gpu_the_file_does_not_list_is_refused_with_a_clear_error() {
    // A file that lists only GPU 0 (made where the container had only that GPU): a process
    // that sees GPU 1 too cannot be charged on it: refused, with a line naming the GPU.
    let run = two_gpus();
    let init = vgpu_shm::TableInit {
        uuids: vec!["GPU-5a1e5130-0000-4000-8000-00000000d000".into()],
        memory_limits: vec![Some(256 * MIB)],
        sm_limits: vec![None],
        priority: 1,
    };
    drop(vgpu_shm::UsageTable::open_or_create(run.cache(), &init).expect("make the file"));
    let o = run.clone().var("CUDA_VISIBLE_DEVICES", "1").run(&["takes"]);
    assert_eq!(o.get("retain"), "2", "its context is refused:\n{o}");
    assert_eq!(o.get("create"), "2", "{}", o.stdout);
    assert!(
        o.stderr
            .contains("GPU-5a1e5130-0000-4000-8000-00000000d001"),
        "the line names the GPU: {}",
        o.stderr
    );
    // The file's GPU still works for it.
    let o = run
        .var("CUDA_VISIBLE_DEVICES", "0")
        .run(&["try", "1048576"]);
    assert_eq!(o.get("alloc"), "0");
}
