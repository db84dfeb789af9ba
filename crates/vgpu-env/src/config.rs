//! The parsed environment: every variable checked, all errors collected, and a bad value
//! an error, never a silent "unlimited".

use std::fmt;

use vgpu_alloc_core::{AllocatorConfig, MAX_DEVICES};
use vgpu_limiter::{Policy, SmMode};

use crate::devices::{DeviceKey, Layout, device_key, same_uuid, smallest};
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
    /// The per-device variables that are set by index (`CUDA_DEVICE_MEMORY_LIMIT_<i>`,
    /// `CUDA_DEVICE_SM_LIMIT_<i>`), by name with their device index, in name order (see
    /// [`Config::absent_device_warnings`]).
    pub per_device: Vec<(String, usize)>,
    /// The per-device limits set by GPU UUID (`CUDA_DEVICE_MEMORY_LIMIT_GPU_<uuid>`,
    /// `CUDA_DEVICE_SM_LIMIT_GPU_<uuid>`), in name order: not yet in
    /// [`Config::memory_limit`] and [`Config::sm_limit`] until
    /// [`Config::apply_device_uuids`] knows which of the container's devices each GPU is.
    pub limits_by_uuid: Vec<ByUuid>,
    /// Whose layout the shared file's path shows ([`Layout`]): what `_<i>` and
    /// `CUDA_OVERSUBSCRIBE` mean here.
    pub layout: Layout,
    /// How the environment was read where that changes what the tenant gets and the reason
    /// is not a bad value (a limit lowered because its device is unknown, a switch that means
    /// something else under this plugin): the hook says each once.
    pub notices: Vec<String>,
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
            limits_by_uuid: Vec::new(),
            layout: Layout::Plain,
            notices: Vec::new(),
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

/// One limit set for a GPU named by UUID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByUuid {
    /// The variable, as written.
    pub variable: String,
    /// The GPU, lowercase (`GPU-...`).
    pub uuid: String,
    /// What it sets.
    pub limit: UuidLimit,
}

/// What a [`ByUuid`] variable sets (`None` = unlimited, as 0 or 100 written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UuidLimit {
    /// `CUDA_DEVICE_MEMORY_LIMIT_GPU_<uuid>`, bytes.
    Memory(Option<u64>),
    /// `CUDA_DEVICE_SM_LIMIT_GPU_<uuid>`, percent.
    Sm(Option<u8>),
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

        // Memory and SM limits: the defaults, then per-device values by index, then by UUID
        // (applied once the devices are known: [`Config::apply_device_uuids`]).
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
        let mut indexed_memory: [Option<Option<u64>>; MAX_DEVICES] = [None; MAX_DEVICES];
        let mut indexed_sm: [Option<Option<u8>>; MAX_DEVICES] = [None; MAX_DEVICES];
        for i in 0..MAX_DEVICES {
            let name = format!("{ENV_MEMORY_LIMIT}_{i}");
            if let Some(v) = lookup(&name) {
                match parse_size(&v) {
                    Ok(n) => indexed_memory[i] = Some((n != 0).then_some(n)),
                    Err(e) => fail(&name, &v, e.to_string()),
                }
            }
            let name = format!("{ENV_SM_LIMIT}_{i}");
            if let Some(v) = lookup(&name) {
                match parse_percent(&v) {
                    Ok(p) => indexed_sm[i] = Some(p),
                    Err(r) => fail(&name, &v, r),
                }
            }
        }
        for base in [ENV_MEMORY_LIMIT, ENV_SM_LIMIT] {
            let prefix = format!("{base}_");
            for (name, value) in vars.with_prefix(&prefix) {
                match device_key(&name[prefix.len()..], MAX_DEVICES - 1) {
                    Ok(DeviceKey::Index(i)) => cfg.per_device.push((name.to_owned(), i)),
                    Ok(DeviceKey::Uuid(uuid)) => {
                        let twice = cfg
                            .limits_by_uuid
                            .iter()
                            .any(|l| l.variable.starts_with(&prefix) && same_uuid(&l.uuid, &uuid));
                        let limit = if twice {
                            Err("this GPU is named by another variable of the same kind too".into())
                        } else if base == ENV_MEMORY_LIMIT {
                            parse_size(value)
                                .map(|n| UuidLimit::Memory((n != 0).then_some(n)))
                                .map_err(|e| e.to_string())
                        } else {
                            parse_percent(value).map(UuidLimit::Sm)
                        };
                        match limit {
                            Ok(limit) => cfg.limits_by_uuid.push(ByUuid {
                                variable: name.to_owned(),
                                uuid,
                                limit,
                            }),
                            Err(reason) => fail(name, value, reason),
                        }
                    }
                    Err(reason) => fail(name, value, reason),
                }
            }
        }
        cfg.layout = Layout::of_shared_cache(&lookup(ENV_SHARED_CACHE).unwrap_or_default());
        if cfg.layout.indices_are_ordinals() {
            for i in 0..MAX_DEVICES {
                cfg.memory_limit[i] = indexed_memory[i].unwrap_or(default_limit);
                cfg.sm_limit[i] = indexed_sm[i].unwrap_or(default_sm);
            }
        } else {
            // The indices name the claim's GPUs in an order nobody knows: a value is known to
            // belong to one of them, not to which. Each gets the smallest, so that none can
            // use more than the scheduler reserved on it.
            let memory = unordered(ENV_MEMORY_LIMIT, &indexed_memory, default_limit, |l| {
                show_size(*l)
            });
            let sm = unordered(ENV_SM_LIMIT, &indexed_sm, default_sm, |l| show_percent(*l));
            cfg.memory_limit = [memory.0; MAX_DEVICES];
            cfg.sm_limit = [sm.0; MAX_DEVICES];
            cfg.notices
                .extend(memory.1.into_iter().chain(sm.1).map(|n| {
                format!(
                    "{n}: {} numbers a claim's GPUs in an arbitrary order, so each GPU gets the \
                     smallest; name each GPU by its UUID ({ENV_MEMORY_LIMIT}_GPU_<uuid>, \
                     {ENV_SM_LIMIT}_GPU_<uuid>, each - of the UUID written _) to give it its own, or request the same \
                     capacity for every GPU of the claim",
                    cfg.layout.describe()
                )
            }));
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
            // A ceiling of 0 would forbid the GPU altogether: refused, not read as "none".
            match strict_int::<u8>(&v) {
                Some(100) => cfg.sm_ceiling = None,
                Some(p @ 1..=99) => cfg.sm_ceiling = Some(p),
                _ => fail(
                    ENV_SM_CEILING,
                    &v,
                    "expected a percentage from 1 to 100".into(),
                ),
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
        cfg.sm_tuning.turn_dir = SmTuning::turn_dir_of(lookup(ENV_TURN_DIR).as_deref());
        for name in RETIRED_SM_VARIABLES {
            if let Some(v) = lookup(name) {
                warn(
                    name,
                    &v,
                    "no longer has an effect: the SM limiter has no tuning knobs (docs/sm-limit.md)"
                        .into(),
                );
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
            // HAMi writes `true`; an empty value is how a chart unsets it. Under Volcano's
            // plugin it reports core scaling, and HAMi-core never read it: nothing changes.
            match v.trim() {
                "" => {}
                t => match parse_bool(t) {
                    Some(b) => {
                        cfg.host_backing.oversubscribe =
                            b && cfg.layout.oversubscribe_means_memory()
                    }
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

    /// Puts the limits set by GPU UUID on the devices they name, given the UUIDs of the
    /// container's GPUs in NVML's order (the shared file's devices, which `_<i>` also names);
    /// a UUID limit wins over the index and default forms for its device. Returns one warning
    /// per UUID the container does not have (it limits nothing here). With no UUIDs known
    /// (no driver answered), no device can be
    /// matched: every device gets the smallest UUID limit of each kind, never more than it
    /// had, so that an unknown device list does not turn a limit off.
    pub fn apply_device_uuids(&mut self, uuids: &[String]) -> Vec<String> {
        let mut warnings = Vec::new();
        if uuids.is_empty() {
            let memory = smallest(self.limits_by_uuid.iter().filter_map(|l| match l.limit {
                UuidLimit::Memory(m) => Some(m),
                UuidLimit::Sm(_) => None,
            }));
            let sm = smallest(self.limits_by_uuid.iter().filter_map(|l| match l.limit {
                UuidLimit::Sm(p) => Some(p),
                UuidLimit::Memory(_) => None,
            }));
            for d in 0..MAX_DEVICES {
                if memory.is_some() {
                    self.memory_limit[d] = smallest([self.memory_limit[d], memory]);
                }
                if sm.is_some() {
                    self.sm_limit[d] = smallest([self.sm_limit[d], sm]);
                }
            }
            if !self.limits_by_uuid.is_empty() {
                warnings.push(
                    "limits are set by GPU UUID but the devices' UUIDs are unknown (no driver \
                     answered): every device gets the smallest of them"
                        .to_owned(),
                );
            }
            return warnings;
        }
        for l in &self.limits_by_uuid {
            match uuids.iter().position(|u| same_uuid(u, &l.uuid)) {
                Some(d) if d < MAX_DEVICES => match l.limit {
                    UuidLimit::Memory(m) => self.memory_limit[d] = m,
                    UuidLimit::Sm(p) => self.sm_limit[d] = p,
                },
                _ => warnings.push(format!(
                    "{} is set, but the container has no GPU {} (it has {}), so the value \
                     limits nothing here",
                    l.variable,
                    l.uuid,
                    uuids.join(", ")
                )),
            }
        }
        warnings
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

/// The one value a DRA claim's indexed limits give every device (their indices are in no
/// known order; see [`Layout::indices_are_ordinals`]): the default when none is set, else the
/// smallest, with a note naming them when they differ.
fn unordered<T: Ord + Copy>(
    base: &str,
    indexed: &[Option<Option<T>>; MAX_DEVICES],
    default: Option<T>,
    show: impl Fn(&Option<T>) -> String,
) -> (Option<T>, Option<String>) {
    let set: Vec<(usize, Option<T>)> = indexed
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.map(|v| (i, v)))
        .collect();
    let Some(&(_, first)) = set.first() else {
        return (default, None);
    };
    let least = smallest(set.iter().map(|(_, v)| *v));
    if set.iter().all(|(_, v)| *v == first) {
        return (first, None);
    }
    let listed: Vec<String> = set
        .iter()
        .map(|(i, v)| format!("{base}_{i}={}", show(v)))
        .collect();
    let note = format!(
        "{} differ; every GPU is limited to {}",
        listed.join(", "),
        show(&least)
    );
    (least, Some(note))
}

fn show_size(l: Option<u64>) -> String {
    l.map_or_else(|| "unlimited".to_owned(), |b| format!("{}m", b >> 20))
}

fn show_percent(l: Option<u8>) -> String {
    l.map_or_else(|| "unlimited".to_owned(), |p| p.to_string())
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
            warnings[0].starts_with(
                "CUDA_DEVICE_SM_LIMIT_GPU-5a1e5130-0000-4000-8000-0000000c0de9 is set"
            ) && warnings[0].contains("the container has no GPU"),
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
}
