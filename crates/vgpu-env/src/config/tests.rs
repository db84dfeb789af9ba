use super::*;

const MIB: u64 = 1 << 20;

const GIB: u64 = 1 << 30;

#[test]
fn the_turn_dir_parses_and_retired_tuning_warns_without_effect() {
    let d = lenient(&[]).unwrap().sm_tuning;
    assert_eq!(d, SmTuning::default());
    assert_eq!(d.turn_dir.as_deref(), Some("/tmp/vgpulock"));
    let cfg = lenient(&[("VGPU_TURN_DIR", " /run/vgpu ")]).unwrap();
    assert_eq!(cfg.sm_tuning.turn_dir.as_deref(), Some("/run/vgpu"));
    assert!(cfg.warnings.is_empty());
    let off = lenient(&[("VGPU_TURN_DIR", "OFF")]).unwrap();
    assert_eq!(off.sm_tuning.turn_dir, None);
    let old = lenient(&[
        ("VGPU_TURN_CYCLE_MS", "40"),
        ("VGPU_SM_POWER_EXPONENT", "0.5"),
    ])
    .unwrap();
    assert_eq!(old.sm_tuning, SmTuning::default());
    assert_eq!(
        variables(&old.warnings),
        ["VGPU_TURN_CYCLE_MS", "VGPU_SM_POWER_EXPONENT"]
    );
}

#[test]
fn empty_environment_gives_defaults() {
    let cfg = Config::from_vars(&Vars::default()).unwrap();
    assert_eq!(cfg, Config::default());
    assert_eq!(cfg.memory_limit, [None; MAX_DEVICES]);
    assert_eq!(cfg.shared_cache, "/tmp/cudevshr.cache");
    assert_eq!((cfg.task_priority, cfg.log_level), (1, 2));
    assert!(cfg.allocator.suballoc && cfg.count_managed);
    assert_eq!(cfg.allocator.chunks_per_region(), 262_144);
    assert_eq!(cfg.allocator.suballoc_threshold, 2 * MIB);
    assert_eq!(cfg.allocator.align, 2 * MIB);
}

#[test]
fn per_device_limits_override_the_default() {
    let cfg = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "1024m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_2", "0"),
        ("CUDA_DEVICE_MEMORY_LIMIT_15", "1.5GiB"),
        ("CUDA_DEVICE_SM_LIMIT", "50"),
        ("CUDA_DEVICE_SM_LIMIT_3", "100"),
        ("CUDA_DEVICE_SM_LIMIT_4", "0"),
        ("CUDA_DEVICE_SM_LIMIT_5", " 25 "),
    ])
    .unwrap();
    assert_eq!(cfg.memory_limit[0], Some(4 * GIB));
    assert_eq!(cfg.memory_limit[1], Some(GIB));
    assert_eq!(cfg.memory_limit[2], None);
    assert_eq!(cfg.memory_limit[14], Some(4 * GIB));
    assert_eq!(cfg.memory_limit[15], Some(3 * GIB / 2));
    assert_eq!(cfg.sm_limit[0], Some(50));
    assert_eq!(cfg.sm_limit[3], None);
    assert_eq!(cfg.sm_limit[4], None);
    assert_eq!(cfg.sm_limit[5], Some(25));
    // A per-device value alone limits only that device.
    let cfg = Config::from_pairs([("CUDA_DEVICE_MEMORY_LIMIT_3", "2g")]).unwrap();
    assert_eq!(cfg.memory_limit[3], Some(2 * GIB));
    assert_eq!(cfg.memory_limit[0], None);
}

#[test]
fn other_variables_parse() {
    let cfg = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/usr/local/vgpu/x.cache"),
        ("GPU_CORE_UTILIZATION_POLICY", "FORCE"),
        ("CUDA_TASK_PRIORITY", "-3"),
        ("LIBCUDA_LOG_LEVEL", "4"),
        ("ACTIVE_OOM_KILLER", "true"),
        ("CUDA_VISIBLE_DEVICES", "1, GPU-8b3c-aa,MIG-1f2e/1/0,bogus"),
        ("VGPU_SUBALLOC", "0"),
        ("VGPU_COUNT_MANAGED", "0"),
        ("VGPU_ALLOC_OVERSIZE", "64m"),
        ("VGPU_ALLOC_BITSIZE", "1k"),
        ("VGPU_ALLOC_IPCSIZE", "1m"),
        ("VGPU_ALLOC_ALIGN", "64k"),
    ])
    .unwrap();
    assert_eq!(cfg.shared_cache, "/usr/local/vgpu/x.cache");
    assert_eq!(cfg.core_policy, Policy::Force);
    assert_eq!(cfg.task_priority, -3);
    assert_eq!(cfg.log_level, 4);
    assert_eq!(cfg.active_oom_killer.as_deref(), Some("true"));
    assert_eq!(
        cfg.visible_devices,
        Some(vec![
            DeviceSelector::Index(1),
            DeviceSelector::Uuid("GPU-8b3c-aa".into()),
            DeviceSelector::Mig("MIG-1f2e/1/0".into()),
            DeviceSelector::Other("bogus".into()),
        ])
    );
    assert!(!cfg.allocator.suballoc && !cfg.count_managed);
    assert_eq!(
        cfg.allocator,
        AllocatorConfig {
            suballoc: false,
            region_size: 64 * MIB,
            chunk_size: 1024,
            suballoc_threshold: MIB,
            align: 64 * 1024,
        }
    );
    for (p, want) in [
        ("disable", Policy::Disable),
        ("Monitor", Policy::Monitor),
        ("Default", Policy::Default),
        ("force", Policy::Force),
    ] {
        let cfg = Config::from_pairs([("GPU_CORE_UTILIZATION_POLICY", p)]).unwrap();
        assert_eq!(cfg.core_policy, want);
    }
    let cfg = Config::from_pairs([("CUDA_VISIBLE_DEVICES", "")]).unwrap();
    assert_eq!(cfg.visible_devices, Some(vec![]));
}

#[test]
fn host_backing_is_off_unless_asked_and_a_typo_is_an_error() {
    assert!(!Config::default().host_backing.enabled());
    let cfg = Config::from_pairs([("CUDA_OVERSUBSCRIBE", "true")]).unwrap();
    assert_eq!(
        cfg.host_backing,
        HostBacking {
            oversubscribe: true,
            spill: 0,
            device_reserve: 0,
        }
    );
    assert!(cfg.host_backing.enabled());
    for off in ["false", "0", "", "FALSE"] {
        let cfg = Config::from_pairs([("CUDA_OVERSUBSCRIBE", off)]).unwrap();
        assert!(!cfg.host_backing.enabled(), "{off:?}");
    }
    let cfg =
        Config::from_pairs([("VGPU_HOST_SPILL", "8g"), ("VGPU_DEVICE_RESERVE", "1g")]).unwrap();
    assert_eq!(cfg.host_backing.spill, 8 << 30);
    assert_eq!(cfg.host_backing.device_reserve, 1 << 30);
    assert!(!cfg.host_backing.oversubscribe && cfg.host_backing.enabled());
    let err = lenient(&[("CUDA_OVERSUBSCRIBE", "yes"), ("VGPU_HOST_SPILL", "lots")]).unwrap_err();
    assert_eq!(variables(&err.0), ["CUDA_OVERSUBSCRIBE", "VGPU_HOST_SPILL"]);
}

#[test]
fn all_errors_are_collected_and_name_variable_and_value() {
    let err = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_LIMIT", "0x10"),
        ("CUDA_DEVICE_MEMORY_LIMIT_7", "4gx"),
        ("CUDA_DEVICE_SM_LIMIT", "50g"),
        ("CUDA_DEVICE_SM_LIMIT_2", "101"),
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", " "),
        ("GPU_CORE_UTILIZATION_POLICY", "sometimes"),
        ("CUDA_TASK_PRIORITY", "high"),
        ("LIBCUDA_LOG_LEVEL", "5"),
        ("VGPU_SUBALLOC", "yes"),
        ("VGPU_COUNT_MANAGED", "2"),
        ("VGPU_ALLOC_ALIGN", "-1"),
    ])
    .unwrap_err();
    let names = variables(&err.0);
    assert_eq!(
        names,
        [
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_SM_LIMIT",
            "CUDA_DEVICE_SM_LIMIT_2",
            "CUDA_DEVICE_MEMORY_LIMIT_7",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "GPU_CORE_UTILIZATION_POLICY",
            "CUDA_TASK_PRIORITY",
            "LIBCUDA_LOG_LEVEL",
            "VGPU_SUBALLOC",
            "VGPU_COUNT_MANAGED",
            "VGPU_ALLOC_ALIGN",
        ]
    );
    assert_eq!(err.0[0].value, "0x10");
    let text = err.to_string();
    assert!(
        text.contains("invalid CUDA_DEVICE_MEMORY_LIMIT_7=\"4gx\""),
        "{text}"
    );
    assert!(
        text.contains("invalid CUDA_DEVICE_SM_LIMIT=\"50g\""),
        "{text}"
    );
}

/// The variables named by `errors` (errors or warnings), in order.
fn variables(errors: &[ConfigError]) -> Vec<&str> {
    errors.iter().map(|e| e.variable.as_str()).collect()
}

fn lenient(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
    Config::from_vars_with_warnings(&Vars::from_pairs(pairs.iter().copied()))
}

#[test]
fn share_mode_and_ceiling_are_opt_in_and_checked() {
    let cfg = Config::from_pairs([("CUDA_DEVICE_SM_LIMIT", "30")]).unwrap();
    assert_eq!((cfg.sm_mode, cfg.sm_ceiling), (SmMode::Cap, None));
    let cfg = Config::from_pairs([("VGPU_SM_MODE", "Share"), ("VGPU_SM_CEILING", "60")]).unwrap();
    assert_eq!((cfg.sm_mode, cfg.sm_ceiling), (SmMode::Share, Some(60)));
    for (name, bad) in [
        ("VGPU_SM_MODE", "elastic"),
        ("VGPU_SM_CEILING", "150"),
        ("VGPU_SM_CEILING", "0"),
        ("VGPU_SM_CEILING", "00"),
    ] {
        let err = Config::from_vars_with_warnings(&Vars::from_pairs([(name, bad)]))
            .expect_err("enforcement: a bad value is fatal");
        assert_eq!(err.0[0].variable, name);
    }
}

#[test]
fn a_bad_log_level_or_priority_is_a_warning_not_an_error() {
    let pairs = [
        ("LIBCUDA_LOG_LEVEL", "verbose"),
        ("CUDA_TASK_PRIORITY", "high"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "1g"),
    ];
    let cfg = lenient(&pairs).expect("a log level or priority typo must not disable the GPU");
    assert_eq!(cfg.memory_limit[0], Some(GIB), "the limit still applies");
    assert_eq!((cfg.log_level, cfg.task_priority), (2, 1), "defaults kept");
    assert_eq!(
        variables(&cfg.warnings),
        ["CUDA_TASK_PRIORITY", "LIBCUDA_LOG_LEVEL"]
    );
    assert_eq!(cfg.warnings[1].value, "verbose");
    assert!(
        lenient(&[("LIBCUDA_LOG_LEVEL", "4")])
            .unwrap()
            .warnings
            .is_empty()
    );
    // The strict parse (pre-flight checks) still refuses both.
    assert_eq!(Config::from_pairs(pairs).unwrap_err().0.len(), 2);
    // A warning never hides an error beside it; both are named.
    let err = lenient(&[
        ("LIBCUDA_LOG_LEVEL", "9"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "lots"),
    ])
    .unwrap_err();
    assert_eq!(
        variables(&err.0),
        ["CUDA_DEVICE_MEMORY_LIMIT", "LIBCUDA_LOG_LEVEL"]
    );
}

#[test]
fn reconcile_interval_parses_off_and_warns_on_typos() {
    assert_eq!(lenient(&[]).unwrap().reconcile_ms, Some(100));
    assert_eq!(
        lenient(&[("VGPU_RECONCILE_MS", "0")]).unwrap().reconcile_ms,
        Some(0)
    );
    assert_eq!(
        lenient(&[("VGPU_RECONCILE_MS", " 250 ")])
            .unwrap()
            .reconcile_ms,
        Some(250)
    );
    assert_eq!(
        lenient(&[("VGPU_RECONCILE_MS", "OFF")])
            .unwrap()
            .reconcile_ms,
        None
    );
    let cfg = lenient(&[("VGPU_RECONCILE_MS", "10ms")]).unwrap();
    assert_eq!(cfg.reconcile_ms, Some(100), "the default is kept");
    assert_eq!(cfg.warnings[0].variable, "VGPU_RECONCILE_MS");
    assert!(Config::from_pairs([("VGPU_RECONCILE_MS", "-1")]).is_err());
}

#[test]
fn a_bad_limit_is_never_unlimited() {
    for bad in ["", "abc", "1.5", "-4g", "0x100000", "4g garbage", "nan"] {
        for r in [
            Config::from_pairs([("CUDA_DEVICE_MEMORY_LIMIT", bad)]),
            lenient(&[("CUDA_DEVICE_MEMORY_LIMIT", bad)]),
        ] {
            let err = r.expect_err(bad);
            assert_eq!(err.0.len(), 1, "{bad:?}");
            assert_eq!(err.0[0].variable, "CUDA_DEVICE_MEMORY_LIMIT");
        }
    }
}

#[test]
fn inconsistent_allocator_sizes_are_rejected() {
    for pairs in [
        vec![("VGPU_ALLOC_BITSIZE", "500")],
        vec![("VGPU_ALLOC_ALIGN", "3m")],
        vec![("VGPU_ALLOC_ALIGN", "0")],
        vec![("VGPU_ALLOC_OVERSIZE", "1m"), ("VGPU_ALLOC_IPCSIZE", "2m")],
        vec![("VGPU_ALLOC_OVERSIZE", "1000")],
        vec![("VGPU_ALLOC_OVERSIZE", "0")],
    ] {
        let err = Config::from_pairs(pairs.clone()).expect_err(&format!("{pairs:?}"));
        assert_eq!(err.0.len(), 1);
        assert_eq!(err.0[0].variable, "VGPU_ALLOC_*");
    }
}

#[test]
fn per_device_names_outside_hamis_grammar_are_errors() {
    let bad = [
        ("CUDA_DEVICE_MEMORY_LIMIT_16", "1g", "out of range"),
        ("CUDA_DEVICE_MEMORY_LIMIT_99", "1g", "out of range"),
        ("CUDA_DEVICE_MEMORY_LIMIT_00", "1g", "leading zeros (_0)"),
        ("CUDA_DEVICE_MEMORY_LIMIT_", "1g", "must be a device index"),
        ("CUDA_DEVICE_MEMORY_LIMIT_X", "1g", "must be a device index"),
        (
            "CUDA_DEVICE_MEMORY_LIMIT_99999999999999999999999",
            "1g",
            "out of range",
        ),
        ("CUDA_DEVICE_SM_LIMIT_99", "50", "out of range"),
        ("CUDA_DEVICE_SM_LIMIT_-1", "50", "must be a device index"),
    ];
    for (name, value, why) in bad {
        for r in [
            Config::from_pairs([(name, value)]),
            lenient(&[(name, value)]),
        ] {
            let err = r.expect_err(name);
            assert_eq!(err.0.len(), 1, "{name}");
            assert_eq!(
                (err.0[0].variable.as_str(), err.0[0].value.as_str()),
                (name, value)
            );
            assert!(err.0[0].reason.contains(why), "{name}: {}", err.0[0].reason);
            assert!(
                err.0[0].reason.contains("0..=15") || why.contains("zeros"),
                "{}",
                err.0[0].reason
            );
        }
    }
    // All of them are named at once, after the values' own errors, in name order.
    let err = Config::from_pairs([
        ("CUDA_DEVICE_SM_LIMIT_99", "50"),
        ("CUDA_DEVICE_MEMORY_LIMIT_16", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_3", "lots"),
        ("CUDA_DEVICE_MEMORY_LIMIT_15", "1g"),
    ])
    .unwrap_err();
    let names = variables(&err.0);
    assert_eq!(
        names,
        [
            "CUDA_DEVICE_MEMORY_LIMIT_3",
            "CUDA_DEVICE_MEMORY_LIMIT_16",
            "CUDA_DEVICE_SM_LIMIT_99"
        ]
    );
    // Names that only share the beginning are other variables.
    let cfg = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_LIMITS", "x"),
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/a.cache"),
        ("CUDA_DEVICE_SM_LIMITED", "x"),
    ])
    .unwrap();
    assert!(cfg.per_device.is_empty());
}

#[test]
fn a_size_that_rounds_to_zero_bytes_is_not_unlimited() {
    for pairs in [
        vec![("CUDA_DEVICE_MEMORY_LIMIT", "0.0001k")],
        vec![("CUDA_DEVICE_MEMORY_LIMIT_2", "0.0001k")],
        vec![("VGPU_ALLOC_ALIGN", "0.0001k")],
    ] {
        let err = Config::from_pairs(pairs.clone()).expect_err(&format!("{pairs:?}"));
        assert_eq!(err.0.len(), 1);
        assert!(err.0[0].reason.contains("rounds down to 0 bytes"), "{err}");
    }
    // Zero written as a fraction is still zero, i.e. unlimited.
    let cfg = Config::from_pairs([("CUDA_DEVICE_MEMORY_LIMIT", "0.0g")]).unwrap();
    assert_eq!(cfg.memory_limit[0], None);
}

#[test]
fn per_device_values_for_absent_devices_are_warned_about() {
    let cfg = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_3", "2g"),
        ("CUDA_DEVICE_SM_LIMIT_15", "30"),
    ])
    .unwrap();
    assert_eq!(
        cfg.per_device,
        [
            ("CUDA_DEVICE_MEMORY_LIMIT_0".to_owned(), 0),
            ("CUDA_DEVICE_MEMORY_LIMIT_3".to_owned(), 3),
            ("CUDA_DEVICE_SM_LIMIT_15".to_owned(), 15),
        ]
    );
    assert!(cfg.absent_device_warnings(16).is_empty());
    let w = cfg.absent_device_warnings(2);
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].starts_with("CUDA_DEVICE_MEMORY_LIMIT_3 is set"),
        "{}",
        w[0]
    );
    assert!(w[0].contains("the container has 2 GPU(s)"), "{}", w[0]);
    assert!(
        w[1].starts_with("CUDA_DEVICE_SM_LIMIT_15 is set"),
        "{}",
        w[1]
    );
    assert_eq!(cfg.absent_device_warnings(0).len(), 3);
}

const U0: &str = "GPU-5a1e5130-0000-4000-8000-0000000c0de0";
const U1: &str = "GPU-5a1e5130-0000-4000-8000-0000000c0de1";

#[test]
fn limits_by_uuid_land_on_their_gpu_and_win_over_the_index() {
    let mut cfg = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "2g"),
        (
            "CUDA_DEVICE_MEMORY_LIMIT_GPU-5A1E5130-0000-4000-8000-0000000C0DE1",
            "512m",
        ),
        (
            "CUDA_DEVICE_SM_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0de0",
            "30",
        ),
        (
            "CUDA_DEVICE_SM_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0de9",
            "10",
        ),
    ])
    .unwrap();
    assert_eq!(cfg.limits_by_uuid.len(), 3);
    assert_eq!(
        cfg.limits_by_uuid[0].uuid, U1,
        "lowercase, as NVML prints it"
    );
    // Before the devices are known, the index and default forms only.
    assert_eq!(cfg.memory_limit[..2], [Some(2 * GIB), Some(4 * GIB)]);
    // GPU 1 is the container's device 0 here, GPU 0 its device 1.
    let warnings = cfg.apply_device_uuids(&[U1.to_owned(), U0.to_owned()]);
    assert_eq!(
        cfg.memory_limit[..3],
        [Some(512 * MIB), Some(4 * GIB), Some(4 * GIB)]
    );
    assert_eq!(cfg.sm_limit[..3], [None, Some(30), None]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0]
            .starts_with("CUDA_DEVICE_SM_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0de9 is set")
            && warnings[0].contains("the container has no GPU"),
        "{}",
        warnings[0]
    );
}

#[test]
fn an_unknown_device_list_gives_every_device_the_smallest_uuid_limit() {
    let mut cfg = Config::from_pairs([
        (format!("CUDA_DEVICE_MEMORY_LIMIT_{U0}"), "1g"),
        (format!("CUDA_DEVICE_MEMORY_LIMIT_{U1}"), "3g"),
        ("CUDA_DEVICE_MEMORY_LIMIT".to_owned(), "2g"),
    ])
    .unwrap();
    let w = cfg.apply_device_uuids(&[]);
    assert_eq!(cfg.memory_limit, [Some(GIB); MAX_DEVICES]);
    assert_eq!(
        cfg.sm_limit, [None; MAX_DEVICES],
        "no SM limit by UUID: unchanged"
    );
    assert!(w[0].contains("UUIDs are unknown"), "{w:?}");
    // Without UUID limits there is nothing to say.
    let mut plain = Config::from_pairs([("CUDA_DEVICE_MEMORY_LIMIT", "2g")]).unwrap();
    assert!(plain.apply_device_uuids(&[]).is_empty());
    assert_eq!(plain.memory_limit[0], Some(2 * GIB));
}

#[test]
fn malformed_or_repeated_uuid_names_are_errors() {
    for (name, value, why) in [
        ("CUDA_DEVICE_MEMORY_LIMIT_GPU-12", "1g", "GPU-xxxxxxxx"),
        (
            "CUDA_DEVICE_SM_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0dez",
            "5",
            "hex",
        ),
        (
            "CUDA_DEVICE_MEMORY_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0de0",
            "lots",
            "size",
        ),
        (
            "CUDA_DEVICE_SM_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0de0",
            "150",
            "percentage",
        ),
    ] {
        let err = lenient(&[(name, value)]).expect_err(name);
        assert_eq!(variables(&err.0), [name]);
        assert!(err.0[0].reason.contains(why), "{name}: {}", err.0[0].reason);
    }
    let err = Config::from_pairs([
        (format!("CUDA_DEVICE_MEMORY_LIMIT_{U0}"), "1g"),
        (
            format!("CUDA_DEVICE_MEMORY_LIMIT_{}", U0.to_ascii_uppercase()),
            "2g",
        ),
    ])
    .unwrap_err();
    assert!(
        err.0[0].reason.contains("named by another variable"),
        "{err}"
    );
}

/// The environment HAMi's DRA driver writes for a two-GPU claim: indexed in map order.
fn dra_claim(pairs: &[(&str, &str)]) -> Config {
    let cache = "/usr/local/vgpu/claims/0c3f5b1e-8d6a-4f7e-9a51-2d3c4b5a6f70/1f0e.cache";
    let mut all = vec![("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache)];
    all.extend_from_slice(pairs);
    lenient(&all).unwrap()
}

#[test]
fn a_dra_claims_indexed_limits_give_every_gpu_the_smallest_when_they_differ() {
    let cfg = dra_claim(&[
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "8192m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "4096m"),
        ("CUDA_DEVICE_SM_LIMIT_0", "60"),
        ("CUDA_DEVICE_SM_LIMIT_1", "30"),
    ]);
    assert_eq!(cfg.layout, Layout::HamiDraClaim);
    assert_eq!(cfg.memory_limit, [Some(4 * GIB); MAX_DEVICES]);
    assert_eq!(cfg.sm_limit, [Some(30); MAX_DEVICES]);
    assert_eq!(cfg.notices.len(), 2, "{:?}", cfg.notices);
    assert!(
        cfg.notices[0].starts_with(
            "CUDA_DEVICE_MEMORY_LIMIT_0=8192m, CUDA_DEVICE_MEMORY_LIMIT_1=4096m differ; every GPU is limited to 4096m"
        ) && cfg.notices[0].contains("_GPU_<uuid>"),
        "{}",
        cfg.notices[0]
    );
    // UUID limits then put each GPU's own value back.
    let mut cfg = dra_claim(&[
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "8192m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "4096m"),
        (&format!("CUDA_DEVICE_MEMORY_LIMIT_{U0}"), "4096m"),
        (&format!("CUDA_DEVICE_MEMORY_LIMIT_{U1}"), "8192m"),
    ]);
    assert!(cfg.apply_device_uuids(&[U0.into(), U1.into()]).is_empty());
    assert_eq!(cfg.memory_limit[..2], [Some(4 * GIB), Some(8 * GIB)]);
    // The same value everywhere (HAMi-DRA's webhook asks one capacity for all): no note.
    let cfg = dra_claim(&[
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "4096m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "4096m"),
        ("CUDA_DEVICE_SM_LIMIT_0", "100"),
        ("CUDA_DEVICE_SM_LIMIT_1", "0"),
    ]);
    assert_eq!(cfg.memory_limit, [Some(4 * GIB); MAX_DEVICES]);
    assert_eq!(cfg.sm_limit, [None; MAX_DEVICES]);
    assert!(cfg.notices.is_empty(), "{:?}", cfg.notices);
    // Unlimited on one index is not the smallest.
    let cfg = dra_claim(&[
        ("CUDA_DEVICE_SM_LIMIT_0", "0"),
        ("CUDA_DEVICE_SM_LIMIT_1", "40"),
    ]);
    assert_eq!(cfg.sm_limit, [Some(40); MAX_DEVICES]);
    // Nothing indexed: the default.
    let cfg = dra_claim(&[("CUDA_DEVICE_MEMORY_LIMIT", "1g")]);
    assert_eq!(cfg.memory_limit, [Some(GIB); MAX_DEVICES]);
    // Under HAMi's device plugin the same variables are ordinals.
    let cfg = Config::from_pairs([
        (
            "CUDA_DEVICE_MEMORY_SHARED_CACHE",
            "/usr/local/vgpu/1f0e.cache",
        ),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "8192m"),
        ("CUDA_DEVICE_MEMORY_LIMIT_1", "4096m"),
    ])
    .unwrap();
    assert_eq!(cfg.memory_limit[..3], [Some(8 * GIB), Some(4 * GIB), None]);
    assert!(cfg.notices.is_empty());
}

#[test]
fn oversubscribe_is_memory_scaling_except_under_volcano() {
    let with = |cache: &str| {
        Config::from_pairs([
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", cache),
            ("CUDA_OVERSUBSCRIBE", "true"),
        ])
        .unwrap()
    };
    assert!(with("/usr/local/vgpu/a.cache").host_backing.oversubscribe);
    assert!(with("/tmp/a.cache").host_backing.oversubscribe);
    let volcano = with("/tmp/vgpu/a.cache");
    assert_eq!(volcano.layout, Layout::Volcano);
    assert!(
        !volcano.host_backing.enabled(),
        "Volcano sets it for core scaling"
    );
    // vgpu's own switch still works there.
    let cfg = Config::from_pairs([
        ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/a.cache"),
        ("CUDA_OVERSUBSCRIBE", "true"),
        ("VGPU_HOST_SPILL", "4g"),
    ])
    .unwrap();
    assert!(cfg.host_backing.enabled() && !cfg.host_backing.oversubscribe);
    // A typo is still an error there.
    assert!(
        Config::from_pairs([
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", "/tmp/vgpu/a.cache"),
            ("CUDA_OVERSUBSCRIBE", "yes"),
        ])
        .is_err()
    );
}

#[test]
fn device_selectors_classify() {
    assert_eq!(DeviceSelector::parse(" 3 "), DeviceSelector::Index(3));
    assert_eq!(
        DeviceSelector::parse("99999999999"),
        DeviceSelector::Other("99999999999".into())
    );
    assert_eq!(
        DeviceSelector::parse("-1"),
        DeviceSelector::Other("-1".into())
    );
}

#[test]
fn idle_swap_takes_a_duration_manual_or_off_and_a_typo_is_a_warning() {
    use crate::SwapTrigger;
    assert_eq!(lenient(&[]).unwrap().swap.trigger, SwapTrigger::Off);
    assert!(!lenient(&[]).unwrap().swap.enabled());
    for (v, want) in [
        ("30s", SwapTrigger::Idle(30_000)),
        ("500ms", SwapTrigger::Idle(500)),
        (" 5m ", SwapTrigger::Idle(300_000)),
        ("1h", SwapTrigger::Idle(3_600_000)),
        ("manual", SwapTrigger::Manual),
        ("off", SwapTrigger::Off),
        ("", SwapTrigger::Off),
    ] {
        assert_eq!(
            lenient(&[("VGPU_IDLE_SWAP", v)]).unwrap().swap.trigger,
            want,
            "{v:?}"
        );
    }
    for bad in ["30", "0s", "-1s", "1.5s", "2d", "25h", "soon"] {
        let cfg = lenient(&[("VGPU_IDLE_SWAP", bad)]).unwrap();
        assert_eq!(cfg.swap.trigger, SwapTrigger::Off, "{bad:?}");
        assert_eq!(variables(&cfg.warnings), ["VGPU_IDLE_SWAP"]);
        assert!(
            Config::from_pairs([("VGPU_IDLE_SWAP", bad)]).is_err(),
            "{bad:?}"
        );
    }
    assert_eq!(lenient(&[]).unwrap().swap.in_wait_ms, 10_000);
    let cfg = lenient(&[("VGPU_SWAP_IN_WAIT", "250ms")]).unwrap();
    assert_eq!(cfg.swap.in_wait_ms, 250);
    let cfg = lenient(&[("VGPU_SWAP_IN_WAIT", "later")]).unwrap();
    assert_eq!(cfg.swap.in_wait_ms, 10_000);
    assert_eq!(cfg.warnings.len(), 1);
    assert!(!lenient(&[]).unwrap().swap.movable);
    assert!(lenient(&[("VGPU_SWAP_MOVABLE", "1")]).unwrap().swap.movable);
    let cfg = lenient(&[("VGPU_SWAP_MOVABLE", "maybe")]).unwrap();
    assert!(!cfg.swap.movable);
    assert_eq!(variables(&cfg.warnings), ["VGPU_SWAP_MOVABLE"]);
    assert!(lenient(&[]).unwrap().swap.keep_host);
    assert!(
        !lenient(&[("VGPU_SWAP_KEEP_HOST", "0")])
            .unwrap()
            .swap
            .keep_host
    );
    let cfg = lenient(&[("VGPU_SWAP_KEEP_HOST", "sometimes")]).unwrap();
    assert!(cfg.swap.keep_host);
    assert_eq!(variables(&cfg.warnings), ["VGPU_SWAP_KEEP_HOST"]);
}
