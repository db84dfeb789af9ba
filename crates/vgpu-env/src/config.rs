//! The parsed environment: every variable checked, all errors collected, and a bad value
//! an error, never a silent "unlimited".

use std::fmt;

use vgpu_alloc_core::{AllocatorConfig, MAX_DEVICES};
use vgpu_limiter::{Policy, SmMode};

use crate::log_level::{DEFAULT_LOG_LEVEL, LOG_LEVEL_EXPECTED, parse_log_level};
use crate::names::*;
use crate::size::parse_size;
use crate::sm_tuning::SmTuning;
use crate::vars::Vars;

/// One entry of `CUDA_VISIBLE_DEVICES`, kept as written for the hook to resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelector {
    /// A device ordinal (`0`, `3`).
    Index(u32),
    /// A GPU UUID (`GPU-...`).
    Uuid(String),
    /// A MIG instance (`MIG-...`).
    Mig(String),
    /// Anything else, exactly as written (CUDA stops enumerating at an invalid entry).
    Other(String),
}

impl DeviceSelector {
    fn parse(entry: &str) -> Self {
        let entry = entry.trim();
        if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(i) = entry.parse() {
                return Self::Index(i);
            }
        }
        if entry.starts_with("GPU-") {
            Self::Uuid(entry.to_owned())
        } else if entry.starts_with("MIG-") {
            Self::Mig(entry.to_owned())
        } else {
            Self::Other(entry.to_owned())
        }
    }
}

/// The parsed environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Memory limit per device ordinal in bytes, `None` = unlimited
    /// (`CUDA_DEVICE_MEMORY_LIMIT_<i>` over `CUDA_DEVICE_MEMORY_LIMIT`; 0 = unlimited).
    pub memory_limit: [Option<u64>; MAX_DEVICES],
    /// SM limit per device in percent 1..=99, `None` = unlimited (0 or 100 written).
    pub sm_limit: [Option<u8>; MAX_DEVICES],
    /// Path of the shared usage file.
    pub shared_cache: String,
    /// When to enforce the SM limit.
    pub core_policy: Policy,
    /// `CUDA_TASK_PRIORITY` (default 1; lower is more urgent, as in HAMi: 0 high, 1 low).
    /// Only written for HAMi's monitor, unless [`Config::sm_mode`] is share.
    pub task_priority: i32,
    /// `VGPU_SM_MODE`: cap (default) or share.
    pub sm_mode: SmMode,
    /// `VGPU_SM_CEILING` (share mode), percent 1..=100; `None` = 100.
    pub sm_ceiling: Option<u8>,
    /// `LIBCUDA_LOG_LEVEL` 0..=4 (default 2; grammar in [`crate::log_level`]).
    pub log_level: u8,
    /// `ACTIVE_OOM_KILLER` as written; accepted, has no effect.
    pub active_oom_killer: Option<String>,
    /// `CUDA_VISIBLE_DEVICES` entries; `None` when unset (all devices visible).
    pub visible_devices: Option<Vec<DeviceSelector>>,
    /// Count `cuMemAllocManaged` against the limit (`VGPU_COUNT_MANAGED`, default on).
    pub count_managed: bool,
    /// Host-backed memory: `CUDA_OVERSUBSCRIBE` and `VGPU_HOST_SPILL`.
    pub host_backing: HostBacking,
    /// Sub-allocator sizes and switch.
    pub allocator: AllocatorConfig,
    /// Minimum interval between rate-limited reconciliations of this process's accounting
    /// with NVML's per-process used memory (`VGPU_RECONCILE_MS`, default 100; 0 = on every
    /// eligible call); `None` = reconciliation off (`off`).
    pub reconcile_ms: Option<u64>,
    /// SM limiter tuning.
    pub sm_tuning: SmTuning,
    /// The per-device variables that are set (`CUDA_DEVICE_MEMORY_LIMIT_<i>`,
    /// `CUDA_DEVICE_SM_LIMIT_<i>`), by name with their device index, in name order (see
    /// [`Config::absent_device_warnings`]).
    pub per_device: Vec<(String, usize)>,
    /// Rejected variables that do not affect enforcement (`LIBCUDA_LOG_LEVEL`,
    /// `CUDA_TASK_PRIORITY`), from [`Config::from_vars_with_warnings`] only: their
    /// defaults are used and the hook logs these and goes on, since a typo there must not
    /// disable the GPU. Limits, SM limits, the policy, the shared file and the allocator
    /// sizes stay fatal ([`ConfigErrors`]).
    pub warnings: Vec<ConfigError>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            memory_limit: [None; MAX_DEVICES],
            sm_limit: [None; MAX_DEVICES],
            shared_cache: DEFAULT_SHARED_CACHE.to_owned(),
            core_policy: Policy::Default,
            task_priority: 1,
            sm_mode: SmMode::Cap,
            sm_ceiling: None,
            log_level: DEFAULT_LOG_LEVEL,
            active_oom_killer: None,
            visible_devices: None,
            count_managed: true,
            host_backing: HostBacking::default(),
            allocator: AllocatorConfig::default(),
            reconcile_ms: Some(DEFAULT_RECONCILE_MS),
            sm_tuning: SmTuning::default(),
            per_device: Vec::new(),
            warnings: Vec::new(),
        }
    }
}

/// When an allocation may be backed by host memory at a device address (docs/oversubscription.md).
/// Both off (the default): never, and the allocation path does no extra work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostBacking {
    /// `CUDA_OVERSUBSCRIBE=true` (HAMi's meaning): what the limit allows but the physical device
    /// has no room for is host-backed; device-resident plus host-backed memory stays within the
    /// limit (plus [`HostBacking::spill`]).
    pub oversubscribe: bool,
    /// `VGPU_HOST_SPILL=<size>`: host-backed memory allowed beyond the device limit, in bytes
    /// (0 = none).
    pub spill: u64,
    /// `VGPU_DEVICE_RESERVE=<size>`: while host backing is on, device memory to leave free on
    /// the GPU; an allocation that would leave less is host-backed instead (0 = none).
    pub device_reserve: u64,
}

impl HostBacking {
    /// Whether any allocation may be host-backed.
    pub fn enabled(&self) -> bool {
        self.oversubscribe || self.spill > 0
    }
}

/// One rejected variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {variable}={value:?}: {reason}")]
pub struct ConfigError {
    /// The variable's name.
    pub variable: String,
    /// The value as found.
    pub value: String,
    /// Why it was rejected.
    pub reason: String,
}

/// Every rejected variable of one parse, in a stable order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    }
}

fn strict_int<T: std::str::FromStr>(s: &str) -> Option<T> {
    let t = s.trim();
    // Rust's integer parser accepts a leading '+'; the grammar does not.
    if t.starts_with('+') {
        return None;
    }
    t.parse().ok()
}

impl Config {
    /// Parse strictly: unset variables take their defaults and every bad value is an
    /// error, also one that does not affect enforcement. For tools that check an
    /// environment before a program starts (`vgpu run`, `vgpu doctor`).
    pub fn from_vars(vars: &Vars) -> Result<Self, ConfigErrors> {
        Self::parse(vars, true)
    }

    /// Parse as the hook does: a bad value that affects enforcement is an error (all of
    /// them are reported, with any warnings, in their order); one that does not
    /// (`LIBCUDA_LOG_LEVEL`, `CUDA_TASK_PRIORITY`, the SM limiter's tuning) keeps its
    /// default and is listed in [`Config::warnings`].
    pub fn from_vars_with_warnings(vars: &Vars) -> Result<Self, ConfigErrors> {
        Self::parse(vars, false)
    }

    fn parse(vars: &Vars, strict: bool) -> Result<Self, ConfigErrors> {
        let lookup = |name: &str| vars.get(name).map(str::to_owned);
        let mut cfg = Config::default();
        // (fatal, error) in the order the variables are read.
        let problems = std::cell::RefCell::new(Vec::new());
        let report = |fatal: bool, variable: &str, value: &str, reason: String| {
            problems.borrow_mut().push((
                fatal || strict,
                ConfigError {
                    variable: variable.to_owned(),
                    value: value.to_owned(),
                    reason,
                },
            ));
        };
        let fail =
            |variable: &str, value: &str, reason: String| report(true, variable, value, reason);
        let warn =
            |variable: &str, value: &str, reason: String| report(false, variable, value, reason);

        // Memory limits: the default first, then per-device overrides.
        let mut default_limit = None;
        if let Some(v) = lookup(ENV_MEMORY_LIMIT) {
            match parse_size(&v) {
                Ok(n) => default_limit = (n != 0).then_some(n),
                Err(e) => fail(ENV_MEMORY_LIMIT, &v, e.to_string()),
            }
        }
        let mut default_sm = None;
        if let Some(v) = lookup(ENV_SM_LIMIT) {
            match parse_percent(&v) {
                Ok(p) => default_sm = p,
                Err(r) => fail(ENV_SM_LIMIT, &v, r),
            }
        }
        for i in 0..MAX_DEVICES {
            cfg.memory_limit[i] = default_limit;
            let name = format!("{ENV_MEMORY_LIMIT}_{i}");
            if let Some(v) = lookup(&name) {
                match parse_size(&v) {
                    Ok(n) => cfg.memory_limit[i] = (n != 0).then_some(n),
                    Err(e) => fail(&name, &v, e.to_string()),
                }
            }
            cfg.sm_limit[i] = default_sm;
            let name = format!("{ENV_SM_LIMIT}_{i}");
            if let Some(v) = lookup(&name) {
                match parse_percent(&v) {
                    Ok(p) => cfg.sm_limit[i] = p,
                    Err(r) => fail(&name, &v, r),
                }
            }
        }
        for base in [ENV_MEMORY_LIMIT, ENV_SM_LIMIT] {
            let prefix = format!("{base}_");
            for (name, value) in vars.with_prefix(&prefix) {
                match device_suffix(&name[prefix.len()..]) {
                    Ok(i) => cfg.per_device.push((name.to_owned(), i)),
                    Err(reason) => fail(name, value, reason),
                }
            }
        }

        if let Some(v) = lookup(ENV_SHARED_CACHE) {
            if v.trim().is_empty() {
                fail(ENV_SHARED_CACHE, &v, "empty path".into());
            } else {
                cfg.shared_cache = v;
            }
        }
        if let Some(v) = lookup(ENV_CORE_POLICY) {
            match v.trim().to_ascii_lowercase().as_str() {
                "default" => cfg.core_policy = Policy::Default,
                "force" => cfg.core_policy = Policy::Force,
                "disable" => cfg.core_policy = Policy::Disable,
                "monitor" => cfg.core_policy = Policy::Monitor,
                _ => fail(
                    ENV_CORE_POLICY,
                    &v,
                    "expected force, disable, monitor or default".into(),
                ),
            }
        }
        if let Some(v) = lookup(ENV_SM_MODE) {
            match v.trim().to_ascii_lowercase().as_str() {
                "cap" | "" => cfg.sm_mode = SmMode::Cap,
                "share" => cfg.sm_mode = SmMode::Share,
                _ => fail(ENV_SM_MODE, &v, "expected cap or share".into()),
            }
        }
        if let Some(v) = lookup(ENV_SM_CEILING) {
            match parse_percent(&v) {
                // 0 or 100: no ceiling below the whole GPU.
                Ok(p) => cfg.sm_ceiling = p,
                Err(r) => fail(ENV_SM_CEILING, &v, r),
            }
        }
        if let Some(v) = lookup(ENV_TASK_PRIORITY) {
            match strict_int::<i32>(&v) {
                Some(p) => cfg.task_priority = p,
                None => warn(ENV_TASK_PRIORITY, &v, "expected a 32-bit integer".into()),
            }
        }
        if let Some(v) = lookup(ENV_LOG_LEVEL) {
            match parse_log_level(&v) {
                Some(l) => cfg.log_level = l,
                None => warn(ENV_LOG_LEVEL, &v, LOG_LEVEL_EXPECTED.into()),
            }
        }
        if let Some(v) = lookup(ENV_RECONCILE_MS) {
            let t = v.trim();
            if t.eq_ignore_ascii_case("off") {
                cfg.reconcile_ms = None;
            } else {
                match strict_int::<u64>(t).filter(|ms| *ms <= 3_600_000) {
                    Some(ms) => cfg.reconcile_ms = Some(ms),
                    // Accuracy, not enforcement: a typo keeps the default rather than
                    // disabling the GPU.
                    None => warn(
                        ENV_RECONCILE_MS,
                        &v,
                        "expected milliseconds (0..=3600000) or off".into(),
                    ),
                }
            }
        }
        if let Some(v) = lookup(ENV_SM_CONTENTION) {
            match v.trim() {
                "1" => cfg.sm_tuning.contention_correction = true,
                "0" | "" => cfg.sm_tuning.contention_correction = false,
                _ => warn(ENV_SM_CONTENTION, &v, "expected 0 or 1".into()),
            }
        }
        cfg.sm_tuning.turn_dir = SmTuning::turn_dir_of(lookup(ENV_TURN_DIR).as_deref());

        // Integer tuning: a value out of range warns and keeps the default (`None` here).
        let tuning_int = |name: &str, min: u64, max: u64| -> Option<u64> {
            let v = lookup(name)?;
            let n = strict_int::<u64>(v.trim()).filter(|n| (min..=max).contains(n));
            if n.is_none() {
                warn(name, &v, format!("expected an integer in {min}..={max}"));
            }
            n
        };
        let t = &mut cfg.sm_tuning;
        if let Some(ms) = tuning_int(ENV_TURN_CYCLE_MS, 1, 1000) {
            t.turn_cycle_ms = ms;
        }
        if let Some(us) = tuning_int(ENV_TURN_LEAD_US, 0, 10_000) {
            t.turn_lead_us = us;
        }
        // Share-mode and wake-up tuning: unset keeps the limiter's (or the hook's) default.
        t.share_grace_us = tuning_int(ENV_SHARE_GRACE_US, 50, 20_000);
        t.share_outranked_queue_us = tuning_int(ENV_SHARE_OUTRANKED_QUEUE_US, 10, 10_000);
        t.share_gap_fill_us = tuning_int(ENV_SHARE_GAP_FILL_US, 0, 10_000);
        t.wake_slack_us = tuning_int(ENV_WAKE_SLACK_US, 0, 1_000);
        if let Some(v) = lookup(ENV_SM_POWER_EXPONENT) {
            match SmTuning::power_exponent_of(&v) {
                Some(pct) => cfg.sm_tuning.power_exponent_pct = pct,
                None => warn(
                    ENV_SM_POWER_EXPONENT,
                    &v,
                    "expected a number from 0 to 1 (two decimals at most) or off".into(),
                ),
            }
        }
        cfg.active_oom_killer = lookup(ENV_ACTIVE_OOM_KILLER);
        cfg.visible_devices = lookup(ENV_VISIBLE_DEVICES).map(|v| {
            if v.trim().is_empty() {
                Vec::new()
            } else {
                v.split(',').map(DeviceSelector::parse).collect()
            }
        });
        for (name, slot) in [
            (ENV_SUBALLOC, &mut cfg.allocator.suballoc),
            (ENV_COUNT_MANAGED, &mut cfg.count_managed),
        ] {
            if let Some(v) = lookup(name) {
                match parse_bool(&v) {
                    Some(b) => *slot = b,
                    None => fail(name, &v, "expected 0 or 1".into()),
                }
            }
        }
        if let Some(v) = lookup(ENV_OVERSUBSCRIBE) {
            // HAMi writes `true`; an empty value is how a chart unsets it.
            match v.trim() {
                "" => {}
                t => match parse_bool(t) {
                    Some(b) => cfg.host_backing.oversubscribe = b,
                    None => fail(ENV_OVERSUBSCRIBE, &v, "expected true, false, 1 or 0".into()),
                },
            }
        }
        for (name, slot) in [
            (ENV_HOST_SPILL, &mut cfg.host_backing.spill),
            (ENV_DEVICE_RESERVE, &mut cfg.host_backing.device_reserve),
        ] {
            if let Some(v) = lookup(name) {
                match parse_size(&v) {
                    Ok(n) => *slot = n,
                    Err(e) => fail(name, &v, e.to_string()),
                }
            }
        }
        let mut sizes_ok = true;
        for (name, slot) in [
            (ENV_REGION_SIZE, &mut cfg.allocator.region_size),
            (ENV_CHUNK_SIZE, &mut cfg.allocator.chunk_size),
            (
                ENV_SUBALLOC_THRESHOLD,
                &mut cfg.allocator.suballoc_threshold,
            ),
            (ENV_ALIGN, &mut cfg.allocator.align),
        ] {
            if let Some(v) = lookup(name) {
                match parse_size(&v) {
                    Ok(n) => *slot = n,
                    Err(e) => {
                        sizes_ok = false;
                        fail(name, &v, e.to_string());
                    }
                }
            }
        }
        if sizes_ok {
            if let Err(reason) = cfg.allocator.validate() {
                let value = format!(
                    "{}={} {}={} {}={} {}={}",
                    ENV_REGION_SIZE,
                    cfg.allocator.region_size,
                    ENV_CHUNK_SIZE,
                    cfg.allocator.chunk_size,
                    ENV_SUBALLOC_THRESHOLD,
                    cfg.allocator.suballoc_threshold,
                    ENV_ALIGN,
                    cfg.allocator.align
                );
                fail("VGPU_ALLOC_*", &value, reason);
            }
        }

        let problems = problems.into_inner();
        if problems.iter().any(|(fatal, _)| *fatal) {
            return Err(ConfigErrors(problems.into_iter().map(|(_, e)| e).collect()));
        }
        cfg.warnings = problems.into_iter().map(|(_, e)| e).collect();
        Ok(cfg)
    }

    /// One line for each per-device variable that names a device the container does not
    /// have (`present` GPUs, NVML's): it limits nothing here. A warning, not an error: a
    /// limit for a device nobody can use weakens nothing.
    pub fn absent_device_warnings(&self, present: usize) -> Vec<String> {
        self.per_device
            .iter()
            .filter(|(_, i)| *i >= present)
            .map(|(name, i)| {
                format!(
                    "{name} is set, but the container has {present} GPU(s) (NVML's, whatever \
                     CUDA_VISIBLE_DEVICES says), so device {i} does not exist here and the \
                     value limits nothing"
                )
            })
            .collect()
    }

    /// Parse from literal pairs (tests, the demo, a captured environment).
    pub fn from_pairs<K, V>(pairs: impl IntoIterator<Item = (K, V)>) -> Result<Self, ConfigErrors>
    where
        K: Into<String>,
        V: Into<String>,
    {
        Self::from_vars(&Vars::from_pairs(pairs))
    }
}

/// The device index of a per-device variable's suffix: HAMi's grammar names CUDA ordinals
/// 0..=15 in plain decimal (HAMi-core reads exactly those names and ignores any other, so
/// `_16` or `_00` would silently limit nothing there; here they are errors).
fn device_suffix(suffix: &str) -> Result<usize, String> {
    let last = MAX_DEVICES - 1;
    if suffix.is_empty() || !suffix.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "not a per-device variable: the suffix must be a device index 0..={last}"
        ));
    }
    match suffix.parse::<usize>() {
        Ok(i) if i <= last && suffix == i.to_string() => Ok(i),
        Ok(i) if i <= last => Err(format!(
            "write the device index without leading zeros (_{i}), the name HAMi-core reads"
        )),
        _ => Err(format!(
            "device index {suffix} is out of range: per-device variables name CUDA devices 0..={last}"
        )),
    }
}

/// An SM limit (`CUDA_DEVICE_SM_LIMIT[_<i>]`): an integer percent 0..=100, where 0 and 100
/// mean unlimited (`None`); the error says what is expected.
pub fn parse_percent(v: &str) -> Result<Option<u8>, String> {
    match strict_int::<u8>(v) {
        Some(0 | 100) => Ok(None),
        Some(p) if p < 100 => Ok(Some(p)),
        _ => Err("expected a percentage 0..=100 (0 or 100 = unlimited)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    const GIB: u64 = 1 << 30;

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
        let err =
            lenient(&[("CUDA_OVERSUBSCRIBE", "yes"), ("VGPU_HOST_SPILL", "lots")]).unwrap_err();
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
        let cfg =
            Config::from_pairs([("VGPU_SM_MODE", "Share"), ("VGPU_SM_CEILING", "60")]).unwrap();
        assert_eq!((cfg.sm_mode, cfg.sm_ceiling), (SmMode::Share, Some(60)));
        for (name, bad) in [("VGPU_SM_MODE", "elastic"), ("VGPU_SM_CEILING", "150")] {
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
    fn sm_tuning_parses_and_warns_on_typos() {
        let d = lenient(&[]).unwrap().sm_tuning;
        assert_eq!(d, SmTuning::default());
        assert_eq!(d.turn_dir.as_deref(), Some("/tmp/vgpulock"));
        let cfg = lenient(&[
            ("VGPU_SM_CONTENTION", "1"),
            ("VGPU_TURN_DIR", " /run/vgpu "),
            ("VGPU_TURN_CYCLE_MS", "40"),
            ("VGPU_TURN_LEAD_US", "100"),
        ])
        .unwrap();
        let t = cfg.sm_tuning;
        assert!(t.contention_correction);
        assert_eq!(t.turn_dir.as_deref(), Some("/run/vgpu"));
        assert_eq!((t.turn_cycle_ms, t.turn_lead_us), (40, 100));
        assert!(cfg.warnings.is_empty());
        assert_eq!(
            lenient(&[("VGPU_TURN_DIR", "OFF")])
                .unwrap()
                .sm_tuning
                .turn_dir,
            None
        );
        let bad = lenient(&[
            ("VGPU_TURN_CYCLE_MS", "0"),
            ("VGPU_TURN_LEAD_US", "5ms"),
            ("VGPU_SM_CONTENTION", "yes"),
        ])
        .unwrap();
        assert_eq!(bad.sm_tuning, SmTuning::default(), "defaults kept");
        let named = variables(&bad.warnings);
        assert_eq!(
            named,
            [
                "VGPU_SM_CONTENTION",
                "VGPU_TURN_CYCLE_MS",
                "VGPU_TURN_LEAD_US"
            ]
        );
    }

    #[test]
    fn share_tuning_parses_and_keeps_the_limiters_defaults_on_typos() {
        let t = lenient(&[]).unwrap().sm_tuning;
        assert_eq!(
            (
                t.share_grace_us,
                t.share_outranked_queue_us,
                t.share_gap_fill_us,
                t.wake_slack_us
            ),
            (None, None, None, None)
        );
        let cfg = lenient(&[
            ("VGPU_SHARE_GRACE_US", "500"),
            ("VGPU_SHARE_OUTRANKED_QUEUE_US", " 250 "),
            ("VGPU_SHARE_GAP_FILL_US", "0"),
            ("VGPU_WAKE_SLACK_US", "0"),
        ])
        .unwrap();
        let t = cfg.sm_tuning;
        assert_eq!(
            (
                t.share_grace_us,
                t.share_outranked_queue_us,
                t.share_gap_fill_us,
                t.wake_slack_us
            ),
            (Some(500), Some(250), Some(0), Some(0))
        );
        assert!(cfg.warnings.is_empty());
        let bad = lenient(&[
            ("VGPU_SHARE_GRACE_US", "10"),
            ("VGPU_SHARE_OUTRANKED_QUEUE_US", "0.5ms"),
            ("VGPU_SHARE_GAP_FILL_US", "-1"),
            ("VGPU_WAKE_SLACK_US", "5000"),
        ])
        .unwrap();
        assert_eq!(bad.sm_tuning, SmTuning::default(), "defaults kept");
        let named: Vec<&str> = bad.warnings.iter().map(|w| w.variable.as_str()).collect();
        assert_eq!(
            named,
            [
                "VGPU_SHARE_GRACE_US",
                "VGPU_SHARE_OUTRANKED_QUEUE_US",
                "VGPU_SHARE_GAP_FILL_US",
                "VGPU_WAKE_SLACK_US"
            ]
        );
    }

    #[test]
    fn power_exponent_parses_decimals_and_off_and_warns_on_the_rest() {
        let of = SmTuning::power_exponent_of;
        assert_eq!(lenient(&[]).unwrap().sm_tuning.power_exponent_pct, 50);
        for (v, pct) in [("0.5", 50), (".25", 25), ("1", 100), ("1.0", 100), ("0", 0)] {
            assert_eq!(of(v), Some(pct), "{v}");
        }
        assert_eq!(of(" OFF "), Some(0));
        for v in ["", ".", "1.5", "2", "0.125", "-0.5", "half", "0,5", "1e-1"] {
            assert_eq!(of(v), None, "{v:?}");
        }
        let cfg = lenient(&[("VGPU_SM_POWER_EXPONENT", "0.75")]).unwrap();
        assert_eq!(cfg.sm_tuning.power_exponent_pct, 75);
        let bad = lenient(&[("VGPU_SM_POWER_EXPONENT", "1.5")]).unwrap();
        assert_eq!(bad.sm_tuning.power_exponent_pct, 50, "default kept");
        assert_eq!(bad.warnings[0].variable, "VGPU_SM_POWER_EXPONENT");
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
}
