//! End to end: the environment's grammar as the hook applies it (`vgpu-env`), on the
//! simulated driver. Each test checks a line or a refusal the bare driver never gives.
//! Needs `libvgpu.so` and `libvgpusim.so` in the target directory: run `cargo xtask test`.

mod support;

use support::*;

fn lines_with<'a>(stderr: &'a str, needle: &str) -> Vec<&'a str> {
    stderr.lines().filter(|l| l.contains(needle)).collect()
}

#[test]
fn a_log_level_that_is_not_a_level_is_reported_once_and_the_default_is_used() {
    // Level 4 shows debug lines on this path: the check below can fail.
    let debug = Run::hooked("256m")
        .var("LIBCUDA_LOG_LEVEL", "4")
        .run(&["try", "4096"]);
    assert_eq!(debug.get("alloc"), "0");
    assert!(
        !lines_with(&debug.stderr, " DEBUG]").is_empty(),
        "level 4 logs debug lines:\n{}",
        debug.stderr
    );
    for bad in ["99", "5", "loud"] {
        let o = Run::hooked("256m")
            .var("LIBCUDA_LOG_LEVEL", bad)
            .run(&["try", "4096"]);
        assert_eq!(
            o.get("alloc"),
            "0",
            "a bad log level never disables the GPU"
        );
        let reports = lines_with(&o.stderr, "LIBCUDA_LOG_LEVEL");
        assert_eq!(reports.len(), 1, "reported once:\n{}", o.stderr);
        assert!(
            reports[0].contains(&format!("invalid LIBCUDA_LOG_LEVEL=\"{bad}\""))
                && reports[0].contains("using the default"),
            "{}",
            reports[0]
        );
        for level in [" DEBUG]", " INFO]"] {
            assert!(
                lines_with(&o.stderr, level).is_empty(),
                "LIBCUDA_LOG_LEVEL={bad} must log at the default level 2, not {level}:\n{}",
                o.stderr
            );
        }
    }
}

#[test]
fn a_per_device_variable_outside_hamis_grammar_is_refused_with_a_clear_line() {
    for (name, value) in [
        ("CUDA_DEVICE_MEMORY_LIMIT_16", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_00", "1g"),
        ("CUDA_DEVICE_SM_LIMIT_99", "50"),
    ] {
        let o = Run::hooked("256m").var(name, value).run(&["try", "4096"]);
        // Refused (a broken configuration refuses cuInit), not run with the variable ignored.
        assert_eq!(
            o.get("init"),
            "3",
            "{name}: CUDA_ERROR_NOT_INITIALIZED\n{}\n{}",
            o.stdout,
            o.stderr
        );
        let lines = lines_with(&o.stderr, &format!("invalid {name}=\"{value}\""));
        assert!(
            !lines.is_empty() && lines[0].contains("bad configuration"),
            "{name}: one line naming the variable:\n{}",
            o.stderr
        );
    }
}

#[test]
fn a_per_device_limit_for_a_device_the_container_lacks_is_warned_about() {
    // One simulated device: the limit for device 3 limits nothing here, and says so.
    let o = Run::hooked("256m")
        .var("VGPU_SIM_DEVICE_COUNT", "1")
        .var("CUDA_DEVICE_MEMORY_LIMIT_3", "1g")
        .run(&["try", "4096"]);
    assert_eq!(o.get("alloc"), "0", "a warning, not a refusal");
    let lines = lines_with(&o.stderr, "CUDA_DEVICE_MEMORY_LIMIT_3 is set");
    assert_eq!(lines.len(), 1, "{}", o.stderr);
    assert!(
        lines[0].contains(" WARN]") && lines[0].contains("the container has 1 GPU(s)"),
        "{}",
        lines[0]
    );
    // A device that exists: no such line.
    let o = Run::hooked("256m")
        .var("CUDA_DEVICE_MEMORY_LIMIT_0", "1g")
        .run(&["try", "4096"]);
    assert!(!o.stderr.contains("is set, but"), "{}", o.stderr);
}

#[test]
fn a_swap_setting_that_is_not_one_is_reported_once_and_swapping_stays_off() {
    for (var, bad) in [
        ("VGPU_IDLE_SWAP", "soon"),
        ("VGPU_SWAP_IN_WAIT", "1.5s"),
        ("VGPU_SWAP_MOVABLE", "yes please"),
        ("VGPU_SWAP_KEEP_HOST", "later"),
    ] {
        let o = Run::hooked("256m").var(var, bad).run(&["try", "4096"]);
        assert_eq!(
            o.get("alloc"),
            "0",
            "{var}: a bad value never disables the GPU"
        );
        let reports = lines_with(&o.stderr, var);
        assert_eq!(reports.len(), 1, "{var} reported once:\n{}", o.stderr);
        assert!(
            reports[0].contains(&format!("invalid {var}=\"{bad}\"")),
            "{}",
            reports[0]
        );
    }
}
