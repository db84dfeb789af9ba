//! Issue 12's defects on the hook's side, end to end on the simulated driver: fork after NVML,
//! enforcement with a bad configuration, a reset primary context, the limits in force, an
//! unlinked cache file, stream-ordered pools and processes seeing different GPUs.
//!
//! Each test fails on the hook before its fix. Needs `libvgpu.so` and `libvgpusim.so` in the
//! target directory: run `cargo xtask test`.

mod support;

use support::*;

const VIAS: [&str; 4] = ["link", "dlsym", "procaddr", "ptsz"];

/// Runs `probe fork_after <mode>`: the parent does `mode`, a forked child then uses CUDA.
fn fork_after(run: &Run, mode: &str) -> Out {
    run.run(&["fork_after", mode, "67108864", "536870912"])
}

#[test]
fn a_child_forked_after_nvml_uses_cuda_whichever_way_the_driver_is_reached() {
    for via in VIAS {
        let run = Run::hooked("256m").via(via);
        let o = fork_after(&run, "nvml");
        let ctx = format!("via {via}:\n{}\nstderr:\n{}", o.stdout, o.stderr);
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
