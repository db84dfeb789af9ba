//! Why deploy/ never rewrites a library in place: a process that maps a shared library keeps
//! running when a new version is renamed over it (deploy/common/vgpu-install-lib.sh, what our
//! images run at postStart), and dies of a signal when the file is rewritten in place with
//! `cp` (same inode), as HAMi's vgpu-init.sh and Volcano's `cp -f` do. docs/kubernetes.md.

mod common;
use common::*;

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use vgpu_testkit::compile_c;

/// Version 1: a small library. Version 2: the same entry points behind 64 KiB of other code,
/// so its `work` lies where version 1's file has already ended.
const LIB_V1: &str = r#"
int lib_version(void) { return 1; }
int work(int x) { return x * 3 + 1; }
"#;
const LIB_V2: &str = r#"
__attribute__((used)) static void padding(void) { __asm__ volatile(".fill 65536, 1, 0x90"); }
int lib_version(void) { return 2; }
int work(int x) { return x * 3 + 2; }
"#;
/// Maps the library, calls into it forever, and says so every few thousand calls.
const VICTIM: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    int (*version)(void) = (int (*)(void))dlsym(h, "lib_version");
    int (*work)(int) = (int (*)(int))dlsym(h, "work");
    if (!version || !work) return 3;
    printf("version %d\n", version());
    fflush(stdout);
    volatile int acc = 0;
    for (unsigned long i = 1;; i++) {
        acc = work(acc);
        if (i % 4096 == 0) { printf("alive %lu\n", i); fflush(stdout); usleep(1000); }
    }
}
"#;

/// A victim process and the lines it prints.
struct Victim {
    child: Reaped,
    lines: Receiver<String>,
}

impl Victim {
    fn start(exe: &Path, lib: &Path) -> Self {
        let mut child = Command::new(exe)
            .arg(lib)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let lines = stdout_lines(&mut child);
        Victim {
            child: Reaped(child),
            lines,
        }
    }

    fn line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(10))
            .expect("the victim prints")
    }

    /// Still running, and still calling into the library.
    fn keeps_running(&mut self) -> bool {
        // Drain what it printed so far, then see a fresh line.
        while self.lines.try_recv().is_ok() {}
        std::thread::sleep(Duration::from_millis(200));
        self.child.0.try_wait().unwrap().is_none()
            && self
                .lines
                .recv_timeout(Duration::from_secs(5))
                .is_ok_and(|l| l.starts_with("alive "))
    }
}

/// A fresh directory with both library versions and the victim program compiled into it.
fn built(tag: &str) -> (TempDir, [PathBuf; 3]) {
    let dir = TempDir::new(tag).unwrap();
    let d = dir.path();
    let v1 = compile_c(d, "libv1.so", LIB_V1, ["-shared", "-fPIC", "-O1"]);
    let v2 = compile_c(d, "libv2.so", LIB_V2, ["-shared", "-fPIC", "-O1"]);
    let victim = compile_c(d, "victim", VICTIM, ["-O1"]);
    (dir, [v1, v2, victim])
}

fn installer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/common/vgpu-install-lib.sh")
}

/// Runs `deploy/common/vgpu-install-lib.sh` as a postStart does (through its `#!` line) with
/// `args`, under `VGPU_SOURCE_DIR=source` where given and `VGPU_TURN_DIR=<dest>/../vgpulock`
/// (never the host's /tmp/vgpulock); it must succeed.
fn install_lib_sh(args: &[&Path], source: Option<&Path>) {
    let mut cmd = Command::new(installer());
    cmd.args(args);
    if let Some(source) = source {
        cmd.env("VGPU_SOURCE_DIR", source);
    }
    let dest = args.last().unwrap();
    cmd.env("VGPU_TURN_DIR", dest.join("../vgpulock"));
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `cp from to`, as HAMi's vgpu-init.sh and Volcano roll a library out: in place.
fn cp_in_place(from: &Path, to: &Path) {
    assert!(
        Command::new("cp")
            .arg(from)
            .arg(to)
            .status()
            .unwrap()
            .success()
    );
}

fn inode(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().ino()
}

#[test]
fn rename_into_place_keeps_running_processes_and_cp_in_place_kills_them() {
    let (dir, [v1, v2, victim]) = built("vgpu-swap");
    let d = dir.path();
    // The image's library directory (source) and the host's /usr/local/vgpu (destination).
    let image = d.join("image");
    let host = d.join("host");
    std::fs::create_dir_all(&image).unwrap();
    std::fs::create_dir_all(&host).unwrap();
    let lib = host.join("libvgpu.so");
    let install = |version: &Path| {
        std::fs::copy(version, image.join("libvgpu.so")).unwrap();
        install_lib_sh(&[&host], Some(&image));
    };

    install(&v1);
    assert_eq!(
        std::fs::read_to_string(host.join("ld.so.preload")).unwrap(),
        format!("{}/libvgpu.so\n", host.display())
    );
    assert!(
        d.join("vgpulock").is_dir(),
        "the turn directory the plugins mount"
    );
    let mut old = Victim::start(&victim, &lib);
    assert_eq!(old.line(), "version 1");
    assert!(old.keeps_running());

    // Upgrade by rename: a new inode; the running process keeps its old one and runs on.
    let before = inode(&lib);
    install(&v2);
    assert_ne!(inode(&lib), before, "renamed into place, not rewritten");
    assert!(
        old.keeps_running(),
        "a rename must not disturb a running process"
    );
    let mut new = Victim::start(&victim, &lib);
    assert_eq!(new.line(), "version 2", "new processes get the new library");
    assert!(new.keeps_running());
    // Installing the same content again changes nothing.
    let same = inode(&lib);
    install(&v2);
    assert_eq!(inode(&lib), same);

    // Roll back the way HAMi's vgpu-init.sh does (plain cp over the mapped file): same inode,
    // and the process that maps it dies of a signal.
    cp_in_place(&v1, &lib);
    assert_eq!(inode(&lib), same, "cp rewrote the file in place");
    let died = wait_bounded(&mut new.child.0, Duration::from_secs(10));
    let signal = died.signal();
    assert!(
        matches!(signal, Some(libc::SIGBUS | libc::SIGSEGV | libc::SIGILL)),
        "expected death by SIGBUS/SIGSEGV/SIGILL, got {died:?}"
    );
    eprintln!("in-place overwrite killed the mapping process with signal {signal:?}");
    // The first process maps the first inode, which nothing rewrote.
    assert!(old.keeps_running());
}

#[test]
fn detaching_first_makes_an_in_place_rollback_harmless() {
    let (dir, [v1, v2, victim]) = built("vgpu-detach");
    let d = dir.path();
    let host = d.join("host");
    std::fs::create_dir_all(&host).unwrap();
    let lib = host.join("libvgpu.so.v2.10.0");
    std::fs::copy(&v2, &lib).unwrap();
    let mut running = Victim::start(&victim, &lib);
    assert_eq!(running.line(), "version 2");
    // The documented rollback: detach on the node, then the stock plugin's in-place cp.
    let before = inode(&lib);
    install_lib_sh(&[Path::new("--detach"), &host], None);
    assert_ne!(inode(&lib), before, "a fresh inode");
    assert_eq!(std::fs::read(&lib).unwrap(), std::fs::read(&v2).unwrap());
    cp_in_place(&v1, &lib);
    assert!(
        running.keeps_running(),
        "the rollback's cp wrote into a file nobody maps"
    );
    let mut fresh = Victim::start(&victim, &lib);
    assert_eq!(fresh.line(), "version 1");
    assert!(fresh.keeps_running());
}

#[test]
fn the_installer_can_install_then_run_the_plugin_and_refuses_a_missing_source() {
    let dir = TempDir::new("vgpu-install-exec").unwrap();
    let d = dir.path();
    let (image, host) = (d.join("image"), d.join("host"));
    std::fs::create_dir_all(&image).unwrap();
    std::fs::write(image.join("libvgpu.so"), "library v1").unwrap();
    // Volcano's image: the entrypoint installs, then becomes the plugin (run under dash here,
    // as the script is kept POSIX).
    let run = |source: &Path, tail: &[&str]| {
        let mut cmd = Command::new("sh");
        cmd.arg(installer())
            .arg(&host)
            .args(tail)
            .env("VGPU_SOURCE_DIR", source)
            .env("VGPU_TURN_DIR", d.join("vgpulock"));
        cmd.output().unwrap()
    };
    let out = run(
        &image,
        &["--", "sh", "-c", "echo plugin runs with $0 $1", "a", "b"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.ends_with("plugin runs with a b\n"), "{stdout}");
    assert_eq!(
        std::fs::read(host.join("libvgpu.so")).unwrap(),
        b"library v1"
    );
    // Nothing after --, a stray argument, a source that is not there: refused, nothing run.
    for (source, tail) in [
        (image.as_path(), &["--"][..]),
        (image.as_path(), &["echo"][..]),
        (d.join("nonexistent").as_path(), &["--", "echo", "ran"][..]),
    ] {
        let out = run(source, tail);
        assert!(!out.status.success(), "{tail:?}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("ran"));
    }
}
