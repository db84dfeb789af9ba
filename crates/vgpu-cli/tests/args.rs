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
        "swap-out",
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
    // The stand-in CUDA program the README and the guides run is a command like the others.
    assert!(out.stdout.contains("\n  workload"), "{}", out.stdout);
    assert!(
        !out.stdout.contains("job-cleanup"),
        "the internal cleanup is hidden"
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

/// A flag no subcommand knows, before `--`, is bad usage in every subcommand: `run` used to
/// take it for the program (`vgpu run --mem 1g -- prog` ran `--mem`, exit 127).
#[test]
fn an_unknown_flag_before_the_command_is_a_usage_error_everywhere() {
    assert_fails(
        &vgpu_args(&["run", "--mem", "1g", "--", "true"]),
        2,
        &["--mem", "--memory"],
    );
    assert_fails(&vgpu_args(&["run", "-x", "--", "true"]), 2, &["-x"]);
    for sub in [
        "run",
        "status",
        "watch",
        "set-limit",
        "swap-out",
        "exporter",
        "doctor",
        "demo",
        "workload",
        "job-cleanup",
    ] {
        let out = vgpu_args(&[sub, "--no-such-flag", "--", "true"]);
        assert_fails(&out, 2, &["--no-such-flag"]);
    }
}

/// What follows the program (or `--`) is the program's, flags included.
#[test]
fn the_programs_own_flags_pass_through() {
    let dir = TempDir::new("vgpu-args").unwrap();
    let lib = dir.path().join("libvgpu.so");
    std::fs::write(&lib, b"").unwrap();
    let lib = lib.to_str().unwrap();
    for args in [
        &["--", "prog", "--mem", "1g"][..],
        &["prog", "--mem", "1g"],
        &["--", "--prog", "-x"],
    ] {
        let out = vgpu_args(&[&["run", "--dry-run", "--lib", lib], args].concat());
        out.assert_success();
        let last = args.last().unwrap();
        assert!(out.stdout.contains(last), "{args:?}: {}", out.stdout);
    }
}

/// `vgpu workload` says what its script may hold, and its exit code says whether every
/// command succeeded (it gave 0 whatever failed).
#[test]
fn workload_documents_its_commands_and_fails_when_one_fails() {
    let help = vgpu_args(&["workload", "--help"]);
    help.assert_success();
    for command in [
        "init",
        "count",
        "total",
        "info",
        "alloc SIZE",
        "free ID",
        "sleep MS",
        "pid",
        "quit",
    ] {
        help.assert_stdout_has(&[command]);
    }
    let ok = vgpu_args(&["workload", "--script", "pid;sleep 1"]);
    ok.assert_success();
    ok.assert_stdout_has(&["ok pid", "ok sleep"]);
    // A failed command: the rest still run, then exit 1.
    let failed = vgpu_args(&["workload", "--script", "pid;frobnicate;sleep 1"]);
    assert_eq!(failed.code(), Some(1), "{failed:?}");
    failed.assert_stdout_has(&["ok pid", "err syntax", "ok sleep"]);
    // `quit` ends the script there, successfully when nothing failed before it.
    let quit = vgpu_args(&["workload", "--script", "pid;quit;frobnicate"]);
    quit.assert_success();
    // Commands on stdin count the same way.
    let mut cmd = vgpu();
    cmd.arg("workload");
    let out = run_with_stdin(cmd, b"pid\nfree 7\n");
    assert_eq!(out.code(), Some(1), "{out:?}");
    out.assert_stdout_has(&["err free"]);
}

#[test]
fn bad_limit_values_are_refused_with_the_reason() {
    // (arguments, what stderr must name): each a usage error, exit 2.
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["run", "--memory", "4x", "--", "true"],
            &["'4x'", "not a size"],
        ),
        (&["run", "--memory", "0x10", "--", "true"], &["not a size"]),
        (&["run", "--memory", "1.5", "--", "true"], &["fraction"]),
        (
            &["run", "--memory", "16=1g", "--", "true"],
            &["out of range"],
        ),
        (
            &["run", "--memory", "a=1g", "--", "true"],
            &["not a device index"],
        ),
        (&["run", "--sm", "101", "--", "true"], &["percentage"]),
        (&["run", "--sm", "50g", "--", "true"], &["percentage"]),
        (&["run", "--memory", "1g"], &["COMMAND"]),
        (&["set-limit", "--memory=-1"], &["not a size"]),
        (&["set-limit", "--sm", "200"], &["percentage"]),
        (&["set-limit", "--device", "16", "--sm", "20"], &["16"]),
        (&["set-limit", "--cache", "/x"], &["--memory", "--sm"]),
        (&["swap-out", "--cache", "/x", "--share", "y"], &["--share"]),
        (&["watch", "--interval", "1h"], &["unknown unit"]),
        (&["watch", "--interval", "0"], &["out of range"]),
        (&["watch", "--count", "x"], &["--count"]),
        (&["demo", "--memory", "0"], &["more than 0"]),
        (&["demo", "--driver", "quantum"], &["quantum"]),
    ];
    for (args, needles) in cases {
        assert_fails(&vgpu_args(args), 2, needles);
    }
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
    // (arguments, what stderr must name): each a usage error, exit 2.
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["run", "--share", "../x", "--", "true"],
            &["not a group name"],
        ),
        (
            &[
                "run",
                "--share",
                "a",
                "--cache",
                "/tmp/x.cache",
                "--",
                "true",
            ],
            &["--share", "--cache"],
        ),
        (&["run", "--all-users", "--", "true"], &["--cache"]),
        (
            &["status", "--share", "a", "--cache", "/tmp/x.cache"],
            &["--share"],
        ),
        (&["run", "--driver", "quantum", "--", "true"], &["quantum"]),
    ];
    for (args, needles) in cases {
        assert_fails(&vgpu_args(args), 2, needles);
    }
}
