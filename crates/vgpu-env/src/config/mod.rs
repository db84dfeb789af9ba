//! The parsed environment: every variable checked, all errors collected, and a bad value
//! an error, never a silent "unlimited".

use std::fmt;

use vgpu_alloc_core::{AllocatorConfig, MAX_DEVICES};
use vgpu_limiter::{Policy, SmMode};

use crate::devices::{Layout, same_uuid, smallest};
use crate::log_level::DEFAULT_LOG_LEVEL;
use crate::names::*;
use crate::sm_tuning::SmTuning;
use crate::vars::Vars;

mod read;

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
    pub(crate) fn parse(entry: &str) -> Self {
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
    /// Swapping (`VGPU_IDLE_SWAP`, `VGPU_SWAP_IN_WAIT`; docs/swap.md).
    pub swap: Swap,
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
            swap: Swap::default(),
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

/// When this process swaps its movable device memory out to host memory (docs/swap.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Swap {
    /// `VGPU_IDLE_SWAP`.
    pub trigger: SwapTrigger,
    /// `VGPU_SWAP_IN_WAIT`: how long a swap-in waits for device room, milliseconds.
    pub in_wait_ms: u64,
    /// `VGPU_SWAP_MOVABLE`: direct `cuMemAlloc` allocations are made movable (VMM-backed by
    /// the hook) while swapping is on.
    pub movable: bool,
    /// `VGPU_SWAP_KEEP_HOST`: a swap-in keeps the pinned host memory it emptied, for the
    /// next swap-out of the same allocation.
    pub keep_host: bool,
}

impl Default for Swap {
    fn default() -> Self {
        Self {
            trigger: SwapTrigger::Off,
            in_wait_ms: crate::names::DEFAULT_SWAP_IN_WAIT_MS,
            movable: false,
            keep_host: true,
        }
    }
}

/// `VGPU_IDLE_SWAP`'s value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapTrigger {
    /// No swapping (the default).
    Off,
    /// Only when `vgpu swap-out` asks.
    Manual,
    /// When asked, and after this many milliseconds idle.
    Idle(u64),
}

impl SwapTrigger {
    /// `VGPU_IDLE_SWAP`'s value read: `off` (or empty), `manual` or a positive duration;
    /// `None` for anything else.
    pub fn parse(v: &str) -> Option<Self> {
        match v.trim() {
            "" | "off" => Some(Self::Off),
            "manual" => Some(Self::Manual),
            t => parse_duration_ms(t).filter(|&ms| ms > 0).map(Self::Idle),
        }
    }
}

impl Swap {
    /// Whether this process swaps at all.
    pub fn enabled(&self) -> bool {
        self.trigger != SwapTrigger::Off
    }

    /// Whether the program's `cuMemAlloc` allocations are made movable: `VGPU_SWAP_MOVABLE`
    /// with swapping on (memory that never moves keeps its CUDA IPC handle).
    pub fn makes_movable(&self) -> bool {
        self.movable && self.enabled()
    }
}

/// A duration: `<n>ms`, `<n>s`, `<n>m` or `<n>h` (an integer), in milliseconds, at most a
/// day.
pub fn parse_duration_ms(v: &str) -> Option<u64> {
    let t = v.trim();
    let split = t.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = t.split_at(split);
    let n: u64 = if n.is_empty() {
        return None;
    } else {
        n.parse().ok()?
    };
    let per = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return None,
    };
    n.checked_mul(per).filter(|&ms| ms <= 86_400_000)
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

impl Config {
    /// Parse strictly: unset variables take their defaults and every bad value is an
    /// error, also one that does not affect enforcement. For tools that check an
    /// environment before a program starts (`vgpu run`, `vgpu doctor`).
    pub fn from_vars(vars: &Vars) -> Result<Self, ConfigErrors> {
        read::parse(vars, true)
    }

    /// Parse as the hook does: a bad value that affects enforcement is an error (all of
    /// them are reported, with any warnings, in their order); one that does not
    /// (`LIBCUDA_LOG_LEVEL`, `CUDA_TASK_PRIORITY`, the SM limiter's tuning) keeps its
    /// default and is listed in [`Config::warnings`].
    pub fn from_vars_with_warnings(vars: &Vars) -> Result<Self, ConfigErrors> {
        read::parse(vars, false)
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

pub use read::parse_percent;

#[cfg(test)]
mod tests;
