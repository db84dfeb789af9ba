//! Every subcommand answers --help, and bad input gets a clear message and a non-zero exit.

mod common;
use common::*;

fn vgpu_args(args: &[&str]) -> Output {
    let mut cmd = vgpu();
    cmd.args(args);
    run(cmd)
}

#[test]
fn help_describes_every_subcommand() {
    let out = vgpu_args(&["--help"]);
    assert_eq!(out.code(), Some(0));
    for sub in [
        "run",
        "status",
        "watch",
        "set-limit",
        "exporter",
        "doctor",
        "demo",
    ] {
        assert!(out.stdout.contains(sub), "top-level help lacks {sub}");
        let h = vgpu_args(&[sub, "--help"]);
        assert_eq!(h.code(), Some(0), "{sub} --help: {}", h.stderr);
        assert!(
            h.stdout.contains("Usage: vgpu"),
            "{sub} --help:\n{}",
            h.stdout
        );
    }
    assert!(
        !out.stdout.contains("\n  workload"),
        "the internal workload is hidden"
    );
    let v = vgpu_args(&["--version"]);
    assert_eq!(v.code(), Some(0));
    assert!(v.stdout.starts_with("vgpu "));
}

#[test]
fn unknown_subcommand_and_flag_are_usage_errors() {
    assert_fails(&vgpu_args(&[]), 2, &["Usage"]);
    assert_fails(&vgpu_args(&["frobnicate"]), 2, &["frobnicate"]);
    assert_fails(&vgpu_args(&["status", "--bogus"]), 2, &["--bogus"]);
}

#[test]
fn bad_limit_values_are_refused_with_the_reason() {
    assert_fails(
        &vgpu_args(&["run", "--memory", "4x", "--", "true"]),
        2,
        &["'4x'", "not a size"],
    );
    assert_fails(
        &vgpu_args(&["run", "--memory", "0x10", "--", "true"]),
        2,
        &["not a size"],
    );
    assert_fails(
        &vgpu_args(&["run", "--memory", "1.5", "--", "true"]),
        2,
        &["fraction"],
    );
    assert_fails(
        &vgpu_args(&["run", "--memory", "16=1g", "--", "true"]),
        2,
        &["out of range"],
    );
    assert_fails(
        &vgpu_args(&["run", "--memory", "a=1g", "--", "true"]),
        2,
        &["not a device index"],
    );
    assert_fails(
        &vgpu_args(&["run", "--sm", "101", "--", "true"]),
        2,
        &["percentage"],
    );
    assert_fails(
        &vgpu_args(&["run", "--sm", "50g", "--", "true"]),
        2,
        &["percentage"],
    );
    assert_fails(&vgpu_args(&["run", "--memory", "1g"]), 2, &["COMMAND"]);
    assert_fails(
        &vgpu_args(&["set-limit", "--memory=-1"]),
        2,
        &["not a size"],
    );
    assert_fails(
        &vgpu_args(&["set-limit", "--sm", "200"]),
        2,
        &["percentage"],
    );
    assert_fails(
        &vgpu_args(&["set-limit", "--device", "16", "--sm", "20"]),
        2,
        &["16"],
    );
    assert_fails(
        &vgpu_args(&["set-limit", "--cache", "/x"]),
        2,
        &["--memory", "--sm"],
    );
    assert_fails(
        &vgpu_args(&["watch", "--interval", "1h"]),
        2,
        &["unknown unit"],
    );
    assert_fails(
        &vgpu_args(&["watch", "--interval", "0"]),
        2,
        &["out of range"],
    );
    assert_fails(&vgpu_args(&["watch", "--count", "x"]), 2, &["--count"]);
    assert_fails(&vgpu_args(&["demo", "--memory", "0"]), 2, &["more than 0"]);
    assert_fails(
        &vgpu_args(&["demo", "--driver", "quantum"]),
        2,
        &["quantum"],
    );
}

/// A duplicate is bad usage (exit 2, as docs/cli.md says); it gave 1 before.
#[test]
fn duplicate_limits_are_refused() {
    let dir = TempDir::new("vgpu-args").unwrap();
    let lib = dir.path().join("libvgpu.so");
    std::fs::write(&lib, b"").unwrap();
    let lib = lib.to_str().unwrap();
    let out = vgpu_args(&[
        "run", "--lib", lib, "--memory", "1=1g", "--memory", "1=2g", "--", "true",
    ]);
    assert_fails(&out, 2, &["more than once for device 1"]);
    let out = vgpu_args(&[
        "run", "--lib", lib, "--sm", "10", "--sm", "20", "--", "true",
    ]);
    assert_fails(&out, 2, &["--sm without a device is given more than once"]);
}

#[test]
fn share_names_and_conflicting_tables_are_usage_errors() {
    assert_fails(
        &vgpu_args(&["run", "--share", "../x", "--", "true"]),
        2,
        &["not a group name"],
    );
    assert_fails(
        &vgpu_args(&[
            "run",
            "--share",
            "a",
            "--cache",
            "/tmp/x.cache",
            "--",
            "true",
        ]),
        2,
        &["--share", "--cache"],
    );
    assert_fails(
        &vgpu_args(&["run", "--all-users", "--", "true"]),
        2,
        &["--cache"],
    );
    assert_fails(
        &vgpu_args(&["status", "--share", "a", "--cache", "/tmp/x.cache"]),
        2,
        &["--share"],
    );
    assert_fails(
        &vgpu_args(&["run", "--driver", "quantum", "--", "true"]),
        2,
        &["quantum"],
    );
}
