//! `vgpu set-limit`: change limits in a live usage file through vgpu-shm.

use std::process::ExitCode;

use vgpu_alloc_core::DeviceIndex;

use crate::Failure;
use crate::cli::SetLimitArgs;
use crate::report::table_path;
use crate::table::open_writable;
use crate::units::format_limit;

fn pct(p: Option<u64>) -> String {
    p.map_or_else(|| "unlimited".to_owned(), |p| format!("{p}%"))
}

/// `vgpu set-limit`.
pub fn set_limit(args: &SetLimitArgs) -> Result<ExitCode, Failure> {
    let path = table_path(&args.cache, &args.share);
    let table = open_writable(&path)?;
    let device_num = table.device_num();
    let devices: Vec<u32> = match args.device {
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
    for d in devices {
        let dev = DeviceIndex(d);
        if let Some(bytes) = args.memory {
            let old = table.memory_limit(dev);
            let new = (bytes != 0).then_some(bytes);
            table
                .set_memory_limit(dev, new)
                .map_err(|e| Failure::msg(e.to_string()))?;
            let used = table.usage(dev).used;
            let note = match new {
                Some(n) if used > n => format!(
                    " (usage {} is above it: new allocations are refused until it drops)",
                    format_limit(Some(used))
                ),
                _ => String::new(),
            };
            println!(
                "device {d}: memory limit {} -> {}{note}",
                format_limit(old),
                format_limit(new)
            );
        }
        if let Some(p) = args.sm {
            let old = table.sm_limit(dev);
            let new = (p != 0).then_some(u64::from(p));
            table
                .set_sm_limit(dev, new)
                .map_err(|e| Failure::msg(e.to_string()))?;
            println!("device {d}: SM limit {} -> {}", pct(old), pct(new));
        }
    }
    Ok(ExitCode::SUCCESS)
}
