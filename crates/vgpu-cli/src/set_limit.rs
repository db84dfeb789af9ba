//! `vgpu set-limit`: change limits in a live usage file through vgpu-shm; text or JSON.

use std::process::ExitCode;

use serde::Serialize;
use vgpu_alloc_core::DeviceIndex;

use crate::Failure;
use crate::cli::SetLimitArgs;
use crate::units::format_limit;
use crate::usage_table::open_writable;

/// The JSON schema identifier of `set-limit --json` (docs/cli.md).
pub const SCHEMA: &str = "vgpu.set-limit.v1";

fn pct(p: Option<u64>) -> String {
    p.map_or_else(|| "unlimited".to_owned(), |p| format!("{p}%"))
}

/// What `set-limit --json` prints.
#[derive(Debug, Serialize)]
pub struct SetLimitReport {
    /// Always [`SCHEMA`].
    pub schema: &'static str,
    /// The usage file changed.
    pub cache: String,
    /// One entry per device and kind of limit changed.
    pub changes: Vec<LimitChange>,
    /// The file's `CUDA_TASK_PRIORITY`, when `--priority` changed it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<PriorityChange>,
}

/// The file's priority before and after (`--priority`).
#[derive(Debug, Serialize)]
pub struct PriorityChange {
    /// The value before.
    pub old: i32,
    /// The value now.
    pub new: i32,
}

/// One limit changed on one device; `null` old/new = unlimited.
#[derive(Debug, Serialize)]
pub struct LimitChange {
    /// Device index.
    pub device: u32,
    /// `memory_bytes` or `sm_percent`.
    pub limit: &'static str,
    /// The value before.
    pub old: Option<u64>,
    /// The value now.
    pub new: Option<u64>,
    /// Memory in use on the device (memory changes only): above `new`, new allocations are
    /// refused until it drops.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used_bytes: Option<u64>,
}

/// `vgpu set-limit`.
pub fn set_limit(args: &SetLimitArgs) -> Result<ExitCode, Failure> {
    let path = args.file.path();
    let table = open_writable(&path)?;
    let device_num = table.device_num();
    let per_device = args.memory.is_some() || args.sm.is_some();
    let devices: Vec<u32> = match args.device {
        // The priority is the file's, not a device's.
        _ if !per_device => Vec::new(),
        Some(d) if d >= device_num => {
            return Err(Failure::msg(format!(
                "device {d} is not in {} (it has {device_num} device(s): 0..{device_num})",
                path.display()
            )));
        }
        Some(d) => vec![d],
        None if device_num == 0 => {
            return Err(Failure::msg(format!(
                "{} records no devices yet; nothing to change",
                path.display()
            )));
        }
        None => (0..device_num).collect(),
    };
    let mut changes = Vec::new();
    for d in devices {
        let dev = DeviceIndex(d);
        if let Some(bytes) = args.memory {
            let old = table.memory_limit(dev);
            let new = (bytes != 0).then_some(bytes);
            table
                .set_memory_limit(dev, new)
                .map_err(|e| Failure::msg(e.to_string()))?;
            changes.push(LimitChange {
                device: d,
                limit: "memory_bytes",
                old,
                new,
                used_bytes: Some(table.usage(dev).used),
            });
        }
        if let Some(p) = args.sm {
            let old = table.sm_limit(dev);
            let new = (p != 0).then_some(u64::from(p));
            table
                .set_sm_limit(dev, new)
                .map_err(|e| Failure::msg(e.to_string()))?;
            changes.push(LimitChange {
                device: d,
                limit: "sm_percent",
                old,
                new,
                used_bytes: None,
            });
        }
    }
    let priority = match args.priority {
        Some(p) => {
            let old = table.priority();
            table
                .set_priority(p)
                .map_err(|e| Failure::msg(e.to_string()))?;
            Some(PriorityChange { old, new: p })
        }
        None => None,
    };
    if args.json {
        let report = SetLimitReport {
            schema: SCHEMA,
            cache: path.display().to_string(),
            changes,
            priority,
        };
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Failure::msg(format!("cannot encode the report: {e}")))?;
        println!("{}", crate::untrusted::json(text));
        return Ok(ExitCode::SUCCESS);
    }
    for c in &changes {
        match c.limit {
            "memory_bytes" => {
                let note = match (c.new, c.used_bytes) {
                    (Some(n), Some(used)) if used > n => format!(
                        " (usage {} is above it: new allocations are refused until it drops)",
                        format_limit(Some(used))
                    ),
                    _ => String::new(),
                };
                println!(
                    "device {}: memory limit {} -> {}{note}",
                    c.device,
                    format_limit(c.old),
                    format_limit(c.new)
                );
            }
            _ => println!(
                "device {}: SM limit {} -> {}",
                c.device,
                pct(c.old),
                pct(c.new)
            ),
        }
    }
    if let Some(p) = priority {
        println!("priority {} -> {} (0 = high)", p.old, p.new);
    }
    Ok(ExitCode::SUCCESS)
}
