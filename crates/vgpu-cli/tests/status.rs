//! `status`, `watch`, `set-limit` and the exporter on a real usage file written through
//! vgpu-shm by helper processes (one alive, one SIGKILLed while still counted).

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
use vgpu_shm::{
    DeviceSnapshot, ProcessDeviceUsage, ProcessSnapshot, TableInit, TableSnapshot, UsageTable,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const HELPER_VAR: &str = "VGPU_CLI_TEST_HELPER";

/// Not a test: the entry point of the helper processes the tests below start (this same
/// test binary re-executed with `--ignored --exact`). It registers in the table named by
/// `$VGPU_CLI_TEST_HELPER` (`PATH;DEV:CLASS:BYTES;...`), reserves, reports `ready`, and
/// holds everything until its stdin closes.
#[test]
#[ignore = "helper process entry point, started by the other tests"]
fn helper_process_entry_point() {
    let spec = std::env::var(HELPER_VAR).expect("started as a helper");
    let mut parts = spec.split(';');
    let table = UsageTable::open_existing(parts.next().unwrap()).unwrap();
    let slot = table.register_self().unwrap();
    for r in parts {
        let f: Vec<&str> = r.split(':').collect();
        let class = match f[1] {
            "context" => UsageClass::Context,
            "module" => UsageClass::Module,
            _ => UsageClass::Data,
        };
        let dev = DeviceIndex(f[0].parse().unwrap());
        if f[1] == "sm" {
            slot.set_sm_util(dev, f[2].parse().unwrap());
        } else {
            slot.try_reserve(dev, class, f[2].parse().unwrap()).unwrap();
        }
    }
    println!("ready {}", std::process::id());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(slot);
}

/// A helper process holding usage in the table.
struct Helper {
    child: Reaped,
}

impl Helper {
    fn start(table: &Path, reservations: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "helper_process_entry_point",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HELPER_VAR, format!("{};{reservations}", table.display()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        // Bounded: the helper only attaches, reserves and prints.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            loop {
                line.clear();
                // libtest prints "test NAME ... " without a newline before the helper's own line.
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line.contains("ready ") {
                    let _ = tx.send(line.clone());
                    return;
                }
            }
        });
        let got = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("helper ready");
        assert!(got.contains("ready "), "helper failed: {got:?}");
        Helper {
            child: Reaped(child),
        }
    }

    fn pid(&self) -> i32 {
        self.child.0.id() as i32
    }

    fn kill(&mut self) {
        self.child.kill();
    }
}

/// A fresh directory named after `tag` holding [`make_table`]'s file.
fn fresh_table(tag: &str) -> (TempDir, std::path::PathBuf) {
    let dir = TempDir::new(tag).unwrap();
    let path = make_table(&dir);
    (dir, path)
}

/// Two devices, `usage.cache` in `dir`: the first limited to 1 GiB and 50%, the second not.
fn make_table(dir: &TempDir) -> std::path::PathBuf {
    let path = dir.path().join("usage.cache");
    let init = TableInit {
        uuids: vec![
            "GPU-aaaaaaaa-0000-0000-0000-000000000000".into(),
            "GPU-bbbbbbbb-0000-0000-0000-000000000001".into(),
        ],
        memory_limits: vec![Some(GIB), None],
        sm_limits: vec![Some(50), None],
        priority: 1,
    };
    drop(UsageTable::open_or_create(&path, &init).unwrap());
    path
}

fn status_json(path: &Path) -> serde_json::Value {
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status", "--json"], path);
    let out = run(cmd);
    out.assert_success();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

#[test]
fn status_lists_the_containers_taking_turns_on_each_gpu() {
    let (dir, path) = fresh_table("vgpu-status-turns");
    let turns = dir.path().join("turns");
    std::fs::create_dir_all(&turns).unwrap();
    let board_path = turns.join(vgpu_shm::board_file_name(
        "GPU-aaaaaaaa-0000-0000-0000-000000000000",
    ));
    let mut board = vgpu_shm::TurnBoard::open_or_create(&board_path).unwrap();
    let now = vgpu_shm::monotonic_ns();
    let me = vgpu_shm::container_key(&path).unwrap();
    board
        .announce(me, 50, 47_000, now, 1_000_000_000, 1_000_000_000)
        .unwrap();
    board
        .announce(me ^ 2, 30, 0, now, 1_000_000_000, 1_000_000_000)
        .unwrap();
    // An entry that stopped announcing two seconds ago is not listed.
    board
        .announce(
            me ^ 4,
            20,
            0,
            now.saturating_sub(2_000_000_000),
            1_000_000_000,
            1_000_000_000,
        )
        .unwrap();

    let mut cmd = vgpu();
    cmd.args(["status", "--json", "--cache", path.to_str().unwrap()])
        .env("VGPU_TURN_DIR", &turns);
    let out = run(cmd);
    out.assert_success();
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let listed: Vec<(u64, bool)> = v["devices"][0]["turns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["sm_limit_percent"].as_u64().unwrap(),
                t["this_container"].as_bool().unwrap(),
            )
        })
        .collect();
    let mut listed = listed;
    listed.sort_unstable();
    assert_eq!(listed, [(30, false), (50, true)]);
    assert!(v["devices"][1]["turns"].as_array().unwrap().is_empty());

    let mut cmd = vgpu();
    cmd.args(["status", "--cache", path.to_str().unwrap()])
        .env("VGPU_TURN_DIR", &turns);
    let out = run(cmd);
    assert!(
        out.stdout
            .contains("device 0: 2 limited containers on the board")
            && out.stdout.contains("50% (this one)"),
        "{}",
        out.stdout
    );
    // With turns off, nothing is read.
    let mut cmd = vgpu();
    cmd.args(["status", "--json", "--cache", path.to_str().unwrap()])
        .env("VGPU_TURN_DIR", "off");
    let v: serde_json::Value = serde_json::from_str(&run(cmd).stdout).unwrap();
    assert!(v["devices"][0]["turns"].as_array().unwrap().is_empty());
}

#[test]
fn status_json_reports_devices_processes_and_the_dead() {
    let (_dir, path) = fresh_table("vgpu-status");
    let alive = Helper::start(
        &path,
        &format!("0:context:{};0:data:{};0:sm:30", 64 * MIB, 256 * MIB),
    );
    let mut dead = Helper::start(&path, &format!("1:data:{}", 128 * MIB));
    let dead_pid = dead.pid();
    dead.kill();

    let v = status_json(&path);
    assert_eq!(v["schema"], "vgpu.status.v1");
    assert_eq!(v["cache"], path.to_str().unwrap());
    let d0 = &v["devices"][0];
    assert_eq!(d0["index"], 0);
    assert_eq!(d0["uuid"], "GPU-aaaaaaaa-0000-0000-0000-000000000000");
    assert_eq!(d0["memory_limit_bytes"], GIB);
    assert_eq!(d0["memory_used_bytes"], 320 * MIB);
    assert_eq!(d0["context_bytes"], 64 * MIB);
    assert_eq!(d0["module_bytes"], 0);
    assert_eq!(d0["data_bytes"], 256 * MIB);
    assert_eq!(d0["sm_limit_percent"], 50);
    assert_eq!(d0["sm_utilization_percent"], 30);
    let d1 = &v["devices"][1];
    assert_eq!(d1["memory_limit_bytes"], serde_json::Value::Null);
    assert_eq!(d1["sm_limit_percent"], serde_json::Value::Null);
    // The dead process is still counted: status never sweeps.
    assert_eq!(d1["memory_used_bytes"], 128 * MIB);

    let procs = v["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 2, "{v:#}");
    let a = procs
        .iter()
        .find(|p| p["pid"] == alive.pid())
        .expect("live helper listed");
    assert_eq!(a["alive"], true);
    assert_eq!(a["state"], "running");
    assert_eq!(a["memory_used_bytes"], 320 * MIB);
    assert_eq!(a["devices"][0]["index"], 0);
    assert_eq!(a["devices"][0]["context_bytes"], 64 * MIB);
    assert_eq!(a["devices"][0]["sm_utilization_percent"], 30);
    assert_eq!(
        a["devices"].as_array().unwrap().len(),
        1,
        "unused devices are left out"
    );
    let d = procs
        .iter()
        .find(|p| p["pid"] == dead_pid)
        .expect("dead helper listed");
    assert_eq!(d["alive"], false);
    assert_eq!(d["state"], "dead");
    assert_eq!(d["devices"][0]["index"], 1);
    assert_eq!(d["devices"][0]["memory_used_bytes"], 128 * MIB);

    // The text view says the same in words.
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status"], &path);
    let out = run(cmd);
    assert_eq!(out.code(), Some(0));
    out.assert_stdout_has(&["320 MiB / 1 GiB (31%)"]);
    out.assert_stdout_has(&["128 MiB / unlimited"]);
    out.assert_stdout_has(&[&dead_pid.to_string(), "dead"]);
    // Still there at a second look: reading changed nothing.
    assert_eq!(status_json(&path)["processes"].as_array().unwrap().len(), 2);
    drop(alive);
}

#[test]
fn swap_out_writes_a_request_and_status_shows_a_swapped_process() {
    let (_dir, path) = fresh_table("vgpu-swapout");
    let table = UsageTable::open_existing(&path).unwrap();
    assert_eq!(table.swap_requests(), 0);
    let me = table.register_self().unwrap();
    let ask = |json: bool| {
        let mut cmd = vgpu();
        cmd.arg("swap-out")
            .args(["--cache", path.to_str().unwrap()]);
        if json {
            cmd.arg("--json");
        }
        run(cmd)
    };
    let out = ask(false);
    out.assert_success();
    out.assert_stdout_has(&["asked the 1 process(es)", "request 1", "VGPU_IDLE_SWAP"]);
    assert_eq!(
        table.swap_requests(),
        1,
        "the request is one count in the file"
    );
    let out = ask(true);
    out.assert_success();
    let doc: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(doc["schema"], "vgpu.swap-out.v1");
    assert_eq!(doc["request"], 2);
    assert_eq!(table.swap_requests(), 2);
    // What the process says of itself is what status shows.
    assert_eq!(status_json(&path)["processes"][0]["state"], "running");
    me.set_swapped_out(true);
    assert_eq!(status_json(&path)["processes"][0]["state"], "swapped");
    let mut cmd = vgpu();
    cmd.args(["status", "--cache", path.to_str().unwrap()]);
    run(cmd).assert_stdout_has(&["swapped"]);
    let mut cmd = vgpu();
    cmd.args(["watch", "--count", "1", "--cache", path.to_str().unwrap()]);
    let w = run(cmd);
    assert!(w.stdout.contains("swapped"), "watch: {}", w.stdout);
    me.set_swapped_out(false);
    assert_eq!(status_json(&path)["processes"][0]["state"], "running");
    // A missing file is an error, not a new file.
    let missing = path.with_file_name("missing.cache");
    let mut cmd = vgpu();
    cmd.arg("swap-out")
        .args(["--cache", missing.to_str().unwrap()]);
    let out = run(cmd);
    assert_ne!(out.code(), Some(0));
    assert!(!missing.exists());
}

/// What a process says it keeps pinned for its swap-outs (docs/swap.md "Host memory") is
/// shown by `status` (text and JSON), `watch` and the exporter, for the container and for the
/// process, and goes when the process gives it back.
#[test]
fn host_memory_kept_for_swap_outs_is_shown_by_status_watch_and_the_exporter() {
    let (dir, path) = fresh_table("vgpu-kept");
    let table = UsageTable::open_existing(&path).unwrap();
    let me = table.register_self().unwrap();
    let kept = |v: &serde_json::Value| {
        (
            v["swap_kept_host_bytes"].clone(),
            v["processes"][0]["swap_kept_host_bytes"].clone(),
        )
    };
    assert_eq!(kept(&status_json(&path)), (0.into(), 0.into()));
    me.add_kept_host(48 * MIB);
    assert_eq!(
        kept(&status_json(&path)),
        ((48 * MIB).into(), (48 * MIB).into())
    );
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status"], &path);
    run(cmd).assert_stdout_has(&[
        "host memory kept for swap-outs: 48 MiB pinned beyond the swapped data",
        "  + 48 MiB kept for swap-outs",
    ]);
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["watch", "--count", "1"], &path);
    run(cmd).assert_stdout_has(&[
        "kept for swap-outs: 48 MiB of pinned host memory beyond the swapped data",
        "  kept 48 MiB",
    ]);
    let exporter = Exporter::start(
        vgpu(),
        &[
            "--cache",
            &format!("{}/*.cache", dir.path().display()),
            "--per-process",
        ],
    );
    let (status, body) =
        vgpu_cli::http::get(&exporter.addr, "/metrics", Duration::from_secs(5)).unwrap();
    drop(exporter);
    assert_eq!(status, 200);
    let c = format!("cache=\"{}\"", path.display());
    for want in [
        format!("vgpu_swap_kept_host_bytes{{{c}}} {}", 48 * MIB),
        format!(
            "vgpu_process_swap_kept_host_bytes{{{c},pid=\"{}\",host_pid=\"\"}} {}",
            std::process::id(),
            48 * MIB
        ),
    ] {
        assert!(
            body.lines().any(|l| l == want),
            "missing {want:?} in\n{body}"
        );
    }
    me.remove_kept_host(48 * MIB);
    assert_eq!(kept(&status_json(&path)), (0.into(), 0.into()));
    drop(me);
}

#[test]
fn set_limit_changes_the_live_file() {
    let (_dir, path) = fresh_table("vgpu-setlimit");
    let p = path.to_str().unwrap();
    let _holder = Helper::start(&path, &format!("0:data:{}", 512 * MIB));
    let set = |args: &[&str]| {
        let mut cmd = vgpu();
        cmd.arg("set-limit").args(args).args(["--cache", p]);
        run(cmd)
    };
    let out = set(&["--device", "0", "--memory", "2g"]);
    out.assert_success();
    assert_eq!(out.stdout, "device 0: memory limit 1 GiB -> 2 GiB\n");
    assert_eq!(
        status_json(&path)["devices"][0]["memory_limit_bytes"],
        2 * GIB
    );
    // The table enforces it at once for every process attached to it.
    let table = UsageTable::open_existing(&path).unwrap();
    let me = table.register_self().unwrap();
    assert!(
        me.try_reserve(DeviceIndex(0), UsageClass::Data, GIB)
            .is_ok()
    );
    me.release(DeviceIndex(0), UsageClass::Data, GIB);
    let out = set(&["--memory", "256m"]);
    out.assert_success();
    assert!(
        out.stdout
            .contains("device 0: memory limit 2 GiB -> 256 MiB (usage 512 MiB is above it"),
        "{}",
        out.stdout
    );
    out.assert_stdout_has(&["device 1: memory limit unlimited -> 256 MiB\n"]);
    assert!(
        me.try_reserve(DeviceIndex(0), UsageClass::Data, MIB)
            .is_err(),
        "lowered limit refuses"
    );
    let out = set(&["--sm", "0"]);
    assert_eq!(
        out.stdout,
        "device 0: SM limit 50% -> unlimited\ndevice 1: SM limit unlimited -> unlimited\n"
    );
    let out = set(&["--device", "1", "--sm", "25", "--memory", "0"]);
    assert_eq!(
        out.stdout,
        "device 1: memory limit 256 MiB -> unlimited\ndevice 1: SM limit unlimited -> 25%\n"
    );
    let v = status_json(&path);
    assert_eq!(v["devices"][1]["sm_limit_percent"], 25);
    assert_eq!(
        v["devices"][1]["memory_limit_bytes"],
        serde_json::Value::Null
    );
    assert_fails(
        &set(&["--device", "5", "--sm", "10"]),
        1,
        &["device 5 is not in", "2 device(s)"],
    );
    drop(me);
}

#[test]
fn missing_and_foreign_files_are_clear_errors() {
    let dir = TempDir::new("vgpu-status").unwrap();
    let missing = dir.path().join("nope.cache");
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status"], &missing);
    assert_fails(
        &run(cmd),
        1,
        &["does not exist", "no program has run under the hook"],
    );
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["set-limit", "--memory", "1g"], &missing);
    assert_fails(&run(cmd), 1, &["does not exist"]);
    let foreign = dir.path().join("foreign.cache");
    std::fs::write(&foreign, vec![7u8; 4096]).unwrap();
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status", "--json"], &foreign);
    let out = run(cmd);
    assert_fails(&out, 1, &["not a usable vgpu usage file", "foreign.cache"]);
    assert!(out.stdout.is_empty());
    // The default path comes from the environment variable the hook uses.
    let mut cmd = vgpu();
    cmd.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &missing)
        .arg("status");
    assert_fails(&run(cmd), 1, &["nope.cache"]);
}

/// The hook counts the limit's refusals in the file (`UsageTable::count_refusal`, tested on
/// the simulated driver in vgpu-hook); every reader shows the count.
#[test]
fn refusals_in_the_file_are_shown_by_status_watch_and_their_json() {
    let (_dir, path) = fresh_table("vgpu-refusals");
    let t = UsageTable::open_existing(&path).unwrap();
    t.count_refusal(DeviceIndex(1));
    t.count_refusal(DeviceIndex(1));
    drop(t);
    let v = status_json(&path);
    assert_eq!(v["devices"][0]["oom_refusals"], 0, "{v:#}");
    assert_eq!(v["devices"][1]["oom_refusals"], 2, "{v:#}");
    let mut cmd = vgpu();
    cmd.args(["status", "--cache", path.to_str().unwrap()]);
    let out = run(cmd);
    assert!(
        out.stdout
            .contains("device 1: 2 allocations refused by the limit"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.contains("device 0: 0 allocations"),
        "{}",
        out.stdout
    );
    let mut cmd = vgpu();
    cmd.args(["watch", "--cache", path.to_str().unwrap()]);
    let out = run_bounded(cmd, Duration::from_secs(10));
    assert!(
        out.stdout.contains("2 OOM refusals by the limit"),
        "{}",
        out.stdout
    );
    let mut cmd = vgpu();
    cmd.args(["watch", "--json", "--cache", path.to_str().unwrap()]);
    let out = run_bounded(cmd, Duration::from_secs(10));
    let sample: serde_json::Value =
        serde_json::from_str(out.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", out.stdout));
    assert_eq!(
        sample["status"]["devices"][1]["oom_refusals"], 2,
        "{sample:#}"
    );
}

#[test]
fn watch_refreshes_and_stops_after_count() {
    let (_dir, path) = fresh_table("vgpu-watch");
    let _h = Helper::start(&path, &format!("0:data:{}", 100 * MIB));
    let mut cmd = vgpu();
    cache_args(
        &mut cmd,
        &["watch", "--interval", "10ms", "--count", "3"],
        &path,
    );
    let out = run(cmd);
    out.assert_success();
    assert_eq!(out.stdout.matches("refresh ").count(), 3, "{}", out.stdout);
    assert_eq!(
        out.stdout.matches("100 MiB / 1 GiB").count(),
        3,
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.contains('\x1b'),
        "no escape codes when not a terminal"
    );
    // Without --count and without a terminal: one frame.
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["watch"], &path);
    let out = run_bounded(cmd, Duration::from_secs(10));
    assert_eq!(out.stdout.matches("refresh ").count(), 1);
    // A missing file is shown, not fatal.
    let mut cmd = vgpu();
    cmd.args([
        "watch",
        "--count",
        "2",
        "--interval",
        "10ms",
        "--cache",
        "/nonexistent/x.cache",
    ]);
    let out = run(cmd);
    assert_eq!(out.code(), Some(0));
    assert_eq!(
        out.stdout.matches("does not exist").count(),
        2,
        "{}",
        out.stdout
    );
}

#[test]
fn watch_stops_cleanly_on_ctrl_c() {
    let (_dir, path) = fresh_table("vgpu-watch");
    let mut cmd = vgpu();
    cmd.args([
        "watch",
        "--interval",
        "10s",
        "--count",
        "0",
        "--cache",
        path.to_str().unwrap(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("refresh 1"), "{line}");
    // SAFETY: sending SIGINT to our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = wait_bounded(&mut child, Duration::from_secs(5));
    assert_eq!(
        status.code(),
        Some(0),
        "Ctrl-C ends watch with success, within a sleep slice"
    );
}

#[test]
fn exporter_reports_a_live_file() {
    let (dir, path) = fresh_table("vgpu-exp-live");
    let second_dir = dir.path().join("c2");
    std::fs::create_dir(&second_dir).unwrap();
    let h = Helper::start(&path, &format!("0:data:{};0:sm:40", 300 * MIB));
    UsageTable::open_existing(&path)
        .unwrap()
        .count_refusal(DeviceIndex(0));
    let exporter = Exporter::start(
        vgpu(),
        &[
            "--cache",
            &format!("{}/*.cache", dir.path().display()),
            "--per-process",
        ],
    );
    let (status, body) =
        vgpu_cli::http::get(&exporter.addr, "/metrics", Duration::from_secs(5)).unwrap();
    drop(exporter);
    assert_eq!(status, 200);
    let c = format!("cache=\"{}\"", path.display());
    let dev = format!("{c},device=\"0\",uuid=\"GPU-aaaaaaaa-0000-0000-0000-000000000000\"");
    for want in [
        format!("vgpu_up{{{c}}} 1"),
        "vgpu_exporter_files 1".to_owned(),
        format!("vgpu_device_memory_limit_bytes{{{dev}}} {GIB}"),
        format!("vgpu_device_memory_used_bytes{{{dev}}} {}", 300 * MIB),
        format!(
            "vgpu_device_memory_class_bytes{{{dev},class=\"data\"}} {}",
            300 * MIB
        ),
        format!("vgpu_device_sm_limit_percent{{{dev}}} 50"),
        format!("vgpu_device_sm_utilization_percent{{{dev}}} 40"),
        format!("vgpu_device_processes{{{dev}}} 1"),
        format!("vgpu_device_oom_refusals_total{{{dev}}} 1"),
        format!(
            "vgpu_process_memory_used_bytes{{{c},pid=\"{}\",host_pid=\"\",device=\"0\"}} {}",
            h.pid(),
            300 * MIB
        ),
        format!(
            "vgpu_process_sm_utilization_percent{{{c},pid=\"{}\",host_pid=\"\",device=\"0\"}} 40",
            h.pid()
        ),
        format!(
            "vgpu_process_alive{{{c},pid=\"{}\",host_pid=\"\"}} 1",
            h.pid()
        ),
    ] {
        assert!(
            body.lines().any(|l| l == want),
            "missing {want:?} in\n{body}"
        );
    }
}

/// The file's limit used to win over `--memory` with only a note (issue 14); now a file
/// nobody uses takes the job's limits, and says so (a live one refuses: tests/workstation.rs).
#[test]
fn run_notes_when_the_file_holds_another_limit() {
    let (dir, path) = fresh_table("vgpu-status");
    let lib = dir.path().join("libvgpu.so");
    std::fs::write(&lib, b"").unwrap();
    let run_with = |memory: &str| {
        let mut cmd = vgpu();
        cmd.args(["run", "--lib", lib.to_str().unwrap(), "--memory", memory])
            .args(["--cache", path.to_str().unwrap(), "--", "true"]);
        run(cmd)
    };
    // The same limit as the file: nothing to say about device 0.
    let out = run_with("0=1g");
    out.assert_success();
    assert!(!out.stderr.contains("device 0"), "{}", out.stderr);
    let out = run_with("2g");
    out.assert_success();
    assert!(
        out.stderr.contains(
            "held other limits from an earlier job (device 0 memory limit 1 GiB (this job: 2 GiB)"
        ) && out.stderr.contains("this job's limits replace them"),
        "{}",
        out.stderr
    );
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status", "--json"], &path);
    let v: serde_json::Value = serde_json::from_str(&run(cmd).stdout).unwrap();
    assert_eq!(v["devices"][0]["memory_limit_bytes"], 2u64 << 30);
}

#[test]
fn exporter_defaults_to_the_hooks_usage_file() {
    let (_dir, path) = fresh_table("vgpu-exp-default");
    let mut cmd = vgpu();
    cmd.env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &path);
    let exporter = Exporter::start(cmd, &[]);
    let line = &exporter.banner;
    assert!(line.ends_with(&format!("for {}", path.display())), "{line}");
    let (status, body) =
        vgpu_cli::http::get(&exporter.addr, "/metrics", Duration::from_secs(5)).unwrap();
    drop(exporter);
    assert_eq!(status, 200);
    assert!(
        body.contains(&format!("vgpu_up{{cache=\"{}\"}} 1\n", path.display())),
        "{body}"
    );
}

#[test]
fn status_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let (_dir, path) = fresh_table("vgpu-status");
    let mut cmd = vgpu();
    cmd.args(["status", "--cache", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    drop(child.stdout.take()); // the reader is gone before vgpu writes (`vgpu status | true`)
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let status = wait_bounded(&mut child, Duration::from_secs(10));
    // Another test thread forking at that moment holds a copy of the read end until its
    // child execs; then the write succeeds and vgpu exits 0. Either way it must be quiet.
    assert!(
        status.signal() == Some(libc::SIGPIPE) || status.success(),
        "{status:?}: {stderr}"
    );
    assert!(stderr.is_empty(), "no panic message: {stderr}");
}

#[test]
fn a_file_written_by_hami_core_is_shown_read_only() {
    // A HAMi-core 1.2 file (no vgpu extension), as HAMi-core writes it.
    let snap = TableSnapshot {
        devices: vec![DeviceSnapshot {
            index: 0,
            uuid: "GPU-hami".into(),
            limit: Some(2 * GIB),
            sm_limit: None,
            used: 700 * MIB,
            context: 0,
            module: 0,
            data: 700 * MIB,
            host: 0,
            host_policy: Default::default(),
            oom_refusals: 0,
        }],
        processes: vec![ProcessSnapshot {
            slot: 0,
            hami_index: 0,
            pid: 77,
            hostpid: 0,
            start_time: 0,
            alive: true,
            suspended: false,
            swapped_out: false,
            kept_host: None,
            devices: vec![ProcessDeviceUsage {
                data: 700 * MIB,
                ..ProcessDeviceUsage::default()
            }],
        }],
        proc_num: 1,
        priority: 0,
        recent_kernel: 0,
        utilization_switch: 0,
        last_kernel_time: 0,
        kept_host: None,
    };
    let b = snap.to_hami_core_image();
    let dir = TempDir::new("vgpu-hami").unwrap();
    let path = dir.path().join("hami.cache");
    std::fs::write(&path, &b).unwrap();
    let v = status_json(&path);
    assert_eq!(v["devices"][0]["uuid"], "GPU-hami");
    assert_eq!(v["devices"][0]["memory_limit_bytes"], 2 * GIB);
    assert_eq!(v["devices"][0]["memory_used_bytes"], 700 * MIB);
    assert_eq!(v["processes"][0]["pid"], 77);
    assert_eq!(v["processes"][0]["state"], "running");
    // Changing it is refused: vgpu writes only its own format.
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["set-limit", "--memory", "1g"], &path);
    assert_fails(&run(cmd), 1, &["created by HAMi-core"]);
    assert_eq!(std::fs::read(&path).unwrap(), b, "the file is untouched");
}

#[test]
fn watch_on_a_terminal_clears_and_redraws() {
    let (_dir, path) = fresh_table("vgpu-watch");
    let text = watch_on_a_pty(&path, &["--interval", "10ms", "--count", "2"], &[]);
    assert_eq!(text.matches("\x1b[H\x1b[2J").count(), 2, "{text:?}");
    assert!(text.contains("refresh 2"), "{text:?}");
    // On a terminal (and only there) it says how to stop.
    assert!(text.contains("Ctrl-C to stop"), "{text:?}");
}

/// Before issue 14 the frame wrapped at 80 columns (the UUID column), showed a raw Unix
/// timestamp and said "Ctrl-C" into a pipe.
#[test]
fn watch_fits_80_columns_with_local_time_and_no_terminal_hints_in_a_pipe() {
    let (_dir, path) = fresh_table("vgpu-watch");
    let _h = Helper::start(&path, &format!("0:data:{}", 1000 * MIB));
    let mut cmd = vgpu();
    cmd.env("TZ", "UTC")
        .args(["watch", "--cache", path.to_str().unwrap()]);
    let out = run(cmd);
    out.assert_success();
    for line in out.stdout.lines() {
        assert!(
            line.chars().count() <= 80,
            "wider than 80 columns: {line:?}"
        );
    }
    out.assert_stdout_has(&["GPU-aaaaaaaa-0000-0000-0000-000000000000"]);
    let first = out.stdout.lines().next().unwrap();
    assert!(
        first.contains(" UTC ") && !first.contains("unix"),
        "{first}"
    );
    assert!(
        !out.stdout.contains("Ctrl-C") && !out.stdout.contains('\x1b'),
        "{}",
        out.stdout
    );
    // 1000 MiB of 1 GiB is near the limit: shown, but as plain text in a pipe.
    out.assert_stdout_has(&["97%"]);
}

/// `vgpu watch ARGS --cache PATH` on a pseudo-terminal with `env` (and no inherited
/// `NO_COLOR`); what it wrote.
fn watch_on_a_pty(path: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    use std::os::fd::{FromRawFd, OwnedFd};
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two descriptors into the out-pointers; name/termios/winsize unused.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: both descriptors were just returned by openpty and are owned here.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut cmd = vgpu();
    cmd.env_remove("NO_COLOR")
        .envs(env.iter().copied())
        .arg("watch")
        .args(args)
        .args(["--cache", path.to_str().unwrap()])
        .stdout(Stdio::from(slave))
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let status = wait_bounded(&mut child, Duration::from_secs(10));
    drop(cmd); // closes our copy of the slave, so reading the master ends
    assert_eq!(status.code(), Some(0));
    let mut out = Vec::new();
    let mut master = std::fs::File::from(master);
    let mut buf = [0u8; 4096];
    // Reading a pty master whose slave is closed ends with EIO, not 0.
    while let Ok(n) = std::io::Read::read(&mut master, &mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn watch_highlights_a_device_near_its_limit_on_a_terminal_only() {
    let (_dir, path) = fresh_table("vgpu-watch");
    let _h = Helper::start(&path, &format!("0:data:{}", 1000 * MIB));
    let yellow_bold = "\x1b[1m\x1b[33m";
    let text = watch_on_a_pty(&path, &["--count", "1"], &[]);
    let device_line = text
        .lines()
        .find(|l| l.contains("1000 MiB / 1 GiB"))
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(device_line.contains(yellow_bold), "{device_line:?}");
    // NO_COLOR: the same frame without colour (the screen is still cleared).
    let text = watch_on_a_pty(&path, &["--count", "1"], &[("NO_COLOR", "1")]);
    assert!(text.contains("1000 MiB / 1 GiB"), "{text:?}");
    assert!(!text.contains(yellow_bold), "{text:?}");
}

/// A usage file where HAMi's device plugin puts it: a path longer than a terminal is wide.
fn hami_path(dir: &TempDir) -> std::path::PathBuf {
    let uid = "0b6d0a7e-3c1f-4f7e-9a51-2d3c4b5a6f70";
    let ctr = dir
        .path()
        .join(format!("containers/{uid}_trainer-with-a-long-name"));
    std::fs::create_dir_all(&ctr).unwrap();
    ctr.join("GPU-aaaaaaaa-0000-0000-0000-000000000000.cache")
}

/// `watch` keeps 80 columns with a long path, and breaks lines only between words and after
/// a `/`, never inside a name (the terminal used to wrap the path mid-word).
#[test]
fn watch_wraps_long_paths_and_messages_between_words() {
    let dir = TempDir::new("vgpu-watch-long").unwrap();
    let path = hami_path(&dir);
    // Missing: the frame is the error, which names the path.
    let mut cmd = vgpu();
    cmd.args(["watch", "--cache", path.to_str().unwrap()]);
    let missing = run(cmd);
    missing.assert_success();
    let init = TableInit {
        uuids: vec!["GPU-aaaaaaaa-0000-0000-0000-000000000000".into()],
        memory_limits: vec![Some(GIB)],
        sm_limits: vec![None],
        priority: 1,
    };
    drop(UsageTable::open_or_create(&path, &init).unwrap());
    let mut cmd = vgpu();
    cmd.args(["watch", "--cache", path.to_str().unwrap()]);
    let present = run(cmd);
    present.assert_success();
    for out in [&missing, &present] {
        for line in out.stdout.lines() {
            assert!(line.chars().count() <= 80, "{line:?} in\n{}", out.stdout);
        }
        // Rejoined, the lines give back the path, and no name in it was cut.
        let joined: String = out.stdout.lines().map(str::trim).collect();
        assert!(joined.contains(path.to_str().unwrap()), "{}", out.stdout);
        for name in path.to_str().unwrap().split('/').filter(|n| !n.is_empty()) {
            assert!(
                out.stdout.lines().any(|l| l.contains(name)),
                "{name} is cut across lines:\n{}",
                out.stdout
            );
        }
    }
    // The error's words are those `status` prints on one line.
    let mut cmd = vgpu();
    cmd.args([
        "status",
        "--cache",
        path.with_extension("none").to_str().unwrap(),
    ]);
    let status = run(cmd);
    let mut cmd = vgpu();
    cmd.args([
        "watch",
        "--cache",
        path.with_extension("none").to_str().unwrap(),
    ]);
    let watch = run(cmd);
    let message = status.stderr.trim().trim_start_matches("vgpu: error: ");
    let body: String = watch
        .stdout
        .lines()
        .skip(1)
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        body.replace("/ ", "/").contains(message),
        "{message:?} not in {body:?}"
    );
}
