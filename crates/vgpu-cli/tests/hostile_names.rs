//! What a tenant can put where node-side readers show it: the names of files in its own
//! container directory (matched by the exporter's glob, tab-completed by an operator) and the
//! `uuids[]` bytes of its own usage file. The exporter's page stays a valid exposition that
//! carries no forged sample (checked by a strict parser), and `status`, `watch` and `doctor`
//! write no control character to the operator's terminal.

mod common;
use common::*;

#[path = "common/exposition.rs"]
mod exposition;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use vgpu_cli::http;

const T: Duration = Duration::from_secs(5);
const UID: &str = "6a1f0e2c-9b7d-4c3e-8f10-0000000000c3";

/// A forged sample of another pod's memory: what a name with newlines tried to serve.
const FORGED: &str = "hami_vgpu_memory_used_bytes{namespace=\"prod\",pod=\"victim\",\
container=\"main\",vdevice_index=\"0\",device_uuid=\"GPU-1\",zone=\"vGPU\"} 99999999999";

/// File names a tenant can give in its container directory, each ending in `.cache` so the
/// exporter's glob matches it: newlines carrying a forged sample and a line no parser takes,
/// quotes and backslashes, terminal controls (ESC, an OSC title, BEL, CR, TAB, DEL, the C1
/// NEL and CSI), a bidirectional override, and bytes that are not UTF-8.
fn hostile_names() -> Vec<OsString> {
    let mut names: Vec<OsString> = [
        format!("x\n{FORGED}\n.cache"),
        "y\nthis is not a metric line\n.cache".to_owned(),
        "q\"uote\\back\\\"slash}.cache".to_owned(),
        "esc\u{1b}]0;owned\u{7}bel\rcr\ttab\u{7f}del\u{85}nel\u{9b}31mcsi.cache".to_owned(),
        "bidi\u{202e}ehcac.cache".to_owned(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect();
    names.push(OsString::from_vec(b"bad\xff\xfe\x1b[2J.cache".to_vec()));
    names
}

/// `uuids[0]` as a tenant can write it into its own file: a label breakout, a forged family,
/// terminal controls, a lone C1 byte and bytes that are not UTF-8.
const HOSTILE_UUID: &[u8] =
    b"GPU-\"}\n# TYPE evil gauge\nevil 1\n\x1b[2J\x1b]0;pwned\x07\r\\\x9b\xc2\x9b\xe2\x80\xae\xff";

/// A one-GPU table at `path` (1 GiB, 30%), its `uuids[0]` overwritten with [`HOSTILE_UUID`].
fn hostile_table(path: &Path) {
    use std::os::unix::fs::FileExt;
    let init = vgpu_shm::TableInit {
        uuids: vec!["GPU-placeholder".into()],
        memory_limits: vec![Some(1 << 30)],
        sm_limits: vec![Some(30)],
        priority: 1,
    };
    drop(vgpu_shm::UsageTable::open_or_create(path, &init).unwrap());
    let mut field = HOSTILE_UUID.to_vec();
    field.resize(vgpu_shm::layout::UUID_LEN, 0);
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&field, vgpu_shm::layout::offsets::uuid(0) as u64)
        .unwrap();
}

/// A node whose tenant (pod `team-t/tenant-0`, container `main`) filled its container
/// directory with [`hostile_names`]: each name once as an empty file (unreadable: an error
/// comment) and once, prefixed `v`, as a valid table with a [`HOSTILE_UUID`].
struct HostileNode {
    dir: TempDir,
    /// The files the exporter's glob can match.
    files: Vec<PathBuf>,
}

impl HostileNode {
    fn new() -> Self {
        let dir = TempDir::new("vgpu-hostile").unwrap();
        std::fs::create_dir_all(dir.path().join(format!("pods/team-t_tenant-0_{UID}"))).unwrap();
        let ctr = dir.path().join(format!("containers/{UID}_main"));
        std::fs::create_dir_all(&ctr).unwrap();
        let mut files = Vec::new();
        for name in hostile_names() {
            let empty = ctr.join(&name);
            std::fs::write(&empty, b"").unwrap();
            let mut v = OsString::from("v");
            v.push(&name);
            let valid = ctr.join(v);
            hostile_table(&valid);
            files.extend([empty, valid]);
        }
        HostileNode { dir, files }
    }

    fn pattern(&self) -> String {
        format!("{}/containers/*/*.cache", self.dir.path().display())
    }
}

#[test]
fn tenant_file_names_and_uuids_cannot_forge_or_break_the_metrics_page() {
    let node = HostileNode::new();
    let pods = node.dir.path().join("pods");
    let e = Exporter::start(
        vgpu(),
        &[
            "--cache",
            &node.pattern(),
            "--pod-logs",
            pods.to_str().unwrap(),
            "--legacy-metrics",
            "--per-process",
        ],
    );
    let (status, page) = http::get(&e.addr, "/metrics", T).unwrap();
    assert_eq!(status, 200);
    let samples = exposition::parse(&page).unwrap_or_else(|e| panic!("{e}\n{page}"));
    assert!(
        samples
            .iter()
            .all(|s| s.value != 99_999_999_999.0 && s.label("pod") != Some("victim")),
        "a forged sample was served:\n{page}"
    );
    assert!(!samples.iter().any(|s| s.name == "evil"), "{page}");
    // Every file the glob matched has its `vgpu_up`, each under a label of its own.
    let files = samples
        .iter()
        .find(|s| s.name == "vgpu_exporter_files")
        .unwrap()
        .value as usize;
    let up: Vec<_> = samples.iter().filter(|s| s.name == "vgpu_up").collect();
    assert_eq!(up.len(), files, "{page}");
    let caches: std::collections::BTreeSet<_> =
        up.iter().map(|s| s.label("cache").unwrap()).collect();
    assert_eq!(caches.len(), files, "two files under one label:\n{page}");
    // The UTF-8 names are all matched (names that are not UTF-8 never match a glob).
    let utf8 = node.files.iter().filter(|p| p.to_str().is_some()).count();
    assert!(files >= utf8, "{files} of {utf8} files matched:\n{page}");
    let readable = up.iter().filter(|s| s.value == 1.0).count();
    assert_eq!(readable * 2, files, "{page}");
    // The tenant's container gets HAMi's families, its UUID escaped into a label, once: its
    // copies of its own table name the same container and GPU, so only the first is served.
    let hami: Vec<_> = samples
        .iter()
        .filter(|s| s.name == "hami_vgpu_memory_used_bytes")
        .collect();
    assert_eq!(hami.len(), 1, "{page}");
    assert!(page.contains(" duplicate series dropped "), "{page}");
    for s in hami {
        assert_eq!(s.label("pod"), Some("tenant-0"), "{s:?}");
        assert!(s.label("device_uuid").unwrap().starts_with("GPU-"), "{s:?}");
    }
    // The unreadable files are named in comments, one line each.
    let comments = page
        .lines()
        .filter(|l| l.starts_with("# error reading "))
        .count();
    assert_eq!(comments, files - readable, "{page}");
}

/// Every character of `text` that a terminal would act on rather than print: C0 and C1
/// controls other than the line end, DEL, and the bidirectional overrides.
fn terminal_controls(text: &str) -> Vec<char> {
    text.chars()
        .filter(|&c| {
            (c.is_control() && c != '\n')
                || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .collect()
}

#[track_caller]
fn assert_printable(what: &str, out: &Output) {
    for (stream, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let found = terminal_controls(text);
        assert!(
            found.is_empty(),
            "{what} {stream} carries {found:?}:\n{text}"
        );
        assert!(
            !text.lines().any(|l| l.starts_with("FAKE LINE")),
            "{what} {stream} printed a forged line:\n{text}"
        );
    }
}

#[test]
fn status_watch_and_doctor_print_no_terminal_controls_from_a_tenant() {
    let dir = TempDir::new("vgpu-hostile-tty").unwrap();
    // A name an operator tab-completes, and a UUID the tenant wrote.
    let name = OsString::from_vec(
        b"c\x1b]0;title\x07\r\nFAKE LINE \xc2\x9b31m\xe2\x80\xae\xff.cache".to_vec(),
    );
    let valid = dir.path().join(&name);
    hostile_table(&valid);
    let mut broken_name = OsString::from("broken-");
    broken_name.push(&name);
    let broken = dir.path().join(broken_name);
    std::fs::write(&broken, b"").unwrap();
    let runs: &[(&str, &[&str], &Path)] = &[
        ("status", &["status"], &valid),
        ("status --json", &["status", "--json"], &valid),
        ("watch", &["watch", "--count", "1"], &valid),
        ("watch --json", &["watch", "--json", "--count", "1"], &valid),
        ("doctor", &["doctor", "--no-probe"], &valid),
        ("status of an unreadable file", &["status"], &broken),
        (
            "watch of an unreadable file",
            &["watch", "--count", "1"],
            &broken,
        ),
        (
            "doctor of an unreadable file",
            &["doctor", "--no-probe"],
            &broken,
        ),
        ("set-limit", &["set-limit", "--memory", "2g"], &valid),
    ];
    for (what, args, cache) in runs {
        let mut cmd = vgpu();
        cmd.env("VGPU_TURN_DIR", "off");
        cache_args(&mut cmd, args, cache);
        let out = run(cmd);
        assert_printable(what, &out);
        if *what == "status" {
            // The UUID is shown, escaped, on the device's own line.
            assert!(out.stdout.contains("GPU-\"}"), "{}", out.stdout);
            assert!(out.stdout.contains("\\x1b"), "{}", out.stdout);
        }
    }
    // The JSON still carries the exact strings (escaped the JSON way).
    let mut cmd = vgpu();
    cache_args(&mut cmd, &["status", "--json"], &valid);
    let out = run(cmd);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    let uuid = v["devices"][0]["uuid"].as_str().unwrap();
    assert!(
        uuid.starts_with("GPU-\"}\n# TYPE evil") && uuid.contains('\u{1b}'),
        "{uuid:?}"
    );
}
