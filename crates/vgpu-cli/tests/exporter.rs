//! `vgpu exporter` scraped over loopback: an ephemeral port, bounded waits, bad requests.

mod common;
use common::*;

#[path = "common/exposition.rs"]
mod exposition;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vgpu_cli::http;

const T: Duration = Duration::from_secs(5);

/// Start `vgpu exporter --listen 127.0.0.1:0 --cache PATTERN` and read the address it prints.
pub fn start(pattern: &str) -> Exporter {
    start_with(pattern, &[])
}

/// [`start`] with more arguments.
pub fn start_with(pattern: &str, extra: &[&str]) -> Exporter {
    Exporter::start(vgpu(), &[&["--cache", pattern], extra].concat())
}

#[test]
fn a_missing_file_is_reported_down_and_errors_count() {
    let dir = TempDir::new("vgpu-exp").unwrap();
    let path = dir.path().join("none.cache");
    let e = start(path.to_str().unwrap());
    let (status, body) = http::get(&e.addr, "/metrics", T).unwrap();
    assert_eq!(status, 200);
    let up = format!("vgpu_up{{cache=\"{}\"}} 0\n", path.display());
    assert!(body.contains(&up), "{body}");
    assert!(
        body.contains("# TYPE vgpu_device_memory_limit_bytes gauge\n"),
        "{body}"
    );
    let (_, body) = http::get(&e.addr, "/metrics", T).unwrap();
    let errors = format!(
        "vgpu_scrape_errors_total{{cache=\"{}\"}} 2\n",
        path.display()
    );
    assert!(body.contains(&errors), "{body}");
}

#[test]
fn index_404_405_and_garbage_are_answered_without_dying() {
    let dir = TempDir::new("vgpu-exp").unwrap();
    let e = start(&format!("{}/*.cache", dir.path().display()));
    let (status, body) = http::get(&e.addr, "/", T).unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("/metrics"));
    assert_eq!(http::get(&e.addr, "/nope", T).unwrap().0, 404);
    let raw = |bytes: &[u8]| -> String {
        let mut s = TcpStream::connect(&e.addr).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.write_all(bytes).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    assert!(raw(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(raw(b"garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
    assert!(raw(&[0xffu8; 64]).starts_with("HTTP/1.1 400"));
    assert!(raw(&vec![b'A'; 20_000]).starts_with("HTTP/1.1 413"));
    let head = raw(b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert!(
        head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    // A client that connects and says nothing does not block others.
    let _idle = TcpStream::connect(&e.addr).unwrap();
    let (status, body) = http::get(&e.addr, "/metrics", T).unwrap();
    assert_eq!(status, 200);
    // A glob that matches nothing is zero files, not an error.
    assert!(body.contains("vgpu_exporter_files 0\n"), "{body}");
}

#[test]
fn concurrent_scrapes_all_succeed() {
    let dir = TempDir::new("vgpu-exp").unwrap();
    let e = start(dir.path().join("x.cache").to_str().unwrap());
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let addr = e.addr.clone();
            std::thread::spawn(move || http::get(&addr, "/metrics", T).unwrap().0)
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 200);
    }
}

/// A slowloris client: it connects, sends a request line and then one header byte at a time,
/// never ending the head, and connects again whenever the exporter closes it. Counts its
/// connections in `connects`; stops when `stop` is set.
fn slow_client(addr: String, connects: Arc<AtomicUsize>, stop: Arc<AtomicBool>) {
    let tick = Duration::from_millis(500);
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = TcpStream::connect(&addr) else {
            std::thread::sleep(tick);
            continue;
        };
        connects.fetch_add(1, Ordering::Relaxed);
        s.set_read_timeout(Some(tick)).unwrap();
        let mut sent = s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ");
        while sent.is_ok() && !stop.load(Ordering::Relaxed) {
            match s.read(&mut [0u8; 256]) {
                // Still open: one more byte.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => sent = s.write_all(b"a"),
                // Answered (503, 408) or closed: connect again, after a tick like a real one.
                _ => {
                    std::thread::sleep(tick);
                    break;
                }
            }
        }
    }
}

/// Forty slowloris clients (more than the exporter serves at once) cannot keep real scrapes
/// out: every one of them is answered. They used to hold every slot and all scrapes got 503.
#[test]
fn scrapes_are_served_while_slow_clients_hold_connections() {
    let dir = TempDir::new("vgpu-exp").unwrap();
    let e = start(&format!("{}/*.cache", dir.path().display()));
    let stop = Arc::new(AtomicBool::new(false));
    let connects = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..40)
        .map(|_| {
            let (addr, connects, stop) = (e.addr.clone(), connects.clone(), stop.clone());
            std::thread::spawn(move || slow_client(addr, connects, stop))
        })
        .collect();
    let started = Instant::now();
    while connects.load(Ordering::Relaxed) < 40 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "slow clients never connected"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Past the grace a new connection gets before it can be displaced.
    std::thread::sleep(http::DISPLACE_AFTER * 2);
    let answers: Vec<u16> = (0..20)
        .map(|_| http::get(&e.addr, "/metrics", T).map_or(0, |(status, _)| status))
        .collect();
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    assert!(answers.iter().all(|&s| s == 200), "{answers:?}");
}

/// A request head has one deadline, not one per read: a client sending a byte every quarter
/// second is answered 408 and closed (it used to be kept as long as it kept sending).
#[test]
fn a_request_head_trickled_byte_by_byte_is_cut_off() {
    let dir = TempDir::new("vgpu-exp").unwrap();
    let e = start(&format!("{}/*.cache", dir.path().display()));
    let mut s = TcpStream::connect(&e.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(250)))
        .unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nX-Slow: ").unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let ended = loop {
        if started.elapsed() > Duration::from_secs(30) {
            break false;
        }
        match s.read_to_end(&mut answer) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            // Answered and closed (or reset, when the close met bytes in flight).
            _ => break true,
        }
        if s.write_all(b"a").is_err() {
            break true;
        }
    };
    assert!(ended, "still connected after {:?}", started.elapsed());
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
}

#[test]
fn bad_listen_address_and_glob_are_clear_errors() {
    let mut cmd = vgpu();
    cmd.args([
        "exporter",
        "--listen",
        "not-an-address",
        "--cache",
        "/tmp/x.cache",
    ]);
    assert_fails(&run(cmd), 1, &["cannot listen on not-an-address"]);
    let mut cmd = vgpu();
    cmd.args(["exporter", "--cache", ""]);
    assert_fails(&run(cmd), 2, &["--cache is empty"]);
}

/// What HAMi's published vGPU dashboard asks of the container families: every query on a
/// container metric, its label filter and the labels its legend prints. From
/// `dashboards/hami-vgpu-dashboard.json` in Project-HAMi/HAMi (commit 4707fb02, v2.10); the
/// node panels (`hami_gpu_*`, `hami_host_gpu_*`) come from HAMi's scheduler and monitor, not
/// from this exporter (docs/kubernetes.md).
const DASHBOARD_QUERIES: &[DashboardQuery] = &[
    DashboardQuery::on_namespace(
        "vGPU memory: used vs limit",
        "hami_vgpu_memory_used_bytes",
        CONTAINER_LEGEND,
    ),
    DashboardQuery::on_namespace(
        "vGPU memory: used vs limit",
        "hami_vgpu_memory_limit_bytes",
        CONTAINER_LEGEND,
    ),
    DashboardQuery::on_namespace(
        "Container device utilization",
        "hami_container_device_utilization_ratio",
        CONTAINER_LEGEND,
    ),
    DashboardQuery::on_namespace(
        "vGPU memory used % of limit (numerator; the denominator is the limit above)",
        "hami_vgpu_memory_used_bytes",
        CONTAINER_LEGEND,
    ),
    DashboardQuery::on_namespace(
        "Top 10 containers by vGPU memory",
        "hami_vgpu_memory_used_bytes",
        &[],
    ),
    DashboardQuery::on_namespace(
        "variable $namespace: label_values(hami_vgpu_memory_used_bytes, namespace)",
        "hami_vgpu_memory_used_bytes",
        &["namespace"],
    ),
];

#[derive(Debug)]
struct DashboardQuery {
    panel: &'static str,
    metric: &'static str,
    /// The label the query filters on (`{namespace=~"$namespace"}`).
    filter: &'static str,
    /// Labels the legend prints; each must be present and non-empty.
    legend: &'static [&'static str],
}

/// What a per-container panel's legend prints.
const CONTAINER_LEGEND: &[&str] = &["namespace", "pod", "container", "vdevice_index"];

impl DashboardQuery {
    /// A query filtered on the dashboard's `$namespace` variable, as every one is.
    const fn on_namespace(
        panel: &'static str,
        metric: &'static str,
        legend: &'static [&'static str],
    ) -> Self {
        DashboardQuery {
            panel,
            metric,
            filter: "namespace",
            legend,
        }
    }
}

/// The labels HAMi's monitor puts on every container series (`cmd/vGPUmonitor/metrics.go`),
/// plus the `zone` its registry wraps them with.
const HAMI_LABELS: &[&str] = &[
    "namespace",
    "pod",
    "container",
    "vdevice_index",
    "device_uuid",
    "zone",
];

const UID_A: &str = "6a1f0e2c-9b7d-4c3e-8f10-0000000000a1";
const UID_B: &str = "6a1f0e2c-9b7d-4c3e-8f10-0000000000b2";
const UUID: &str = "GPU-5a1e5130-0000-4000-8000-00000000d000";
const MIB: u64 = 1 << 20;

/// A node's host layout: `containers/<uid>_<ctr>/<x>.cache` and `pods/<ns>_<pod>_<uid>`.
struct Node {
    dir: TempDir,
}

impl Node {
    fn new() -> Self {
        let dir = TempDir::new("vgpu-exp-node").unwrap();
        std::fs::create_dir_all(dir.path().join("pods")).unwrap();
        Node { dir }
    }

    fn pod(&self, ns: &str, name: &str, uid: &str) {
        std::fs::create_dir(self.dir.path().join(format!("pods/{ns}_{name}_{uid}"))).unwrap();
    }

    /// A container's usage file (limit `None` = unlimited), as the hook creates it.
    fn container(&self, uid: &str, ctr: &str, limit: Option<u64>) -> std::path::PathBuf {
        let d = self.dir.path().join(format!("containers/{uid}_{ctr}"));
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("0d3c8f2e-1111-4222-8333-444455556666.cache");
        let init = vgpu_shm::TableInit {
            uuids: vec![UUID.into()],
            memory_limits: vec![limit],
            sm_limits: vec![Some(30)],
            priority: 1,
        };
        drop(vgpu_shm::UsageTable::open_or_create(&path, &init).unwrap());
        path
    }

    /// Pod `team-a/train-0` (`UID_A`) whose container `main` has a 1 GiB limit, this process
    /// holding 300 MiB and 40% in it.
    fn training_pod(&self) -> vgpu_shm::ProcessSlot {
        self.pod("team-a", "train-0", UID_A);
        let a = self.container(UID_A, "main", Some(1 << 30));
        hold(&a, 300 * MIB, 40)
    }

    fn start(&self, extra: &[&str]) -> Exporter {
        let pattern = format!("{}/containers/*/*.cache", self.dir.path().display());
        let pods = self.dir.path().join("pods");
        let mut args = vec!["--pod-logs", pods.to_str().unwrap()];
        args.extend_from_slice(extra);
        start_with(&pattern, &args)
    }
}

/// This process registers in `path` and holds `bytes` of data and `sm` percent.
fn hold(path: &std::path::Path, bytes: u64, sm: u64) -> vgpu_shm::ProcessSlot {
    use vgpu_alloc_core::{DeviceIndex, UsageClass, UsageLedger};
    let slot = vgpu_shm::UsageTable::open_existing(path)
        .unwrap()
        .register_self()
        .unwrap();
    slot.try_reserve(DeviceIndex(0), UsageClass::Data, bytes)
        .unwrap();
    slot.set_sm_util(DeviceIndex(0), sm);
    slot.touch_kernel_time();
    slot
}

/// Parse a scrape with a real Prometheus text-format parser; every sample line must parse,
/// and the page must pass the strict reader.
fn parse(body: &str) -> Vec<prometheus_parse::Sample> {
    if let Err(e) = exposition::parse(body) {
        panic!("{e}\n{body}");
    }
    let lines = body.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the page parses");
    let sample_lines = body
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    assert_eq!(
        scrape.samples.len(),
        sample_lines,
        "some sample lines did not parse:\n{body}"
    );
    scrape.samples
}

fn value(s: &prometheus_parse::Sample) -> f64 {
    match s.value {
        prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Untyped(v) => v,
        _ => panic!("not a scalar: {s:?}"),
    }
}

fn find<'a>(
    samples: &'a [prometheus_parse::Sample],
    metric: &str,
    labels: &[(&str, &str)],
) -> Vec<&'a prometheus_parse::Sample> {
    samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .collect()
}

#[test]
fn every_hami_dashboard_query_finds_its_series() {
    let node = Node::new();
    let _held = node.training_pod();
    let e = node.start(&[]);
    let (status, body) = http::get(&e.addr, "/metrics", T).unwrap();
    assert_eq!(status, 200);
    let samples = parse(&body);
    for q in DASHBOARD_QUERIES {
        let hits = find(&samples, q.metric, &[(q.filter, "team-a")]);
        assert_eq!(hits.len(), 1, "{q:?} finds no series in\n{body}");
        for l in HAMI_LABELS.iter().chain(q.legend) {
            assert!(
                hits[0].labels.get(l).is_some_and(|v| !v.is_empty()),
                "{}: label {l} missing on {:?}",
                q.panel,
                hits[0]
            );
        }
    }
    let pod = [
        ("namespace", "team-a"),
        ("pod", "train-0"),
        ("container", "main"),
        ("vdevice_index", "0"),
        ("device_uuid", UUID),
    ];
    let one = |m: &str| {
        let hits = find(&samples, m, &pod);
        assert_eq!(hits.len(), 1, "{m} in\n{body}");
        value(hits[0])
    };
    // The container's data plus the context the file charges: at least what it holds.
    assert_eq!(one("hami_vgpu_memory_used_bytes"), (300 * MIB) as f64);
    assert_eq!(
        one("hami_container_device_memory_bytes"),
        (300 * MIB) as f64
    );
    assert_eq!(one("hami_vgpu_memory_buffer_bytes"), (300 * MIB) as f64);
    assert_eq!(one("hami_vgpu_memory_limit_bytes"), (1u64 << 30) as f64);
    assert_eq!(one("hami_container_device_utilization_ratio"), 40.0);
    assert!(one("hami_container_last_kernel_elapsed_seconds") < 60.0);
    // The legacy names only when asked.
    assert!(find(&samples, "vGPU_device_memory_usage_in_bytes", &[]).is_empty());
    // vgpu's own families carry the same pod labels, for joins.
    let own = find(
        &samples,
        "vgpu_device_memory_used_bytes",
        &[("pod", "train-0"), ("pod_uid", UID_A)],
    );
    assert_eq!(own.len(), 1, "{body}");
    assert_eq!(find(&samples, "vgpu_build_info", &[]).len(), 1);
}

#[test]
fn unlimited_gives_no_limit_series_and_an_unknown_pod_is_named_by_its_uid() {
    let node = Node::new();
    // No pod directory for UID_B: the kubelet's metadata is not available.
    let b = node.container(UID_B, "worker", None);
    let _held = hold(&b, 64 * MIB, 0);
    let e = node.start(&[]);
    let samples = parse(&http::get(&e.addr, "/metrics", T).unwrap().1);
    let used = find(
        &samples,
        "hami_vgpu_memory_used_bytes",
        &[("pod", UID_B), ("namespace", ""), ("container", "worker")],
    );
    assert_eq!(used.len(), 1);
    // used / limit has nothing to divide by: no series, never +Inf.
    assert!(find(&samples, "hami_vgpu_memory_limit_bytes", &[]).is_empty());
    assert!(find(&samples, "vgpu_device_memory_limit_bytes", &[]).is_empty());
    assert!(samples.iter().all(|s| !matches!(s.value,
        prometheus_parse::Value::Gauge(v) if !v.is_finite())));
}

#[test]
fn legacy_names_and_per_process_series_are_served_when_asked() {
    let node = Node::new();
    let _held = node.training_pod();
    let e = node.start(&["--legacy-metrics", "--per-process"]);
    let samples = parse(&http::get(&e.addr, "/metrics", T).unwrap().1);
    let l = [
        ("podnamespace", "team-a"),
        ("podname", "train-0"),
        ("ctrname", "main"),
        ("vdeviceid", "0"),
        ("deviceuuid", UUID),
    ];
    for m in [
        "vGPU_device_memory_usage_in_bytes",
        "vGPU_device_memory_limit_in_bytes",
        "Device_memory_desc_of_container",
        "Device_utilization_desc_of_container",
        "Device_last_kernel_of_container",
    ] {
        assert_eq!(find(&samples, m, &l).len(), 1, "{m}");
    }
    let desc = find(&samples, "Device_memory_desc_of_container", &l);
    assert_eq!(
        desc[0].labels.get("data"),
        Some((300 * MIB).to_string().as_str())
    );
    let pid = std::process::id().to_string();
    assert_eq!(
        find(
            &samples,
            "vgpu_process_alive",
            &[("pid", pid.as_str()), ("pod", "train-0")]
        )
        .len(),
        1
    );
    // And HAMi's families can be left to HAMi's own monitor.
    let e = node.start(&["--no-hami-metrics"]);
    let samples = parse(&http::get(&e.addr, "/metrics", T).unwrap().1);
    assert!(samples.iter().all(|s| !s.metric.starts_with("hami_")));
    assert!(!find(&samples, "vgpu_device_memory_used_bytes", &[]).is_empty());
}
