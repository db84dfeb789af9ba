//! `vgpu demo`: a small CUDA workload under a memory limit, shown allocating up to the limit
//! and refused past it, with `vgpu status` of its usage file while it holds memory.
//!
//! Without a GPU it runs on the simulated driver (`libvgpusim.so` next to the vgpu binary,
//! served as `libcuda.so.1` / `libnvidia-ml.so.1` through symlinks in a temporary directory);
//! with a GPU, on the real driver. The workload is `vgpu workload`, which reaches the driver
//! through `dlopen` + `dlsym` like the CUDA runtime does.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use vgpu_cuda_abi::CUresult;

use crate::Failure;
use crate::cli::{DemoArgs, DriverChoice};
use crate::hook_env::{HookEnv, HookSetup, hook_env, library_path_with, make_sim_link_dir};
use crate::limits::MemoryFlag;
use crate::locate;
use crate::units::format_bytes;
use crate::usage_table;
use crate::workload::WorkloadProcess;

/// Whether the real driver is present with at least one device: asks a child (so this
/// process never initializes CUDA) running `vgpu workload` without the hook.
pub fn real_gpu_present(vgpu_exe: &Path) -> Result<(String, i64), String> {
    let mut w = WorkloadProcess::spawn(vgpu_exe, |_| {}, false)?;
    let reply = w.send("count")?;
    let _ = w.finish();
    if !reply.ok() {
        return Err(reply.line);
    }
    let n = reply.num("devices").unwrap_or(0) as i64;
    Ok((reply.line, n))
}

fn exe() -> Result<PathBuf, Failure> {
    std::env::current_exe()
        .map_err(|e| Failure::msg(format!("cannot find the vgpu binary itself: {e}")))
}

/// `vgpu demo`.
pub fn demo(args: &DemoArgs) -> Result<ExitCode, Failure> {
    let vgpu_exe = exe()?;
    let hook = locate::find_hook(args.lib.as_deref())?;
    let tmp = crate::private_tempdir("vgpu-demo-")
        .map_err(|e| Failure::msg(format!("cannot create a temporary directory: {e}")))?;
    let cache = tmp.path().join("demo.cache");

    let simulated = match args.driver {
        DriverChoice::Simulated => true,
        DriverChoice::Real => false,
        DriverChoice::Auto => !matches!(real_gpu_present(&vgpu_exe), Ok((_, n)) if n > 0),
    };
    let limit = args
        .memory
        .unwrap_or(if simulated { 1 << 30 } else { 2 << 30 });
    let mut env: HookEnv = hook_env(&HookSetup {
        hook: &hook.path,
        memory: &[MemoryFlag {
            device: None,
            bytes: limit,
        }],
        sm: &[],
        cache: Some(&cache),
    })?;
    let sim_total = limit.saturating_mul(4).max(8 << 30);
    if simulated {
        let sim = locate::find_sim()?;
        let links = tmp.path().join("driver");
        make_sim_link_dir(&sim.path, &links)?;
        env.set
            .insert("LD_LIBRARY_PATH".into(), library_path_with(&links));
        env.set
            .insert("VGPU_SIM_TOTAL_MEM".into(), sim_total.to_string());
        println!(
            "vgpu demo: no GPU used: the simulated driver {} is served as libcuda.so.1",
            sim.path.display()
        );
        println!(
            "           (a simulated device of {} of memory)",
            format_bytes(sim_total)
        );
    } else {
        println!("vgpu demo: running against the real CUDA driver");
    }
    println!("hook:      {} ({})", hook.path.display(), hook.how);
    println!("limit:     {} on every device", format_bytes(limit));
    println!(
        "usage:     {} (a private file, removed at the end)",
        cache.display()
    );
    println!();

    let mut w = WorkloadProcess::spawn(&vgpu_exe, |cmd: &mut Command| env.apply(cmd), true)?;
    let step = |w: &mut WorkloadProcess, c: &str| w.send(c).map_err(Failure::msg);
    let init = step(&mut w, "init")?;
    if !init.ok() {
        return Err(Failure::msg(format!(
            "the workload could not start CUDA: {}{}",
            init.line,
            if simulated {
                ""
            } else {
                "\nhint: try `vgpu demo --driver simulated`"
            }
        )));
    }
    println!(
        "workload pid {}: driver {} from {}",
        w.pid(),
        init.get("driver").unwrap_or("?"),
        init.get("file").unwrap_or("?")
    );
    let total = step(&mut w, "total")?;
    let info = step(&mut w, "info")?;
    let seen_total = total.num("bytes");
    let physical = if simulated {
        format!("the device's {}", format_bytes(sim_total))
    } else {
        "the physical total".to_owned()
    };
    let meaning = if seen_total == Some(limit) {
        format!("the limit, not {physical}")
    } else {
        format!("expected the limit, {}", format_bytes(limit))
    };
    println!(
        "cuDeviceTotalMem_v2 says {} ({meaning})",
        seen_total.map_or("?".into(), format_bytes)
    );
    if let (Some(free), Some(t)) = (info.num("free"), info.num("total")) {
        println!(
            "cuMemGetInfo_v2 says    {} free of {}",
            format_bytes(free),
            format_bytes(t)
        );
    }
    println!();
    println!(
        "allocating {} at a time with cuMemAlloc_v2:",
        format_bytes(args.step)
    );

    let max_steps = limit / args.step + 4;
    let mut granted = 0u64;
    let mut held = Vec::new();
    let mut refused: Option<(u64, i32, String)> = None;
    for i in 1..=max_steps {
        let r = step(&mut w, &format!("alloc {}", args.step))?;
        if r.ok() {
            granted += args.step;
            held.push(r.num("id").unwrap_or(0));
            println!(
                "  #{i:<3} ok       {:>10} held by this process",
                format_bytes(granted)
            );
        } else {
            let code = r.get("code").and_then(|c| c.parse().ok()).unwrap_or(-1);
            let name = r.get("name").unwrap_or("?").to_owned();
            println!("  #{i:<3} REFUSED  {name} ({code})");
            refused = Some((i, code, name));
            break;
        }
    }
    println!();
    println!(
        "vgpu status --cache {} (while the workload holds its memory):",
        cache.display()
    );
    // What the file counts on device 0 while the workload holds its memory (context included).
    let counted = match usage_table::read(&cache) {
        Ok(r) => {
            print!("{}", indent(&r.render_text()));
            r.devices
                .iter()
                .find(|d| d.index == 0)
                .map(|d| d.memory_used_bytes)
        }
        Err(e) => {
            println!("  cannot read the usage file: {e}");
            None
        }
    };
    println!();
    // Freeing gives the bytes back: the same request fits again.
    let mut reuse_ok = None;
    if let Some(id) = held.last().copied() {
        let f = step(&mut w, &format!("free {id}"))?;
        let again = step(&mut w, &format!("alloc {}", args.step))?;
        reuse_ok = Some(f.ok() && again.ok());
        println!(
            "freed one {} block and asked again: {}",
            format_bytes(args.step),
            if again.ok() {
                "ok (freed memory is returned to the limit)"
            } else {
                "refused"
            }
        );
    }
    let status = w.finish().map_err(Failure::msg)?;
    // Its exit code says whether every command succeeded: 1 after the refusals shown above.
    println!(
        "workload exited: {status}{}",
        if status.code() == Some(1) {
            " (some of its commands were refused, as shown above)"
        } else {
            ""
        }
    );
    if let Ok(r) = usage_table::read(&cache) {
        let used: u64 = r.devices.iter().map(|d| d.memory_used_bytes).sum();
        let dead = r.processes.iter().filter(|p| !p.alive).count();
        if dead > 0 {
            println!(
                "after it exited: {} still counted for {dead} dead process(es) until the next \
                 program attaches to the file",
                format_bytes(used)
            );
            // Attaching for writing sweeps dead processes, as any hooked program's start does.
            match usage_table::open_writable(&cache).and_then(|t| {
                t.sweep_dead().map_err(|e| e.to_string())?;
                Ok(t.usage(vgpu_alloc_core::DeviceIndex(0)).used)
            }) {
                Ok(left) => println!("attached and swept: {} counted now", format_bytes(left)),
                Err(e) => println!("could not sweep the file: {e}"),
            }
        } else {
            println!(
                "after it exited: {} counted in the file",
                format_bytes(used)
            );
        }
    }
    println!();

    let limit_seen = seen_total == Some(limit);
    // The refusal is the limit's doing only if the request would really have crossed it.
    let over_limit = counted.is_some_and(|c| c.saturating_add(args.step) > limit);
    let verdict = match refused {
        Some((_, code, _))
            if i64::from(code) == i64::from(CUresult::OUT_OF_MEMORY.0)
                && granted > 0
                && over_limit =>
        {
            println!(
                "RESULT: limit enforced. {} granted ({} counted with the context), the next {} \
                 refused with CUDA_ERROR_OUT_OF_MEMORY; the device showed {} total.",
                format_bytes(granted),
                counted.map_or("?".into(), format_bytes),
                format_bytes(args.step),
                seen_total.map_or("?".into(), format_bytes)
            );
            limit_seen && reuse_ok != Some(false)
        }
        Some((_, code, name)) => {
            println!(
                "RESULT: NOT as expected: an allocation failed with {name} ({code}) after {} \
                 while the file counted {} of the {} limit",
                format_bytes(granted),
                counted.map_or("nothing".into(), format_bytes),
                format_bytes(limit)
            );
            false
        }
        None => {
            println!(
                "RESULT: NOT ENFORCED: {} allocated, past the {} limit",
                format_bytes(granted),
                format_bytes(limit)
            );
            false
        }
    };
    // The usage file above is gone with the demo's directory: point at what stays.
    println!(
        "next:      vgpu run --memory {}{} -- <your program>   (its own usage table; \
         --share NAME to share one)",
        crate::units::format_size_arg(limit),
        if simulated { " --driver simulated" } else { "" }
    );
    if !limit_seen {
        println!(
            "note: cuDeviceTotalMem_v2 should report the limit ({}); it reported {:?}",
            limit, seen_total
        );
    }
    Ok(if verdict {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("  {l}\n")).collect()
}
