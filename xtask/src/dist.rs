//! `cargo xtask dist`: the release tarball.
//!
//! What it ships (one layout, [`LAYOUT`], also what the Dockerfiles under `deploy/` copy
//! from, checked by `deploy-check`):
//!
//! ```text
//! vgpu-<version>-x86_64-linux-gnu/
//!   bin/vgpu                      the CLI (doctor, status, exporter, ...), stripped
//!   lib/libvgpu.so.<version>      the hook, stripped (what containers map)
//!   lib/libvgpu.so -> libvgpu.so.<version>
//!   lib/libvgpusim.so             the simulated driver (vgpu run/demo without a GPU)
//!   share/vgpu/vgpu-install-lib.sh  rename-into-place installer (deploy/common)
//!   share/vgpu/vgpu-image         builds the plugins' images without Docker (deploy/image)
//!   LICENSE
//!   SHA256SUMS                    of every file above
//! vgpu-<version>-x86_64-linux-gnu.tar.gz
//! vgpu-<version>-x86_64-linux-gnu.tar.gz.sha256
//! ```
//!
//! The release build needs cargo-zigbuild and zig (glibc 2.17 symbols whatever the build
//! host's glibc); nothing is installed unless `--install-tools` asks, and then only into
//! `target/dist-tools/` at the versions pinned here. `--native` builds with the host's linker
//! instead (no glibc floor: for trying the packaging; the tarball says `native`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cargo, run, target_dir, workspace_root};

/// The oldest glibc the shipped library may need: containers as old as CentOS 7 must load it.
pub const DIST_GLIBC: (u32, u32) = (2, 17);
/// The one target shipped.
pub const DIST_TARGET: &str = "x86_64-unknown-linux-gnu";
/// The release version: the workspace's.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// cargo-zigbuild, from crates.io, installed by `--install-tools` only.
pub const CARGO_ZIGBUILD_VERSION: &str = "0.24.1";
/// zig, from PyPI's `ziglang` wheel, installed by `--install-tools` only.
pub const ZIGLANG_VERSION: &str = "0.14.1";
/// Host tools the packaging uses (binutils, GNU tar, gzip, coreutils).
const HOST_TOOLS: &[(&str, &str)] = &[
    ("readelf", "binutils"),
    ("strip", "binutils"),
    ("tar", "tar"),
    ("gzip", "gzip"),
    ("sha256sum", "coreutils"),
];

/// One file of the release: where it lies in the tree, and where it comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A build output of this name (in `target/<triple>/release/`).
    Built(&'static str),
    /// A file of the repository, relative to its root.
    Repo(&'static str),
    /// A symbolic link to this name, in the same directory.
    Link(&'static str),
}

/// Whether a file is stripped of symbols and debug information when packaged.
pub type Strip = bool;

/// The release tree: path inside it (`{v}` = [`VERSION`]), source, strip.
pub const LAYOUT: &[(&str, Source, Strip)] = &[
    ("bin/vgpu", Source::Built("vgpu"), true),
    ("lib/libvgpu.so.{v}", Source::Built("libvgpu.so"), true),
    ("lib/libvgpu.so", Source::Link("libvgpu.so.{v}"), false),
    ("lib/libvgpusim.so", Source::Built("libvgpusim.so"), true),
    (
        "share/vgpu/vgpu-install-lib.sh",
        Source::Repo("deploy/common/vgpu-install-lib.sh"),
        false,
    ),
    (
        "share/vgpu/vgpu-image",
        Source::Repo("deploy/image/vgpu-image"),
        false,
    ),
    ("LICENSE", Source::Repo("LICENSE"), false),
];

/// A path of [`LAYOUT`] with the version filled in.
pub fn layout_path(p: &str) -> String {
    p.replace("{v}", VERSION)
}

/// The release's name (tree and tarball stem).
pub fn release_name(native: bool) -> String {
    let arch = DIST_TARGET.split('-').next().unwrap_or("x86_64");
    let suffix = if native { "-native" } else { "" };
    format!("vgpu-{VERSION}-{arch}-linux-gnu{suffix}")
}

#[derive(Debug, Default)]
struct Flags {
    native: bool,
    install_tools: bool,
}

fn parse(args: &[String]) -> Result<Flags, String> {
    let mut f = Flags::default();
    for a in args {
        match a.as_str() {
            "--native" => f.native = true,
            "--install-tools" => f.install_tools = true,
            other => return Err(format!("dist: unknown argument `{other}`")),
        }
    }
    Ok(f)
}

fn have(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The repo-local tool directory `--install-tools` fills.
fn tools_dir() -> PathBuf {
    target_dir().join("dist-tools")
}

/// Environment that puts the repo-local tools first.
fn with_tools(cmd: &mut Command) {
    let bin = tools_dir().join("bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin];
    paths.extend(env::split_paths(&path));
    if let Ok(joined) = env::join_paths(paths) {
        cmd.env("PATH", joined);
    }
    cmd.env("PYTHONPATH", tools_dir().join("python"));
}

/// Which of the release toolchain is missing, in words with the way to get it.
fn missing_release_tools() -> Vec<String> {
    let mut missing = Vec::new();
    // `cargo zigbuild` runs `cargo-zigbuild` from PATH; its own `--version` answers.
    let mut c = Command::new("cargo-zigbuild");
    with_tools(&mut c);
    if !have(c.arg("--version")) {
        missing.push(format!(
            "cargo-zigbuild (crates.io): cargo install --locked cargo-zigbuild@{CARGO_ZIGBUILD_VERSION}"
        ));
    }
    let mut zig = Command::new("zig");
    with_tools(&mut zig);
    let mut py = Command::new("python3");
    with_tools(&mut py);
    if !have(zig.arg("version")) && !have(py.args(["-m", "ziglang", "version"])) {
        missing.push(format!(
            "zig (PyPI wheel `ziglang`, about 100 MB): python3 -m pip install ziglang=={ZIGLANG_VERSION}, or a zig {ZIGLANG_VERSION} on PATH"
        ));
    }
    missing
}

fn install_tools() -> Result<(), String> {
    let dir = tools_dir();
    eprintln!(
        "xtask: installing the pinned release tools into {} (nothing global)",
        dir.display()
    );
    let mut c = cargo();
    c.args(["install", "--locked", "--root"])
        .arg(&dir)
        .arg(format!("cargo-zigbuild@{CARGO_ZIGBUILD_VERSION}"));
    run(c)?;
    let mut p = Command::new("python3");
    p.args(["-m", "pip", "install", "--target"])
        .arg(dir.join("python"))
        .arg(format!("ziglang=={ZIGLANG_VERSION}"));
    run(p)
}

/// `cargo xtask dist [--native] [--install-tools]`.
pub fn dist(args: &[String]) -> Result<(), String> {
    let flags = parse(args)?;
    let missing_host: Vec<String> = HOST_TOOLS
        .iter()
        .filter(|(tool, _)| !have(Command::new(tool).arg("--version")))
        .map(|(tool, pkg)| format!("{tool} (Debian package {pkg}): apt-get install {pkg}"))
        .collect();
    if !missing_host.is_empty() {
        return Err(format!(
            "dist needs these host tools:\n  {}",
            missing_host.join("\n  ")
        ));
    }
    if !flags.native {
        let missing = missing_release_tools();
        if !missing.is_empty() && flags.install_tools {
            install_tools()?;
        } else if !missing.is_empty() {
            return Err(format!(
                "the release build (glibc >= {}.{} whatever this host has) needs:\n  {}\n\
                 Install them yourself, or run `cargo xtask dist --install-tools` to install \
                 exactly these versions into {} (nothing global). `cargo xtask dist --native` \
                 packages a build for this host's glibc instead.",
                DIST_GLIBC.0,
                DIST_GLIBC.1,
                missing.join("\n  "),
                tools_dir().display()
            ));
        }
    }
    let mut c = cargo();
    with_tools(&mut c);
    let target = if flags.native {
        c.arg("build");
        DIST_TARGET.to_owned()
    } else {
        c.arg("zigbuild");
        format!("{DIST_TARGET}.{}.{}", DIST_GLIBC.0, DIST_GLIBC.1)
    };
    c.args([
        "--release",
        "-p",
        "vgpu-hook",
        "-p",
        "vgpu-cli",
        "-p",
        "vgpu-sim",
        "--target",
        &target,
    ]);
    run(c)?;
    let built = target_dir().join(DIST_TARGET).join("release");
    let out = target_dir().join("dist");
    let tree = package(&built, &workspace_root(), &out, &release_name(flags.native))?;
    for (path, source, _) in LAYOUT {
        if matches!(source, Source::Built(_)) {
            let file = tree.join(layout_path(path));
            check_stripped(&file)?;
            if flags.native {
                report_glibc(&file)?;
            } else {
                check_glibc(&file)?;
            }
        }
    }
    check_exports(&tree.join(layout_path("lib/libvgpu.so.{v}")))?;
    println!(
        "dist: {} and {}.tar.gz (+ .sha256){}",
        tree.display(),
        tree.display(),
        if flags.native {
            " -- native build: no glibc floor"
        } else {
            ""
        }
    );
    Ok(())
}

fn io(what: &str, p: &Path) -> impl FnOnce(std::io::Error) -> String {
    let s = format!("{what} {}", p.display());
    move |e| format!("{s}: {e}")
}

/// Lay out the release tree `out/name/` from `built` (build outputs) and `repo`, strip what
/// [`LAYOUT`] says, write SHA256SUMS, the tarball and its `.sha256`. Returns the tree.
pub fn package(built: &Path, repo: &Path, out: &Path, name: &str) -> Result<PathBuf, String> {
    let tree = out.join(name);
    if tree.exists() {
        std::fs::remove_dir_all(&tree).map_err(io("remove", &tree))?;
    }
    for (path, source, strip) in LAYOUT {
        let dest = tree.join(layout_path(path));
        let dir = dest.parent().unwrap_or(&tree);
        std::fs::create_dir_all(dir).map_err(io("create", dir))?;
        match source {
            Source::Built(n) => {
                let src = built.join(n);
                std::fs::copy(&src, &dest).map_err(io("copy", &src))?;
            }
            Source::Repo(p) => {
                let src = repo.join(p);
                std::fs::copy(&src, &dest).map_err(io("copy", &src))?;
            }
            Source::Link(to) => {
                std::os::unix::fs::symlink(layout_path(to), &dest).map_err(io("link", &dest))?;
            }
        }
        if *strip {
            // Symbols and debug information only: the dynamic symbol table (the exports)
            // stays, which check_exports verifies on the packaged file.
            let mut c = Command::new("strip");
            c.args(["--strip-unneeded", "--remove-section=.comment"])
                .arg(&dest);
            run(c)?;
        }
    }
    let mut sums = String::new();
    for (path, source, _) in LAYOUT {
        if !matches!(source, Source::Link(_)) {
            let p = layout_path(path);
            sums.push_str(&format!("{}  {p}\n", sha256(&tree.join(&p))?));
        }
    }
    std::fs::write(tree.join("SHA256SUMS"), sums).map_err(io("write", &tree))?;
    let tar = out.join(format!("{name}.tar"));
    let gz = out.join(format!("{name}.tar.gz"));
    let _ = std::fs::remove_file(&gz);
    // Reproducible: sorted, owned by root, fixed mtime, no gzip timestamp.
    let mtime = env::var("SOURCE_DATE_EPOCH").unwrap_or_else(|_| "0".into());
    let mut c = Command::new("tar");
    c.current_dir(out)
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            &format!("--mtime=@{mtime}"),
            "-cf",
        ])
        .arg(&tar)
        .arg(name);
    run(c)?;
    let mut c = Command::new("gzip");
    c.args(["-n", "-9", "-f"]).arg(&tar);
    run(c)?;
    let line = format!("{}  {name}.tar.gz\n", sha256(&gz)?);
    std::fs::write(out.join(format!("{name}.tar.gz.sha256")), line).map_err(io("write", out))?;
    Ok(tree)
}

/// `sha256sum`'s hex digest of `file`.
pub fn sha256(file: &Path) -> Result<String, String> {
    let out = Command::new("sha256sum")
        .arg(file)
        .output()
        .map_err(|e| format!("sha256sum (coreutils): {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().next() {
        Some(h) if out.status.success() && h.len() == 64 => Ok(h.to_owned()),
        _ => Err(format!("sha256sum {} failed", file.display())),
    }
}

pub fn readelf(args: &[&str], file: &Path) -> Result<String, String> {
    let out = Command::new("readelf")
        .args(args)
        .arg(file)
        .output()
        .map_err(|e| format!("readelf (binutils) is needed for the dist checks: {e}"))?;
    if !out.status.success() {
        return Err(format!("readelf {args:?} {} failed", file.display()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The newest `GLIBC_x.y` version named in `readelf --version-info` output.
pub fn newest_glibc(version_info: &str) -> (u32, u32) {
    let mut newest = (0, 0);
    for word in version_info.split_whitespace() {
        if let Some(v) = word.strip_prefix("GLIBC_") {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
            let ver = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
            newest = newest.max(ver);
        }
    }
    newest
}

fn report_glibc(file: &Path) -> Result<(u32, u32), String> {
    let newest = newest_glibc(&readelf(&["--version-info", "-W"], file)?);
    println!(
        "dist: {} needs at most GLIBC_{}.{}",
        file.display(),
        newest.0,
        newest.1
    );
    Ok(newest)
}

/// Fails when the file needs a `GLIBC_x.y` symbol version newer than [`DIST_GLIBC`].
fn check_glibc(file: &Path) -> Result<(), String> {
    let newest = report_glibc(file)?;
    if newest > DIST_GLIBC {
        return Err(format!(
            "{} needs GLIBC_{}.{}, newer than the {}.{} we promise",
            file.display(),
            newest.0,
            newest.1,
            DIST_GLIBC.0,
            DIST_GLIBC.1
        ));
    }
    Ok(())
}

/// Fails when `file` still carries a symbol table or debug sections.
pub fn check_stripped(file: &Path) -> Result<(), String> {
    let text = readelf(&["--section-headers", "-W"], file)?;
    let left: Vec<&str> = text
        .split_whitespace()
        // `.debug_gdb_scripts` is a few bytes naming Rust's gdb pretty-printers, loaded with
        // the code (not debug information); strip keeps it.
        .filter(|w| *w == ".symtab" || (w.starts_with(".debug_") && *w != ".debug_gdb_scripts"))
        .collect();
    if left.is_empty() {
        Ok(())
    } else {
        Err(format!("{} is not stripped: {left:?}", file.display()))
    }
}

/// The library must export the driver entry points programs resolve and nothing of Rust's.
pub fn check_exports(lib: &Path) -> Result<(), String> {
    let text = readelf(&["--dyn-syms", "-W"], lib)?;
    let exported: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" GLOBAL ") && !l.contains(" UND "))
        .filter_map(|l| l.split_whitespace().nth(7))
        .map(|s| s.split('@').next().unwrap_or(s))
        .collect();
    // The declaration list is the one source of what must be exported.
    let declared = vgpu_cuda_abi::CUDA_HOOKED_SYMBOLS
        .iter()
        .chain(vgpu_cuda_abi::NVML_HOOKED_SYMBOLS)
        .map(|s| s.name)
        .chain(["dlsym"]);
    let missing: Vec<&str> = declared.filter(|name| !exported.contains(name)).collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} does not export declared symbols: {missing:?}",
            lib.display()
        ));
    }
    let stray: Vec<&&str> = exported
        .iter()
        .filter(|s| {
            !(s.starts_with("cu")
                || s.starts_with("nvml")
                || **s == "dlsym"
                || s.starts_with("vgpu_"))
        })
        .collect();
    if !stray.is_empty() {
        return Err(format!(
            "{} exports symbols outside the driver API: {stray:?}",
            lib.display()
        ));
    }
    println!(
        "dist: {} exports {} symbols, all driver/NVML/dlsym entry points",
        lib.display(),
        exported.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The workspace's debug build (made by `cargo xtask test` before the tests run).
    fn debug_build() -> PathBuf {
        let dir = target_dir().join("debug");
        for n in ["vgpu", "libvgpu.so", "libvgpusim.so"] {
            assert!(
                dir.join(n).is_file(),
                "{} missing: run `cargo xtask test` (it builds the workspace first)",
                dir.join(n).display()
            );
        }
        dir
    }

    fn scratch(name: &str) -> PathBuf {
        let d = target_dir().join("xtask-test").join(name);
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn packaging_lays_out_strips_and_checksums_the_release() {
        let out = scratch("dist");
        let name = release_name(true);
        let tree = package(&debug_build(), &workspace_root(), &out, &name).unwrap();
        let lib = tree.join(format!("lib/libvgpu.so.{VERSION}"));
        // Stripped, yet every declared entry point is still exported.
        check_stripped(&lib).unwrap();
        check_stripped(&tree.join("bin/vgpu")).unwrap();
        check_exports(&lib).unwrap();
        assert!(
            check_stripped(&debug_build().join("libvgpu.so")).is_err(),
            "the debug build has symbols, so the check can fail"
        );
        let small = std::fs::metadata(&lib).unwrap().len();
        let big = std::fs::metadata(debug_build().join("libvgpu.so"))
            .unwrap()
            .len();
        assert!(small * 2 < big, "stripped {small} vs {big}");
        assert_eq!(
            std::fs::read_link(tree.join("lib/libvgpu.so")).unwrap(),
            PathBuf::from(format!("libvgpu.so.{VERSION}"))
        );
        assert_eq!(
            std::fs::read(tree.join("LICENSE")).unwrap(),
            std::fs::read(workspace_root().join("LICENSE")).unwrap()
        );
        // SHA256SUMS and the tarball's .sha256 verify with the standard tool.
        let check = |dir: &Path, file: &str| {
            Command::new("sha256sum")
                .current_dir(dir)
                .args(["--check", "--strict", file])
                .output()
                .unwrap()
                .status
                .success()
        };
        assert!(check(&tree, "SHA256SUMS"));
        assert!(check(&out, &format!("{name}.tar.gz.sha256")));
        // The tarball holds exactly the layout.
        let listing = Command::new("tar")
            .arg("-tzf")
            .arg(out.join(format!("{name}.tar.gz")))
            .output()
            .unwrap();
        let mut got: Vec<String> = String::from_utf8_lossy(&listing.stdout)
            .lines()
            .filter(|l| !l.ends_with('/'))
            .map(|l| l.trim_start_matches(&format!("{name}/")).to_owned())
            .collect();
        got.sort();
        let mut want: Vec<String> = LAYOUT.iter().map(|(p, _, _)| layout_path(p)).collect();
        want.push("SHA256SUMS".into());
        want.sort();
        assert_eq!(got, want);
        // A changed byte fails the checksum.
        let gz = out.join(format!("{name}.tar.gz"));
        let mut bytes = std::fs::read(&gz).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&gz, bytes).unwrap();
        assert!(!check(&out, &format!("{name}.tar.gz.sha256")));
    }

    #[test]
    fn glibc_versions_are_compared_numerically() {
        let text =
            "  0x0010:   Name: GLIBC_2.2.5  Flags: none\n  Name: GLIBC_2.17\n Name: GLIBC_2.3.4";
        assert_eq!(newest_glibc(text), (2, 17));
        assert_eq!(newest_glibc("GLIBC_2.9 GLIBC_2.34"), (2, 34));
        assert_eq!(newest_glibc("nothing"), (0, 0));
    }

    #[test]
    fn unknown_dist_arguments_are_refused() {
        assert!(parse(&["--nativ".into()]).is_err());
        let f = parse(&["--native".into()]).unwrap();
        assert!(f.native && !f.install_tools);
    }
}
