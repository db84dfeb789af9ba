//! `cargo xtask deploy-check`: what can be checked of `deploy/` without a cluster or a
//! container engine.
//!
//! 1. The Dockerfiles copy from the release tree exactly what [`dist::LAYOUT`] ships, into
//!    the paths HAMi's and Volcano's device plugins use (facts below, from their source), and
//!    the Helm values, the Volcano patch and the exporter manifests name what the images hold.
//! 2. The manifests are valid against the Kubernetes JSON schemas (kubernetes-validate from
//!    PyPI, installed into `target/deploy-check-venv`, never globally; `deploy/check/`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::dist::{self, LAYOUT, Source};
use crate::{run, workspace_root};

/// Where HAMi's image keeps the library it copies to the host (docker/Dockerfile:
/// `/k8s-vgpu/lib/nvidia/libvgpu.so.$VERSION`), and the script its chart's postStart runs
/// (templates/device-plugin/daemonsetnvidia.yaml: `/k8s-vgpu/bin/vgpu-init.sh <hook path>/vgpu/`).
const HAMI_LIB_GLOB: &str = "/k8s-vgpu/lib/nvidia -maxdepth 1 -name 'libvgpu.so.*'";
const HAMI_INIT: &str = "/k8s-vgpu/bin/vgpu-init.sh";
/// Volcano's image: `/k8s-vgpu/lib/nvidia/libvgpu.so`, copied by postStart to /usr/local/vgpu/.
const VOLCANO_LIB: &str = "/k8s-vgpu/lib/nvidia/libvgpu.so";
const VOLCANO_INSTALLER: &str = "/k8s-vgpu/bin/vgpu-install-lib.sh";
/// Where both images put the CLI (the exporter DaemonSets run it).
const CLI_IN_IMAGE: &str = "/opt/vgpu/bin/vgpu";

/// A Dockerfile's `ARG` defaults and its `COPY` pairs (with `${ARG}` filled in).
#[derive(Debug, Default)]
struct Dockerfile {
    args: BTreeMap<String, String>,
    from: Vec<String>,
    copies: Vec<(String, String)>,
    text: String,
}

fn parse_dockerfile(text: &str) -> Dockerfile {
    let mut d = Dockerfile {
        text: text.to_owned(),
        ..Dockerfile::default()
    };
    let fill = |args: &BTreeMap<String, String>, s: &str| {
        let mut out = s.to_owned();
        for (k, v) in args {
            out = out.replace(&format!("${{{k}}}"), v);
        }
        out
    };
    for line in text.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("ARG") => {
                if let Some((k, v)) = words.next().and_then(|kv| kv.split_once('=')) {
                    d.args.insert(k.to_owned(), v.trim_matches('"').to_owned());
                }
            }
            Some("FROM") => d.from.extend(words.next().map(|w| fill(&d.args, w))),
            Some("COPY") => {
                let rest: Vec<&str> = words.filter(|w| !w.starts_with("--")).collect();
                if let [src, dest] = rest[..] {
                    d.copies.push((fill(&d.args, src), fill(&d.args, dest)));
                }
            }
            _ => {}
        }
    }
    d
}

/// The release tree's files, as the Dockerfiles name them.
fn release_files() -> Vec<String> {
    LAYOUT
        .iter()
        .filter(|(_, s, _)| !matches!(s, Source::Link(_)))
        .map(|(p, _, _)| dist::layout_path(p))
        .collect()
}

/// Problems of one Dockerfile against the release layout and the plugin's: `dest_of` maps
/// the release file every image must carry to where the plugin needs it.
fn check_dockerfile(
    name: &str,
    d: &Dockerfile,
    base_image: &str,
    needed: &[(&str, &str)],
) -> Vec<String> {
    let mut problems = Vec::new();
    let files = release_files();
    if d.args.get("VGPU_VERSION").map(String::as_str) != Some(dist::VERSION) {
        problems.push(format!(
            "{name}: ARG VGPU_VERSION={:?}, the release is {}",
            d.args.get("VGPU_VERSION"),
            dist::VERSION
        ));
    }
    if !d.from.iter().any(|f| f.starts_with(base_image)) {
        problems.push(format!("{name}: FROM {:?} is not {base_image}", d.from));
    }
    for (src, _) in &d.copies {
        if !files.contains(src) {
            problems.push(format!(
                "{name}: COPY {src}: no such file in the release tree ({files:?})"
            ));
        }
    }
    for (src, dest) in needed {
        let src = dist::layout_path(src);
        if !d.copies.iter().any(|(s, t)| *s == src && t == dest) {
            problems.push(format!("{name}: must COPY {src} {dest}"));
        }
    }
    problems
}

/// Every problem of `deploy/` that needs no schema tool; empty when all is consistent.
fn check_layouts(root: &Path) -> Vec<String> {
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
    let hami = parse_dockerfile(&read("deploy/hami/Dockerfile"));
    let volcano = parse_dockerfile(&read("deploy/volcano/Dockerfile"));
    let lib = "lib/libvgpu.so.{v}";
    let lib_in_image = format!("/opt/vgpu/lib/libvgpu.so.{}", dist::VERSION);
    let installer = "share/vgpu/vgpu-install-lib.sh";
    let mut problems = check_dockerfile(
        "deploy/hami/Dockerfile",
        &hami,
        "docker.io/projecthami/hami:",
        &[
            (lib, &lib_in_image),
            ("bin/vgpu", CLI_IN_IMAGE),
            (installer, HAMI_INIT),
        ],
    );
    // The library replaces the one versioned file the base image carries.
    let copies_over = format!("cp {lib_in_image} \"$target\"");
    let text = hami.text.replace("${VGPU_VERSION}", dist::VERSION);
    if !text.contains(HAMI_LIB_GLOB) || !text.contains(&copies_over) {
        problems.push(format!(
            "deploy/hami/Dockerfile: must copy {lib_in_image} over the one file `find {HAMI_LIB_GLOB}` finds"
        ));
    }
    problems.extend(check_dockerfile(
        "deploy/volcano/Dockerfile",
        &volcano,
        "docker.io/projecthami/volcano-vgpu-device-plugin:",
        &[
            (lib, VOLCANO_LIB),
            ("bin/vgpu", CLI_IN_IMAGE),
            (installer, VOLCANO_INSTALLER),
        ],
    ));
    let patch = read("deploy/volcano/daemonset-patch.yaml");
    if !patch.contains(&format!("{VOLCANO_INSTALLER} /usr/local/vgpu")) {
        problems.push(format!(
            "deploy/volcano/daemonset-patch.yaml: postStart must run {VOLCANO_INSTALLER} /usr/local/vgpu"
        ));
    }
    // The image tags the values and manifests use are the ones the Dockerfiles document.
    let hami_tag = format!(
        "{}-vgpu{}",
        hami.args.get("HAMI_TAG").map_or("", String::as_str),
        dist::VERSION
    );
    let volcano_tag = format!(
        "{}-vgpu{}",
        volcano.args.get("VOLCANO_TAG").map_or("", String::as_str),
        dist::VERSION
    );
    for (file, needle) in [
        (
            "deploy/hami/values-vgpu.yaml",
            format!("tag: \"{hami_tag}\""),
        ),
        (
            "deploy/volcano/daemonset-patch.yaml",
            format!("vgpu-volcano:{volcano_tag}"),
        ),
        (
            "deploy/kubernetes/vgpu-exporter-hami.yaml",
            format!("vgpu-hami:{hami_tag}"),
        ),
        (
            "deploy/kubernetes/vgpu-exporter-volcano.yaml",
            format!("vgpu-volcano:{volcano_tag}"),
        ),
        (
            "deploy/kubernetes/vgpu-exporter-hami.yaml",
            format!("[\"{CLI_IN_IMAGE}\"]"),
        ),
        (
            "deploy/kubernetes/vgpu-exporter-volcano.yaml",
            format!("[\"{CLI_IN_IMAGE}\"]"),
        ),
    ] {
        if !read(file).contains(&needle) {
            problems.push(format!("{file}: expected {needle}"));
        }
    }
    problems
}

fn venv() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
        .join("deploy-check-venv")
}

/// `cargo xtask deploy-check`.
pub fn deploy_check() -> Result<(), String> {
    let root = workspace_root();
    let problems = check_layouts(&root);
    if !problems.is_empty() {
        return Err(format!(
            "deploy/ is inconsistent:\n  {}",
            problems.join("\n  ")
        ));
    }
    println!(
        "deploy-check: Dockerfiles, values, patch and manifests agree with the release layout"
    );
    let env = venv();
    let python = env.join("bin/python");
    let requirements = root.join("deploy/check/requirements.txt");
    let stamp = env.join("requirements.installed");
    let wanted = std::fs::read_to_string(&requirements).map_err(|e| format!("{e}"))?;
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
        eprintln!(
            "xtask: installing {} into {} (PyPI; nothing global)",
            requirements.display(),
            env.display()
        );
        let mut c = Command::new("python3");
        c.args(["-m", "venv", "--clear"]).arg(&env);
        run(c).map_err(|e| {
            format!("{e}\nneeds python3 with venv (Debian: apt-get install python3-venv)")
        })?;
        let mut c = Command::new(&python);
        c.args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(&requirements);
        run(c)?;
        std::fs::write(&stamp, wanted).map_err(|e| format!("{e}"))?;
    }
    let mut c = Command::new(&python);
    c.arg(root.join("deploy/check/validate.py"));
    run(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repository_deploy_files_agree_with_the_release_layout() {
        let problems = check_layouts(&workspace_root());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn a_dockerfile_copying_a_file_the_release_lacks_is_caught() {
        let text = std::fs::read_to_string(workspace_root().join("deploy/hami/Dockerfile"))
            .unwrap()
            .replace("COPY bin/vgpu ", "COPY bin/vgpu-cli ")
            .replace(
                "COPY share/vgpu/vgpu-install-lib.sh /k8s-vgpu/bin/vgpu-init.sh",
                "COPY share/vgpu/vgpu-install-lib.sh /k8s-vgpu/bin/init.sh",
            );
        let d = parse_dockerfile(&text);
        let problems = check_dockerfile(
            "x",
            &d,
            "docker.io/projecthami/hami:",
            &[("share/vgpu/vgpu-install-lib.sh", HAMI_INIT)],
        );
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(problems[0].contains("bin/vgpu-cli"), "{problems:#?}");
        assert!(problems[1].contains(HAMI_INIT), "{problems:#?}");
    }

    #[test]
    fn args_fill_copy_paths() {
        let d = parse_dockerfile(
            "ARG HAMI_TAG=v2.10.0\nFROM docker.io/projecthami/hami:${HAMI_TAG}\nARG VGPU_VERSION=1.2.3\nCOPY lib/libvgpu.so.${VGPU_VERSION} /x/\n",
        );
        assert_eq!(d.from, ["docker.io/projecthami/hami:v2.10.0"]);
        assert_eq!(
            d.copies,
            [("lib/libvgpu.so.1.2.3".to_owned(), "/x/".to_owned())]
        );
    }
}
