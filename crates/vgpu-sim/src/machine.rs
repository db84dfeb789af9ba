//! The simulated machine, read once from the environment (see `docs/simulated-driver.md`).
//!
//! Every variable is optional; a malformed one is an error (reported by `cuInit`/`nvmlInit`),
//! never silently replaced by a default.

use std::fmt;

use crate::power::PowerModel;

/// Most devices the simulated machine can have (as many as the shared file has slots).
pub const MAX_SIM_DEVICES: usize = 16;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// One injected fault: the `nth` call (1-based) of `op`, or every call when `nth` is `None`,
/// returns `code` without doing anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Entry point name as exported (`cuMemAlloc_v2`), or `alloc` for every allocating call.
    pub op: String,
    /// Which call fails (1-based); `None` = every call.
    pub nth: Option<u64>,
    /// The result code returned.
    pub code: u32,
}

/// One simulated physical device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Bytes of device memory.
    pub total_mem: u64,
    /// Bytes already used by processes outside this one (lowers the free memory everybody sees).
    pub other_used: u64,
    /// The 16 UUID bytes (NVML shows them as `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
    pub uuid: [u8; 16],
}

/// The whole simulated machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Physical devices in NVML order.
    pub devices: Vec<DeviceConfig>,
    /// CUDA ordinal → physical index, after `CUDA_VISIBLE_DEVICES`.
    pub visible: Vec<usize>,
    /// What `cuDriverGetVersion` returns (e.g. 13000).
    pub driver_version: i32,
    /// What `nvmlSystemGetDriverVersion` returns.
    pub nvml_driver_version: String,
    /// Device name.
    pub name: String,
    /// Bytes of device memory a context takes when created.
    pub ctx_overhead: u64,
    /// Bytes of device memory a loaded module takes.
    pub module_overhead: u64,
    /// Bytes of device memory the driver takes for itself with each block a stream-ordered
    /// pool reserves, held while the pool holds the block and not in the pool's
    /// `RESERVED_MEM_CURRENT` (the H200's driver took ~70 MiB for PyTorch's 2.5 GiB pool).
    pub pool_block_overhead: u64,
    /// Bytes of host memory the process may hold pinned or host-located
    /// (`VGPU_SIM_HOST_PINNED_LIMIT`; `None` = no limit): stands for what the host lets it
    /// lock (`RLIMIT_MEMLOCK`, the container's memory cgroup).
    pub host_pinned_limit: Option<u64>,
    /// Module code is loaded on the first launch of one of its functions
    /// (`CUDA_MODULE_LOADING=LAZY`, the real driver's default since CUDA 12.2), not when
    /// the module is loaded (`EAGER`).
    pub lazy_loading: bool,
    /// The pid NVML lists this process under (`VGPU_SIM_NVML_PID`; default: its own), to
    /// model a container whose PID namespace differs from the host's.
    pub nvml_pid: Option<u32>,
    /// Streaming multiprocessors per device.
    pub sm_count: i32,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Injected faults.
    pub faults: Vec<Fault>,
    /// Width of the utilization window NVML reports over, in milliseconds.
    pub util_window_ms: u64,
    /// Every device's power draw and limit (NVML's energy counter and enforced limit).
    pub power: PowerModel,
    /// `VGPU_SIM_SHARED_MEM=<file>`: processes naming the same file share device memory
    /// (`state/shared_mem.rs`).
    pub shared_mem: Option<String>,
    /// How long `nvmlDeviceGetTotalEnergyConsumption` takes, milliseconds
    /// (`VGPU_SIM_NVML_ENERGY_DELAY_MS`, default 0; the H200 takes ~3 ms, up to 15).
    pub nvml_energy_delay_ms: u64,
    /// Log every entry point to stderr.
    pub trace: bool,
    /// A released `cuMemCreate` handle's value is handed out again by the next `cuMemCreate`
    /// (`VGPU_SIM_REUSE_HANDLES=1`; default: values are never reused), as a driver whose
    /// handles are addresses of freed objects may: tests that a moved handle's old value never
    /// comes to name two allocations.
    pub reuse_vmm_handles: bool,
    /// How fast host-located `cuMemCreate` pins memory, MB/s (`VGPU_SIM_HOST_PIN_MBPS`;
    /// 0, the default: at once). The H200's host pins 4,600 MB/s (gpu-tests/host_pin_cost.cu):
    /// a swap-out that pins afresh takes seconds, which tests of what others see meanwhile need.
    pub host_pin_mbps: u64,
    /// How fast a copy between device memory and the program's pageable host memory (host
    /// memory the driver has not pinned) runs, MB/s (`VGPU_SIM_PAGEABLE_MBPS`; 0, the default:
    /// at once). The real driver stages such copies through its own pinned buffers: the H200
    /// moved 10.7–11.4 GB/s into pageable memory against 53 GB/s into pinned memory.
    pub pageable_mbps: u64,
}

/// A malformed variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The variable.
    pub var: String,
    /// Its value.
    pub value: String,
    /// What is wrong.
    pub why: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "vgpu-sim: bad {}={:?}: {}",
            self.var, self.value, self.why
        )
    }
}

impl std::error::Error for ConfigError {}

fn err(var: &str, value: &str, why: impl Into<String>) -> ConfigError {
    ConfigError {
        var: var.into(),
        value: value.into(),
        why: why.into(),
    }
}

/// Parses `123`, `4k`, `512m`, `80g`, `1t` (binary units, case-insensitive) into bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1u64 << 10),
        'm' | 'M' => (&s[..s.len() - 1], MIB),
        'g' | 'G' => (&s[..s.len() - 1], GIB),
        't' | 'T' => (&s[..s.len() - 1], GIB << 10),
        _ => (s, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(mult)
}

/// Parses `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (prefix optional) into 16 bytes.
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s
        .trim()
        .trim_start_matches("GPU-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Formats 16 UUID bytes the way NVML does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// The default UUID of physical device `i`: stable, distinct, recognisably simulated.
pub fn default_uuid(i: usize) -> [u8; 16] {
    let mut u = [
        0x5au8, 0x1e, 0x51, 0x30, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0,
    ];
    u[15] = i as u8;
    u[14] = 0xd0;
    u
}

fn parse_fault(item: &str) -> Option<Fault> {
    let mut parts = item.trim().split(':');
    let op = parts.next()?.trim().to_string();
    let nth = parts.next()?.trim();
    let code = parts.next()?.trim().parse::<u32>().ok()?;
    if parts.next().is_some() || op.is_empty() {
        return None;
    }
    let nth = if nth == "*" {
        None
    } else {
        Some(nth.parse::<u64>().ok().filter(|n| *n > 0)?)
    };
    Some(Fault { op, nth, code })
}

/// Resolves `CUDA_VISIBLE_DEVICES` the way the driver does: indices or UUID prefixes, and the
/// list stops at the first entry that names no device.
pub fn resolve_visible(spec: Option<&str>, uuids: &[[u8; 16]]) -> Vec<usize> {
    let Some(spec) = spec else {
        return (0..uuids.len()).collect();
    };
    let mut out = Vec::new();
    for entry in spec.split(',') {
        let entry = entry.trim();
        let found = if entry.starts_with("GPU-") {
            let want = entry.to_ascii_lowercase();
            let hits: Vec<usize> = (0..uuids.len())
                .filter(|&i| {
                    format_uuid(&uuids[i])
                        .to_ascii_lowercase()
                        .starts_with(&want)
                })
                .collect();
            if hits.len() == 1 { Some(hits[0]) } else { None }
        } else {
            entry.parse::<usize>().ok().filter(|&i| i < uuids.len())
        };
        match found {
            Some(i) if !out.contains(&i) => out.push(i),
            _ => break,
        }
    }
    out
}

impl SimConfig {
    /// Reads the configuration through `get` (the process environment in the library).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<SimConfig, ConfigError> {
        let size_var = |var: &str, default: u64| -> Result<u64, ConfigError> {
            match get(var) {
                None => Ok(default),
                Some(v) => parse_size(&v)
                    .ok_or_else(|| err(var, &v, "expected bytes with an optional k/m/g/t suffix")),
            }
        };
        let int_var = |var: &str, default: i64| -> Result<i64, ConfigError> {
            match get(var) {
                None => Ok(default),
                Some(v) => v
                    .trim()
                    .parse::<i64>()
                    .map_err(|_| err(var, &v, "expected an integer")),
            }
        };
        // An integer setting that must lie in `ok`; `expected` says so when it does not.
        let int_in =
            |var: &str, default: i64, ok: std::ops::RangeInclusive<i64>, expected: &str| {
                let value = int_var(var, default)?;
                if ok.contains(&value) {
                    Ok(value)
                } else {
                    Err(err(var, &value.to_string(), expected))
                }
            };
        let count = int_var("VGPU_SIM_DEVICE_COUNT", 1)?;
        if !(0..=MAX_SIM_DEVICES as i64).contains(&count) {
            let v = get("VGPU_SIM_DEVICE_COUNT").unwrap_or_default();
            return Err(err("VGPU_SIM_DEVICE_COUNT", &v, "expected 0..=16"));
        }
        let count = count as usize;
        let total = size_var("VGPU_SIM_TOTAL_MEM", 80 * GIB)?;
        let other = size_var("VGPU_SIM_OTHER_USED", 0)?;
        let uuid_list: Vec<String> = get("VGPU_SIM_UUIDS")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        if !uuid_list.is_empty() && uuid_list.len() != count {
            let v = get("VGPU_SIM_UUIDS").unwrap_or_default();
            return Err(err("VGPU_SIM_UUIDS", &v, format!("expected {count} UUIDs")));
        }
        let mut devices = Vec::with_capacity(count);
        for i in 0..count {
            let uuid = match uuid_list.get(i) {
                Some(s) => parse_uuid(s).ok_or_else(|| {
                    err(
                        "VGPU_SIM_UUIDS",
                        s,
                        "expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                    )
                })?,
                None => default_uuid(i),
            };
            let total_mem = size_var(&format!("VGPU_SIM_TOTAL_MEM_{i}"), total)?;
            let other_used = size_var(&format!("VGPU_SIM_OTHER_USED_{i}"), other)?;
            if other_used > total_mem {
                return Err(err(
                    &format!("VGPU_SIM_OTHER_USED_{i}"),
                    &other_used.to_string(),
                    "more than the device's total memory",
                ));
            }
            devices.push(DeviceConfig {
                total_mem,
                other_used,
                uuid,
            });
        }
        let uuids: Vec<[u8; 16]> = devices.iter().map(|d| d.uuid).collect();
        let visible = resolve_visible(get("CUDA_VISIBLE_DEVICES").as_deref(), &uuids);
        let faults = match get("VGPU_SIM_FAULTS") {
            None => Vec::new(),
            Some(v) => v
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|item| {
                    parse_fault(item).ok_or_else(|| {
                        err(
                            "VGPU_SIM_FAULTS",
                            &v,
                            "expected entry:nth:code[,entry:nth:code...] (nth may be *)",
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        };
        let cc = get("VGPU_SIM_COMPUTE_CAPABILITY").unwrap_or_else(|| "9.0".into());
        let compute_capability = cc
            .split_once('.')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
            .ok_or_else(|| err("VGPU_SIM_COMPUTE_CAPABILITY", &cc, "expected MAJOR.MINOR"))?;
        let driver_version = int_var("VGPU_SIM_DRIVER_VERSION", 13000)?;
        let sm_count = int_in("VGPU_SIM_SM_COUNT", 132, 1..=1024, "expected 1..=1024")?;
        let util_window_ms = int_in(
            "VGPU_SIM_UTIL_WINDOW_MS",
            1000,
            1..=i64::MAX,
            "expected > 0",
        )?;
        let lazy_loading = match get("CUDA_MODULE_LOADING") {
            None => true,
            Some(v) => match v.trim().to_ascii_uppercase().as_str() {
                "LAZY" | "" => true,
                "EAGER" => false,
                _ => return Err(err("CUDA_MODULE_LOADING", &v, "expected LAZY or EAGER")),
            },
        };
        let power = match get("VGPU_SIM_POWER") {
            None => PowerModel::default(),
            Some(v) => PowerModel::parse(&v).ok_or_else(|| {
                err(
                    "VGPU_SIM_POWER",
                    &v,
                    "expected <idle_w>,<busy_w>,<limit_w> in whole watts, the limit above 0",
                )
            })?,
        };
        let host_pin_mbps = int_in(
            "VGPU_SIM_HOST_PIN_MBPS",
            0,
            0..=1_000_000,
            "expected 0..=1000000",
        )?;
        let pageable_mbps = int_in(
            "VGPU_SIM_PAGEABLE_MBPS",
            0,
            0..=1_000_000,
            "expected 0..=1000000",
        )?;
        let nvml_energy_delay_ms = int_in(
            "VGPU_SIM_NVML_ENERGY_DELAY_MS",
            0,
            0..=1000,
            "expected 0..=1000",
        )?;
        let nvml_pid = match get("VGPU_SIM_NVML_PID") {
            None => None,
            Some(v) => Some(
                v.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| err("VGPU_SIM_NVML_PID", &v, "expected a pid > 0"))?,
            ),
        };
        Ok(SimConfig {
            devices,
            visible,
            driver_version: driver_version as i32,
            nvml_driver_version: get("VGPU_SIM_NVML_DRIVER_VERSION")
                .unwrap_or_else(|| "580.159.03".into()),
            name: get("VGPU_SIM_NAME").unwrap_or_else(|| "vgpu-sim Virtual GPU".into()),
            ctx_overhead: size_var("VGPU_SIM_CTX_OVERHEAD", 64 * MIB)?,
            module_overhead: size_var("VGPU_SIM_MODULE_OVERHEAD", 2 * MIB)?,
            pool_block_overhead: size_var("VGPU_SIM_POOL_BLOCK_OVERHEAD", 0)?,
            shared_mem: get("VGPU_SIM_SHARED_MEM"),
            host_pinned_limit: match get("VGPU_SIM_HOST_PINNED_LIMIT") {
                None => None,
                Some(_) => Some(size_var("VGPU_SIM_HOST_PINNED_LIMIT", 0)?),
            },
            lazy_loading,
            nvml_pid,
            sm_count: sm_count as i32,
            compute_capability,
            faults,
            util_window_ms: util_window_ms as u64,
            power,
            nvml_energy_delay_ms: nvml_energy_delay_ms as u64,
            trace: get("VGPU_SIM_TRACE").is_some_and(|v| v == "1"),
            reuse_vmm_handles: get("VGPU_SIM_REUSE_HANDLES").is_some_and(|v| v == "1"),
            host_pin_mbps: host_pin_mbps as u64,
            pageable_mbps: pageable_mbps as u64,
        })
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<SimConfig, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<SimConfig, ConfigError> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        SimConfig::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn sizes_parse_with_binary_units_and_reject_garbage() {
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("1.5g"), None);
        assert_eq!(parse_size("0x10"), None);
        assert_eq!(parse_size("g"), None);
        assert_eq!(parse_size("99999999999999t"), None);
    }

    #[test]
    fn defaults_are_one_80g_device() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.devices.len(), 1);
        assert_eq!(c.devices[0].total_mem, 80 << 30);
        assert_eq!(c.visible, vec![0]);
        assert_eq!(c.driver_version, 13000);
        assert_eq!(c.power, PowerModel::default());
        let capped = cfg(&[("VGPU_SIM_POWER", "100,900,500")]).unwrap();
        assert_eq!((capped.power.busy_w, capped.power.limit_w), (900, 500));
    }

    #[test]
    fn per_device_memory_and_uuids() {
        let c = cfg(&[
            ("VGPU_SIM_DEVICE_COUNT", "2"),
            ("VGPU_SIM_TOTAL_MEM", "1g"),
            ("VGPU_SIM_TOTAL_MEM_1", "2g"),
            (
                "VGPU_SIM_UUIDS",
                "GPU-00000000-0000-0000-0000-000000000001,GPU-00000000-0000-0000-0000-0000000000ff",
            ),
        ])
        .unwrap();
        assert_eq!(c.devices[0].total_mem, 1 << 30);
        assert_eq!(c.devices[1].total_mem, 2 << 30);
        assert_eq!(c.devices[1].uuid[15], 0xff);
        assert_eq!(
            format_uuid(&c.devices[0].uuid),
            "GPU-00000000-0000-0000-0000-000000000001"
        );
    }

    #[test]
    fn malformed_values_are_errors() {
        assert!(cfg(&[("VGPU_SIM_TOTAL_MEM", "lots")]).is_err());
        assert!(cfg(&[("VGPU_SIM_DEVICE_COUNT", "17")]).is_err());
        assert!(cfg(&[("VGPU_SIM_UUIDS", "GPU-1,GPU-2")]).is_err());
        assert!(cfg(&[("VGPU_SIM_FAULTS", "cuMemAlloc_v2:0:2")]).is_err());
        assert!(cfg(&[("VGPU_SIM_OTHER_USED", "2g"), ("VGPU_SIM_TOTAL_MEM", "1g")]).is_err());
        assert!(cfg(&[("VGPU_SIM_POWER", "100,900")]).is_err());
        assert!(cfg(&[("VGPU_SIM_HOST_PINNED_LIMIT", "some")]).is_err());
    }

    #[test]
    fn the_host_pinned_limit_is_off_unless_set() {
        assert_eq!(cfg(&[]).unwrap().host_pinned_limit, None);
        let c = cfg(&[("VGPU_SIM_HOST_PINNED_LIMIT", "64m")]).unwrap();
        assert_eq!(c.host_pinned_limit, Some(64 << 20));
        let c = cfg(&[("VGPU_SIM_HOST_PINNED_LIMIT", "0")]).unwrap();
        assert_eq!(c.host_pinned_limit, Some(0), "0 refuses every pinned byte");
    }

    #[test]
    fn faults_parse() {
        let c = cfg(&[("VGPU_SIM_FAULTS", "cuMemAlloc_v2:3:999, alloc:*:2")]).unwrap();
        assert_eq!(
            c.faults[0],
            Fault {
                op: "cuMemAlloc_v2".into(),
                nth: Some(3),
                code: 999
            }
        );
        assert_eq!(
            c.faults[1],
            Fault {
                op: "alloc".into(),
                nth: None,
                code: 2
            }
        );
    }

    #[test]
    fn visible_devices_by_index_and_uuid_stop_at_first_bad_entry() {
        let u = [default_uuid(0), default_uuid(1), default_uuid(2)];
        assert_eq!(resolve_visible(Some("2,0"), &u), vec![2, 0]);
        assert_eq!(resolve_visible(Some("1,7,0"), &u), vec![1]);
        assert_eq!(resolve_visible(Some(""), &u), Vec::<usize>::new());
        let id = format_uuid(&u[2]);
        assert_eq!(resolve_visible(Some(&id), &u), vec![2]);
        // An ambiguous prefix names no device.
        assert_eq!(
            resolve_visible(Some(&id[..id.len() - 1]), &u),
            Vec::<usize>::new()
        );
        assert_eq!(resolve_visible(None, &u), vec![0, 1, 2]);
    }

    #[test]
    fn uuid_round_trip() {
        let u = default_uuid(3);
        assert_eq!(parse_uuid(&format_uuid(&u)), Some(u));
    }
}
