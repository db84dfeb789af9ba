//! `vgpu run`: the environment the program gets, the preload kept, and a real exec.
//!
//! These use a stand-in `libvgpu.so` (an empty file: the loader warns and ignores it), so
//! they check exactly what `run` controls without depending on the hook.

mod common;
use common::*;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;

/// A fresh directory holding the stand-in `libvgpu.so`, and that library's canonical path.
fn fake_lib() -> (TempDir, String) {
    let dir = TempDir::new("vgpu-run").unwrap();
    let lib = dir.path().join("libvgpu.so");
    std::fs::write(&lib, b"").unwrap();
    let lib = lib.canonicalize().unwrap().to_str().unwrap().to_owned();
    (dir, lib)
}

/// Run `sh -c script` under `vgpu run ARGS`, returning stdout lines. Runs in a fresh
/// directory with its own `TMPDIR`, since `run` creates the usage file it is given and the
/// per-user table directory.
fn run_sh(lib: &str, args: &[&str], env: &[(&str, &str)], script: &str) -> Output {
    let work = Path::new(lib).parent().unwrap().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut cmd = vgpu();
    cmd.current_dir(&work).env("TMPDIR", &work);
    cmd.arg("run")
        .arg("--lib")
        .arg(lib)
        .args(args)
        .args(["--", "sh", "-c", script]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(cmd)
}

#[test]
fn limits_become_canonical_hami_variables() {
    let (dir, lib) = fake_lib();
    let out = run_sh(
        &lib,
        &[
            "--memory",
            "4g",
            "--memory",
            "1=1.5g",
            "--sm",
            "50",
            "--sm",
            "2=30",
            "--cache",
            "rel.cache",
        ],
        &[],
        "echo $CUDA_DEVICE_MEMORY_LIMIT $CUDA_DEVICE_MEMORY_LIMIT_1 $CUDA_DEVICE_SM_LIMIT $CUDA_DEVICE_SM_LIMIT_2; \
         echo $CUDA_DEVICE_MEMORY_SHARED_CACHE",
    );
    out.assert_success();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "4294967296 1610612736 50 30");
    // The cache path is made absolute, so the program finds it whatever its working directory.
    let cwd = dir.path().canonicalize().unwrap().join("work");
    assert_eq!(lines[1], cwd.join("rel.cache").to_str().unwrap());
}

#[test]
fn existing_preload_is_kept_after_the_hook() {
    let (dir, lib) = fake_lib();
    let other = dir.path().join("libother.so");
    std::fs::write(&other, b"").unwrap();
    let other = other.to_str().unwrap();
    let out = run_sh(
        &lib,
        &["--memory", "1g"],
        &[("LD_PRELOAD", other)],
        "echo $LD_PRELOAD",
    );
    out.assert_success();
    assert_eq!(out.stdout.trim(), format!("{lib}:{other}"));
    // Running vgpu run inside vgpu run does not preload the hook twice.
    let out = run_sh(
        &lib,
        &[],
        &[("LD_PRELOAD", &format!("{lib}:{other}"))],
        "echo $LD_PRELOAD",
    );
    assert_eq!(out.stdout.trim(), format!("{lib}:{other}"));
}

#[test]
fn flags_replace_inherited_limits_of_their_kind_only() {
    let (_dir, lib) = fake_lib();
    let env = [
        ("CUDA_DEVICE_MEMORY_LIMIT_3", "2g"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "8g"),
        ("CUDA_DEVICE_SM_LIMIT", "20"),
    ];
    let out = run_sh(
        &lib,
        &["--memory", "1g"],
        &env,
        "echo ${CUDA_DEVICE_MEMORY_LIMIT_3:-unset} $CUDA_DEVICE_MEMORY_LIMIT $CUDA_DEVICE_SM_LIMIT",
    );
    out.assert_success();
    assert_eq!(out.stdout.trim(), "unset 1073741824 20");
    // Without flags the inherited configuration passes through untouched.
    let out = run_sh(
        &lib,
        &[],
        &env,
        "echo $CUDA_DEVICE_MEMORY_LIMIT_3 $CUDA_DEVICE_MEMORY_LIMIT",
    );
    assert_eq!(out.stdout.trim(), "2g 8g");
}

#[test]
fn an_inherited_bad_value_is_refused_before_the_program_starts() {
    let (_dir, lib) = fake_lib();
    let out = run_sh(
        &lib,
        &[],
        &[("CUDA_DEVICE_MEMORY_LIMIT", "4gx")],
        "echo ran",
    );
    assert_fails(&out, 1, &["CUDA_DEVICE_MEMORY_LIMIT", "4gx"]);
    assert!(!out.stdout.contains("ran"));
    let out = run_sh(&lib, &[], &[("LIBCUDA_LOG_LEVEL", "9")], "echo ran");
    assert_fails(&out, 1, &["LIBCUDA_LOG_LEVEL"]);
}

#[test]
fn exec_hands_over_pid_exit_code_and_signals() {
    let (dir, lib) = fake_lib();
    let mut cmd = vgpu();
    // Its own TMPDIR: the job's private table goes in `$TMPDIR/vgpu-<uid>`, never the host's.
    cmd.env("TMPDIR", dir.path())
        .args(["run", "--lib", &lib, "--", "sh", "-c", "echo $$; exit 7"]);
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let child = cmd.spawn().unwrap();
    let pid = child.id();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(7));
    // The program runs as the very process vgpu was: exec, not a child.
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), pid.to_string());
    let out = run_sh(&lib, &[], &[], "kill -TERM $$");
    assert_eq!(out.status.signal(), Some(libc::SIGTERM));
}

#[test]
fn missing_program_and_library_are_clear_errors() {
    let (dir, lib) = fake_lib();
    let mut cmd = vgpu();
    cmd.env("TMPDIR", dir.path())
        .args(["run", "--lib", &lib, "--", "/nonexistent/program"]);
    assert_fails(&run(cmd), 127, &["cannot run `/nonexistent/program`"]);
    let mut cmd = vgpu();
    cmd.args(["run", "--lib", "/nonexistent/libvgpu.so", "--", "true"]);
    assert_fails(
        &run(cmd),
        1,
        &["--lib", "/nonexistent/libvgpu.so", "not found"],
    );
    let mut cmd = vgpu();
    cmd.env("VGPU_LIB", "/nonexistent/libvgpu.so")
        .args(["run", "--", "true"]);
    assert_fails(&run(cmd), 1, &["$VGPU_LIB", "not found"]);
    // (the usage file asked for, what the error says)
    for (cache, says) in [
        (dir.path().to_str().unwrap(), "is a directory"),
        (
            "/nonexistent/dir/x.cache",
            "/nonexistent/dir does not exist",
        ),
    ] {
        let mut cmd = vgpu();
        cmd.args(["run", "--lib", &lib, "--cache", cache, "--", "true"]);
        assert_fails(&run(cmd), 1, &[says]);
    }
}

#[test]
fn dry_run_prints_the_environment_and_command() {
    let (_dir, lib) = fake_lib();
    let mut cmd = vgpu();
    cmd.args([
        "run",
        "--lib",
        &lib,
        "--memory",
        "512Mi",
        "--dry-run",
        "--",
        "echo",
        "a b",
    ]);
    let out = run(cmd);
    out.assert_success();
    out.assert_stdout_has(&["CUDA_DEVICE_MEMORY_LIMIT=536870912\n"]);
    out.assert_stdout_has(&[&format!("LD_PRELOAD={lib}\n")]);
    assert!(out.stdout.ends_with("exec echo 'a b'\n"), "{}", out.stdout);
}

#[test]
fn the_hook_is_found_next_to_the_binary_or_through_vgpu_lib() {
    let (dir, lib) = fake_lib();
    let mut cmd = vgpu();
    cmd.env("VGPU_LIB", &lib)
        .args(["run", "--dry-run", "--", "true"]);
    let out = run(cmd);
    assert!(
        out.stdout.contains(&format!("LD_PRELOAD={lib}\n")),
        "{}{}",
        out.stdout,
        out.stderr
    );
    // A copy of vgpu with no library anywhere near it says where it looked.
    let copy = dir.path().join("bin");
    std::fs::create_dir(&copy).unwrap();
    std::fs::copy(vgpu_exe(), copy.join("vgpu")).unwrap();
    let mut cmd = std::process::Command::new(copy.join("vgpu"));
    vgpu_testkit::clear_runner_settings(&mut cmd).args(["run", "--", "true"]);
    let out = run(cmd);
    if std::path::Path::new("/usr/local/vgpu/libvgpu.so").exists() {
        eprintln!(
            "SKIP (part): this host has /usr/local/vgpu/libvgpu.so, where vgpu looks last, so \
             the copy finds it: the not-found message was not checked"
        );
    } else {
        assert_fails(
            &out,
            1,
            &[
                "libvgpu.so not found",
                "bin/libvgpu.so",
                "/usr/local/vgpu/libvgpu.so",
                "hint",
            ],
        );
    }
    // Placed next to the copy, it is found there.
    std::fs::copy(&lib, copy.join("libvgpu.so")).unwrap();
    let mut cmd = std::process::Command::new(copy.join("vgpu"));
    vgpu_testkit::clear_runner_settings(&mut cmd).args(["run", "--dry-run", "--", "true"]);
    let out = run(cmd);
    let want = copy.join("libvgpu.so").canonicalize().unwrap();
    assert!(
        out.stdout
            .contains(&format!("LD_PRELOAD={}\n", want.display())),
        "{}{}",
        out.stdout,
        out.stderr
    );
}

#[test]
fn dry_run_says_a_private_table_is_made_at_run_time_and_creates_nothing() {
    let (dir, lib) = fake_lib();
    let out = run_sh(&lib, &["--dry-run", "--driver", "simulated"], &[], "true");
    out.assert_success();
    out.assert_stdout_has(&["# CUDA_DEVICE_MEMORY_SHARED_CACHE: a private usage table"]);
    assert!(
        out.stdout
            .contains("# LD_LIBRARY_PATH: the simulated driver")
    );
    assert!(!out.stdout.contains("CUDA_DEVICE_MEMORY_SHARED_CACHE="));
    let work = dir.path().join("work");
    assert!(
        std::fs::read_dir(&work).unwrap().next().is_none(),
        "dry run created something in {}",
        work.display()
    );
    // --share names the group's file in the per-user directory.
    let out = run_sh(&lib, &["--dry-run", "--share", "team"], &[], "true");
    out.assert_success();
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let want = format!(
        "CUDA_DEVICE_MEMORY_SHARED_CACHE={}/vgpu-{uid}/team.cache\n",
        work.display()
    );
    out.assert_stdout_has(&[&want]);
}
