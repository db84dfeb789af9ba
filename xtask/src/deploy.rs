//! `cargo xtask deploy-check`: what can be checked of `deploy/` without a cluster or a
//! container engine.
//!
//! 1. The Dockerfiles copy from the release tree exactly what [`dist::LAYOUT`] ships, into
//!    the paths HAMi's and Volcano's device plugins and HAMi's DRA driver use (facts below,
//!    from their source), the same files to the same places as the daemonless builder
//!    (`deploy/image/vgpu-image plan`), and the Helm values and the exporter manifests name
//!    what the images hold.
//! 2. The manifests are valid against the Kubernetes JSON schemas and the values files hold
//!    the keys their charts read (kubernetes-validate from PyPI, installed into
//!    `target/deploy-check-venv`, never globally; `deploy/check/`).
//! 3. The daemonless builder makes each image from the workspace's build packaged as a
//!    release, and umoci (Debian's) unpacks it: files, checksums, entrypoint
//!    (`deploy/image/test_vgpu_image.py`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::dist::{self, LAYOUT, Source};
use crate::{run, target_dir, workspace_root};

/// Where HAMi's image keeps the library it copies to the host (docker/Dockerfile:
/// `/k8s-vgpu/lib/nvidia/libvgpu.so.$VERSION`), and the script its chart's postStart runs
/// (templates/device-plugin/daemonsetnvidia.yaml: `/k8s-vgpu/bin/vgpu-init.sh <hook path>/vgpu/`).
const HAMI_LIB_GLOB: &str = "/k8s-vgpu/lib/nvidia -maxdepth 1 -name 'libvgpu.so.*'";
const HAMI_INIT: &str = "/k8s-vgpu/bin/vgpu-init.sh";
/// Volcano's image keeps the library where no postStart copies from (its chart's `cp -f
/// /k8s-vgpu/lib/nvidia/*` writes in place): the entrypoint installs it from here by rename.
const VOLCANO_NODE_LIB: &str = "/opt/vgpu/node/libvgpu.so";
const VOLCANO_INSTALLER: &str = "/k8s-vgpu/bin/vgpu-install-lib.sh";
/// The base image's entrypoint (docker/Dockerfile.ubuntu20.04: `ENTRYPOINT
/// ["volcano-vgpu-device-plugin"]`), which ours runs after installing.
const VOLCANO_ENTRYPOINT: &str = "volcano-vgpu-device-plugin";
/// HAMi's DRA driver image (deploy/container/Dockerfile): HAMi-core at
/// `/usr/local/lib/hami/libvgpu.so`, copied by `/usr/bin/vgpu-init.sh` (its chart's postStart).
const DRA_LIB: &str = "/usr/local/lib/hami/libvgpu.so";
const DRA_INIT: &str = "/usr/bin/vgpu-init.sh";
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
            Some("ENV") => {}
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

/// What `deploy/image/vgpu-image plan` says a flavour's image carries: its Dockerfile, the
/// `(release file, image path)` pairs it copies, the base files it removes, its environment and
/// the entrypoint it puts before the base's.
#[derive(Debug, Default)]
struct Plan {
    dockerfile: String,
    copy: Vec<(String, String)>,
    remove: Vec<String>,
    env: Vec<(String, String)>,
    entrypoint_prefix: Vec<String>,
}

fn plan(root: &Path, flavour: &str) -> Result<Plan, String> {
    let out = Command::new("python3")
        .arg(root.join("deploy/image/vgpu-image"))
        .args(["plan", "--flavour", flavour, "--version", dist::VERSION])
        .output()
        .map_err(|e| format!("python3 (for deploy/image/vgpu-image plan): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "vgpu-image plan --flavour {flavour}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("vgpu-image plan --flavour {flavour}: {e}"))?;
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let pairs = |v: &serde_json::Value| -> Vec<(String, String)> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| match strings(p).as_slice() {
                [a, b] => Some((a.clone(), b.clone())),
                _ => None,
            })
            .collect()
    };
    Ok(Plan {
        dockerfile: v["dockerfile"].as_str().unwrap_or_default().to_owned(),
        copy: pairs(&v["copy"]),
        remove: strings(&v["remove"]),
        env: v["env"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect(),
        entrypoint_prefix: strings(&v["entrypoint_prefix"]),
    })
}

/// Problems of a Dockerfile against its flavour's plan: exactly the plan's copies, its
/// environment, its removals (a RUN step), its entrypoint before `base_entrypoint`.
fn check_against_plan(
    name: &str,
    d: &Dockerfile,
    p: &Plan,
    base_entrypoint: &[&str],
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut want = p.copy.clone();
    let mut got = d.copies.clone();
    want.sort();
    got.sort();
    if want != got {
        problems.push(format!(
            "{name}: copies {got:?}, but vgpu-image (the daemonless path) copies {want:?}"
        ));
    }
    for (k, v) in &p.env {
        if !d.text.lines().any(|l| l.trim() == format!("ENV {k}={v}")) {
            problems.push(format!("{name}: must set ENV {k}={v}"));
        }
    }
    for r in &p.remove {
        if !d.text.contains(&format!("rm -f {r}")) && !d.text.contains(&format!(" {r}")) {
            problems.push(format!("{name}: must remove {r} from the base"));
        }
    }
    if !p.entrypoint_prefix.is_empty() {
        let words: Vec<String> = p
            .entrypoint_prefix
            .iter()
            .map(String::as_str)
            .chain(base_entrypoint.iter().copied())
            .map(|w| format!("\"{w}\""))
            .collect();
        let line = format!("ENTRYPOINT [{}]", words.join(", "));
        if !d.text.lines().any(|l| l.trim() == line) {
            problems.push(format!("{name}: expected {line}"));
        }
    }
    problems
}

/// Every problem of `deploy/` that needs no schema tool; empty when all is consistent.
fn check_layouts(root: &Path) -> Vec<String> {
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
    let hami = parse_dockerfile(&read("deploy/hami/Dockerfile"));
    let volcano = parse_dockerfile(&read("deploy/volcano/Dockerfile"));
    let dra = parse_dockerfile(&read("deploy/hami-dra/Dockerfile"));
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
            (lib, VOLCANO_NODE_LIB),
            ("bin/vgpu", CLI_IN_IMAGE),
            (installer, VOLCANO_INSTALLER),
        ],
    ));
    problems.extend(check_dockerfile(
        "deploy/hami-dra/Dockerfile",
        &dra,
        "docker.io/projecthami/k8s-dra-driver:",
        &[
            (lib, DRA_LIB),
            ("bin/vgpu", CLI_IN_IMAGE),
            (installer, DRA_INIT),
        ],
    ));
    // The Dockerfiles and the daemonless builder put the same files in the same places.
    for (flavour, d, base_entrypoint) in [
        ("hami", &hami, &[][..]),
        ("volcano", &volcano, &[VOLCANO_ENTRYPOINT][..]),
        ("hami-dra", &dra, &[][..]),
    ] {
        match plan(root, flavour) {
            Ok(p) => problems.extend(check_against_plan(&p.dockerfile, d, &p, base_entrypoint)),
            Err(e) => problems.push(e),
        }
    }
    if dra.text.lines().any(|l| l.trim_start().starts_with("RUN")) {
        problems.push(
            "deploy/hami-dra/Dockerfile: no RUN step (the driver's base is distroless)".into(),
        );
    }
    // The image tags the values and manifests use are the ones the Dockerfiles document.
    let tag = |d: &Dockerfile, arg: &str| {
        format!(
            "{}-vgpu{}",
            d.args.get(arg).map_or("", String::as_str),
            dist::VERSION
        )
    };
    let (hami_tag, volcano_tag, dra_tag) = (
        tag(&hami, "HAMI_TAG"),
        tag(&volcano, "VOLCANO_TAG"),
        tag(&dra, "DRA_TAG"),
    );
    for (file, needle) in [
        (
            "deploy/hami/values-vgpu.yaml",
            format!("tag: \"{hami_tag}\""),
        ),
        (
            "deploy/volcano/values-vgpu.yaml",
            format!("tag: \"{volcano_tag}\""),
        ),
        (
            "deploy/hami-dra/values-vgpu.yaml",
            format!("tag: \"{dra_tag}\""),
        ),
        (
            "deploy/hami-dra/values-vgpu-hami-dra.yaml",
            format!("tag: \"{dra_tag}\""),
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
            "deploy/kubernetes/vgpu-exporter-hami-dra.yaml",
            format!("vgpu-hami-dra:{dra_tag}"),
        ),
    ] {
        if !read(file).contains(&needle) {
            problems.push(format!("{file}: expected {needle}"));
        }
    }
    for file in [
        "deploy/kubernetes/vgpu-exporter-hami.yaml",
        "deploy/kubernetes/vgpu-exporter-volcano.yaml",
        "deploy/kubernetes/vgpu-exporter-hami-dra.yaml",
    ] {
        let needle = format!("[\"{CLI_IN_IMAGE}\"]");
        if !read(file).contains(&needle) {
            problems.push(format!("{file}: expected {needle}"));
        }
    }
    problems
}

fn venv() -> PathBuf {
    target_dir().join("deploy-check-venv")
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
        "deploy-check: Dockerfiles, the daemonless builder, values and manifests agree with the release layout"
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
    run(c)?;
    daemonless_images(&root)
}

/// The daemonless image path (`deploy/image/vgpu-image`): the workspace's build packaged as a
/// release, each flavour built from it onto a base made by the test, unpacked by umoci and
/// checked (`deploy/image/test_vgpu_image.py`).
fn daemonless_images(root: &Path) -> Result<(), String> {
    let built = venv()
        .parent()
        .map_or_else(|| root.join("target"), Path::to_path_buf)
        .join("debug");
    for n in ["vgpu", "libvgpu.so", "libvgpusim.so"] {
        if !built.join(n).is_file() {
            return Err(format!(
                "{} missing: the image check packages the workspace's build (cargo build --workspace)",
                built.join(n).display()
            ));
        }
    }
    let out = built.with_file_name("deploy-check-dist");
    let name = dist::release_name(true);
    dist::package(&built, root, &out, &name)?;
    let mut c = Command::new("python3");
    c.current_dir(root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("VGPU_DIST_TARBALL", out.join(format!("{name}.tar.gz")))
        .args(["-m", "unittest", "-v", "deploy/image/test_vgpu_image.py"]);
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
    fn a_dockerfile_that_puts_the_library_where_volcanos_cp_reaches_is_caught() {
        let root = workspace_root();
        let text = std::fs::read_to_string(root.join("deploy/volcano/Dockerfile"))
            .unwrap()
            .replace(
                "/opt/vgpu/node/libvgpu.so\n",
                "/k8s-vgpu/lib/nvidia/libvgpu.so\n",
            );
        let d = parse_dockerfile(&text);
        let p = plan(&root, "volcano").unwrap();
        let problems = check_against_plan("x", &d, &p, &[VOLCANO_ENTRYPOINT]);
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0].contains("/k8s-vgpu/lib/nvidia/libvgpu.so"),
            "{problems:#?}"
        );
        // And one that drops the entrypoint's install step.
        let text = std::fs::read_to_string(root.join("deploy/volcano/Dockerfile"))
            .unwrap()
            .replace("ENTRYPOINT [", "# ENTRYPOINT [");
        let problems = check_against_plan("x", &parse_dockerfile(&text), &p, &[VOLCANO_ENTRYPOINT]);
        assert!(
            problems.iter().any(|p| p.contains("ENTRYPOINT")),
            "{problems:#?}"
        );
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
