//! Reading the environment into a [`Config`], one family of variables at a time.
//!
//! The families are read in a fixed order, which is the order a parse lists its problems in:
//! the memory and SM limits (and the layout that says what their device indices mean), the
//! shared file, the SM limit's mode, the log, reconciliation, the device selection, host
//! backing, the allocator. A problem is fatal when the value affects enforcement, or always
//! in a strict parse; every other one is a warning and the default stays.

use vgpu_alloc_core::MAX_DEVICES;
use vgpu_limiter::{Policy, SmMode};

use super::{
    ByUuid, Config, ConfigError, ConfigErrors, DeviceSelector, SwapTrigger, UuidLimit,
    parse_duration_ms,
};
use crate::devices::{DeviceKey, Layout, device_key, same_uuid, smallest};
use crate::log_level::{LOG_LEVEL_EXPECTED, parse_log_level};
use crate::names::*;
use crate::size::parse_size;
use crate::sm_tuning::SmTuning;
use crate::vars::Vars;

/// Parses `vars` (see the module's order); `strict` makes every problem fatal.
pub(crate) fn parse(vars: &Vars, strict: bool) -> Result<Config, ConfigErrors> {
    let mut r = Reader {
        vars,
        strict,
        problems: Vec::new(),
    };
    let mut cfg = Config::default();
    r.limits(&mut cfg);
    r.shared_file(&mut cfg);
    r.sm(&mut cfg);
    r.log(&mut cfg);
    r.reconcile(&mut cfg);
    r.devices(&mut cfg);
    r.host_backing(&mut cfg);
    r.swap(&mut cfg);
    r.allocator(&mut cfg);
    if r.problems.iter().any(|(fatal, _)| *fatal) {
        return Err(ConfigErrors(
            r.problems.into_iter().map(|(_, e)| e).collect(),
        ));
    }
    cfg.warnings = r.problems.into_iter().map(|(_, e)| e).collect();
    Ok(cfg)
}

/// One parse: the variables and every problem found so far.
struct Reader<'a> {
    vars: &'a Vars,
    strict: bool,
    /// (fatal, error) in the order the variables are read.
    problems: Vec<(bool, ConfigError)>,
}

/// The limits one kind of per-device variable sets by index (`<BASE>_<i>`): per index, `None`
/// when unset, else the value (`None` in it: unlimited).
type Indexed<T> = [Option<Option<T>>; MAX_DEVICES];

impl Reader<'_> {
    fn get(&self, name: &str) -> Option<String> {
        self.vars.get(name).map(str::to_owned)
    }

    /// A bad value that affects enforcement.
    fn fail(&mut self, variable: &str, value: &str, reason: String) {
        self.report(true, variable, value, reason);
    }

    /// A bad value that does not: its default stays (fatal only in a strict parse).
    fn warn(&mut self, variable: &str, value: &str, reason: String) {
        self.report(false, variable, value, reason);
    }

    fn report(&mut self, fatal: bool, variable: &str, value: &str, reason: String) {
        self.problems.push((
            fatal || self.strict,
            ConfigError {
                variable: variable.to_owned(),
                value: value.to_owned(),
                reason,
            },
        ));
    }

    /// `name`'s value through `parse`, or `None` (unset, or bad: a failure).
    fn parsed<T>(
        &mut self,
        name: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Option<T> {
        let v = self.get(name)?;
        parse(&v).map_err(|reason| self.fail(name, &v, reason)).ok()
    }

    /// Memory and SM limits: the defaults, then per-device values by index, then by UUID
    /// (applied once the devices are known: [`Config::apply_device_uuids`]), placed on the
    /// devices as the shared file's layout says.
    fn limits(&mut self, cfg: &mut Config) {
        let default_memory = self.parsed(ENV_MEMORY_LIMIT, memory_limit).unwrap_or(None);
        let default_sm = self.parsed(ENV_SM_LIMIT, parse_percent).unwrap_or(None);
        let mut memory: Indexed<u64> = [None; MAX_DEVICES];
        let mut sm: Indexed<u8> = [None; MAX_DEVICES];
        for i in 0..MAX_DEVICES {
            memory[i] = self.parsed(&format!("{ENV_MEMORY_LIMIT}_{i}"), memory_limit);
            sm[i] = self.parsed(&format!("{ENV_SM_LIMIT}_{i}"), parse_percent);
        }
        self.per_device_names(cfg);
        cfg.layout = Layout::of_shared_cache(&self.get(ENV_SHARED_CACHE).unwrap_or_default());
        place_limits(cfg, (&memory, default_memory), (&sm, default_sm));
    }

    /// Every per-device variable by its name: those by index listed in
    /// [`Config::per_device`], those by UUID parsed into [`Config::limits_by_uuid`], any other
    /// suffix a failure.
    fn per_device_names(&mut self, cfg: &mut Config) {
        for base in [ENV_MEMORY_LIMIT, ENV_SM_LIMIT] {
            let prefix = format!("{base}_");
            for (name, value) in self.vars.with_prefix(&prefix) {
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
                            memory_limit(value).map(UuidLimit::Memory)
                        } else {
                            parse_percent(value).map(UuidLimit::Sm)
                        };
                        match limit {
                            Ok(limit) => cfg.limits_by_uuid.push(ByUuid {
                                variable: name.to_owned(),
                                uuid,
                                limit,
                            }),
                            Err(reason) => self.fail(name, value, reason),
                        }
                    }
                    Err(reason) => self.fail(name, value, reason),
                }
            }
        }
    }

    /// `CUDA_DEVICE_MEMORY_SHARED_CACHE`.
    fn shared_file(&mut self, cfg: &mut Config) {
        if let Some(v) = self.get(ENV_SHARED_CACHE) {
            if v.trim().is_empty() {
                self.fail(ENV_SHARED_CACHE, &v, "empty path".into());
            } else {
                cfg.shared_cache = v;
            }
        }
    }

    /// How the SM limit is enforced: the policy, cap or share mode, the ceiling, the priority,
    /// the turn board's directory, and the retired tuning variables (a warning each).
    fn sm(&mut self, cfg: &mut Config) {
        if let Some(v) = self.get(ENV_CORE_POLICY) {
            match v.trim().to_ascii_lowercase().as_str() {
                "default" => cfg.core_policy = Policy::Default,
                "force" => cfg.core_policy = Policy::Force,
                "disable" => cfg.core_policy = Policy::Disable,
                "monitor" => cfg.core_policy = Policy::Monitor,
                _ => self.fail(
                    ENV_CORE_POLICY,
                    &v,
                    "expected force, disable, monitor or default".into(),
                ),
            }
        }
        if let Some(v) = self.get(ENV_SM_MODE) {
            match v.trim().to_ascii_lowercase().as_str() {
                "cap" | "" => cfg.sm_mode = SmMode::Cap,
                "share" => cfg.sm_mode = SmMode::Share,
                _ => self.fail(ENV_SM_MODE, &v, "expected cap or share".into()),
            }
        }
        if let Some(v) = self.get(ENV_SM_CEILING) {
            // A ceiling of 0 would forbid the GPU altogether: refused, not read as "none".
            match strict_int::<u8>(&v) {
                Some(100) => cfg.sm_ceiling = None,
                Some(p @ 1..=99) => cfg.sm_ceiling = Some(p),
                _ => self.fail(
                    ENV_SM_CEILING,
                    &v,
                    "expected a percentage from 1 to 100".into(),
                ),
            }
        }
        if let Some(v) = self.get(ENV_TASK_PRIORITY) {
            match strict_int::<i32>(&v) {
                Some(p) => cfg.task_priority = p,
                None => self.warn(ENV_TASK_PRIORITY, &v, "expected a 32-bit integer".into()),
            }
        }
        cfg.sm_tuning.turn_dir = SmTuning::turn_dir_of(self.get(ENV_TURN_DIR).as_deref());
        for name in RETIRED_SM_VARIABLES {
            if let Some(v) = self.get(name) {
                self.warn(
                    name,
                    &v,
                    "no longer has an effect: the SM limiter has no tuning knobs (docs/sm-limit.md)"
                        .into(),
                );
            }
        }
    }

    /// `LIBCUDA_LOG_LEVEL`.
    fn log(&mut self, cfg: &mut Config) {
        if let Some(v) = self.get(ENV_LOG_LEVEL) {
            match parse_log_level(&v) {
                Some(l) => cfg.log_level = l,
                None => self.warn(ENV_LOG_LEVEL, &v, LOG_LEVEL_EXPECTED.into()),
            }
        }
    }

    /// `VGPU_RECONCILE_MS`.
    fn reconcile(&mut self, cfg: &mut Config) {
        let Some(v) = self.get(ENV_RECONCILE_MS) else {
            return;
        };
        let t = v.trim();
        if t.eq_ignore_ascii_case("off") {
            cfg.reconcile_ms = None;
            return;
        }
        match strict_int::<u64>(t).filter(|ms| *ms <= 3_600_000) {
            Some(ms) => cfg.reconcile_ms = Some(ms),
            // Accuracy, not enforcement: a typo keeps the default rather than disabling the
            // GPU.
            None => self.warn(
                ENV_RECONCILE_MS,
                &v,
                "expected milliseconds (0..=3600000) or off".into(),
            ),
        }
    }

    /// `CUDA_VISIBLE_DEVICES` (kept as written for the hook to resolve) and
    /// `ACTIVE_OOM_KILLER` (accepted, no effect).
    fn devices(&mut self, cfg: &mut Config) {
        cfg.active_oom_killer = self.get(ENV_ACTIVE_OOM_KILLER);
        cfg.visible_devices = self.get(ENV_VISIBLE_DEVICES).map(|v| {
            if v.trim().is_empty() {
                Vec::new()
            } else {
                v.split(',').map(DeviceSelector::parse).collect()
            }
        });
    }

    /// `CUDA_OVERSUBSCRIBE`, `VGPU_HOST_SPILL`, `VGPU_DEVICE_RESERVE`.
    fn host_backing(&mut self, cfg: &mut Config) {
        if let Some(v) = self.get(ENV_OVERSUBSCRIBE) {
            // HAMi writes `true`; an empty value is how a chart unsets it. Under Volcano's
            // plugin it reports core scaling, and HAMi-core never read it: nothing changes.
            match v.trim() {
                "" => {}
                t => match parse_bool(t) {
                    Some(b) => {
                        cfg.host_backing.oversubscribe =
                            b && cfg.layout.oversubscribe_means_memory()
                    }
                    None => self.fail(ENV_OVERSUBSCRIBE, &v, "expected true, false, 1 or 0".into()),
                },
            }
        }
        if let Some(n) = self.parsed(ENV_HOST_SPILL, size) {
            cfg.host_backing.spill = n;
        }
        if let Some(n) = self.parsed(ENV_DEVICE_RESERVE, size) {
            cfg.host_backing.device_reserve = n;
        }
    }

    /// `VGPU_IDLE_SWAP`, `VGPU_SWAP_IN_WAIT`, `VGPU_SWAP_MOVABLE`, `VGPU_SWAP_KEEP_HOST`. None changes a limit: a bad value keeps
    /// the default (no swapping; the default wait), said as a warning (an error when strict).
    fn swap(&mut self, cfg: &mut Config) {
        if let Some(v) = self.get(ENV_IDLE_SWAP) {
            match SwapTrigger::parse(&v) {
                Some(t) => cfg.swap.trigger = t,
                None => self.warn(
                    ENV_IDLE_SWAP,
                    &v,
                    "expected a duration (500ms, 30s, 5m, 1h), manual or off".into(),
                ),
            }
        }
        for (name, slot) in [
            (ENV_SWAP_MOVABLE, &mut cfg.swap.movable),
            (ENV_SWAP_KEEP_HOST, &mut cfg.swap.keep_host),
        ] {
            if let Some(v) = self.get(name) {
                match parse_bool(&v) {
                    Some(b) => *slot = b,
                    None => self.warn(name, &v, "expected 0 or 1".into()),
                }
            }
        }
        if let Some(v) = self.get(ENV_SWAP_IN_WAIT) {
            match parse_duration_ms(&v) {
                Some(ms) => cfg.swap.in_wait_ms = ms,
                None => self.warn(
                    ENV_SWAP_IN_WAIT,
                    &v,
                    "expected a duration (0ms, 500ms, 10s, 1m)".into(),
                ),
            }
        }
    }

    /// The sub-allocator's switch and sizes (checked together once each parses), and whether
    /// managed memory counts.
    fn allocator(&mut self, cfg: &mut Config) {
        for (name, slot) in [
            (ENV_SUBALLOC, &mut cfg.allocator.suballoc),
            (ENV_COUNT_MANAGED, &mut cfg.count_managed),
        ] {
            if let Some(v) = self.get(name) {
                match parse_bool(&v) {
                    Some(b) => *slot = b,
                    None => self.fail(name, &v, "expected 0 or 1".into()),
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
            match self.get(name).map(|v| (size(&v), v)) {
                Some((Ok(n), _)) => *slot = n,
                Some((Err(reason), v)) => {
                    sizes_ok = false;
                    self.fail(name, &v, reason);
                }
                None => {}
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
                self.fail("VGPU_ALLOC_*", &value, reason);
            }
        }
    }
}

/// Puts the default and indexed limits on the devices: by index where the indices are CUDA
/// ordinals, else the one value [`unordered`] gives every device (with its notice).
fn place_limits(
    cfg: &mut Config,
    (memory, default_memory): (&Indexed<u64>, Option<u64>),
    (sm, default_sm): (&Indexed<u8>, Option<u8>),
) {
    if cfg.layout.indices_are_ordinals() {
        for i in 0..MAX_DEVICES {
            cfg.memory_limit[i] = memory[i].unwrap_or(default_memory);
            cfg.sm_limit[i] = sm[i].unwrap_or(default_sm);
        }
        return;
    }
    // The indices name the claim's GPUs in an order nobody knows: a value is known to belong
    // to one of them, not to which. Each gets the smallest, so that none can use more than
    // the scheduler reserved on it.
    let memory = unordered(ENV_MEMORY_LIMIT, memory, default_memory, |l| show_size(*l));
    let sm = unordered(ENV_SM_LIMIT, sm, default_sm, |l| show_percent(*l));
    cfg.memory_limit = [memory.0; MAX_DEVICES];
    cfg.sm_limit = [sm.0; MAX_DEVICES];
    let layout = cfg.layout.describe();
    cfg.notices.extend(memory.1.into_iter().chain(sm.1).map(|n| {
        format!(
            "{n}: {layout} numbers a claim's GPUs in an arbitrary order, so each GPU gets the \
             smallest; name each GPU by its UUID ({ENV_MEMORY_LIMIT}_GPU_<uuid>, \
             {ENV_SM_LIMIT}_GPU_<uuid>, each - of the UUID written _) to give it its own, or request the same \
             capacity for every GPU of the claim"
        )
    }));
}

/// The one value a DRA claim's indexed limits give every device (their indices are in no
/// known order; see [`Layout::indices_are_ordinals`]): the default when none is set, else the
/// smallest, with a note naming them when they differ.
fn unordered<T: Ord + Copy>(
    base: &str,
    indexed: &Indexed<T>,
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

/// A size, the error in words.
fn size(v: &str) -> Result<u64, String> {
    parse_size(v).map_err(|e| e.to_string())
}

/// A memory limit: a size, where 0 means unlimited (`None`).
fn memory_limit(v: &str) -> Result<Option<u64>, String> {
    size(v).map(|n| (n != 0).then_some(n))
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
