//! The shipped monitoring against a real Prometheus: the Grafana dashboard
//! (`deploy/monitoring/vgpu-dashboard.json`) and the alert rules
//! (`deploy/kubernetes/vgpu-alerts.yaml`).
//!
//! A simulated node runs hooked programs (libvgpu.so over the simulated driver) as containers
//! in the device plugins' host layout, each in a state an operator must see: at its limit and
//! refusing, spilling into host memory more and more (in share mode), without a memory limit,
//! above a lowered limit with its process killed, and a tenant's unreadable file. `vgpu
//! exporter` serves the node; Prometheus scrapes it as the Prometheus Operator would from the
//! shipped ServiceMonitor (honorLabels, the target labels the Operator adds) and evaluates the
//! shipped rules. Every dashboard query goes through Prometheus's HTTP API and must return
//! series carrying the labels its legend prints (and, per container, the tenant's namespace,
//! pod and container, not the exporter's); every alert must be active for exactly the
//! containers in that state. `promtool test rules` runs the rules' unit tests.
//!
//! Prometheus and promtool come from `cargo xtask test` ([`TOOLS_ENV`], Debian's package) or
//! `PATH`; without them the tests say so and pass, except under CI (`CI` set), where they fail.

mod common;
use common::*;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::Value;
use vgpu_testkit::compile_c;

/// Where `cargo xtask test` put `prometheus` and `promtool`.
const TOOLS_ENV: &str = "VGPU_TEST_PROMETHEUS_DIR";
/// How long Prometheus gets to show what a check waits for (it scrapes and evaluates every
/// second; a few seconds are enough).
const PATIENCE: Duration = Duration::from_secs(120);
const GPU: &str = "GPU-5a1e5130-0000-4000-8000-00000000a1e7";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `prometheus` and `promtool`, or `None` after saying why (a failure under CI).
fn tools() -> Option<(PathBuf, PathBuf)> {
    let dirs: Vec<PathBuf> = std::env::var_os(TOOLS_ENV)
        .map(PathBuf::from)
        .into_iter()
        .chain(
            std::env::var_os("PATH")
                .iter()
                .flat_map(std::env::split_paths),
        )
        .collect();
    let find = |name: &str| dirs.iter().map(|d| d.join(name)).find(|p| p.is_file());
    if let (Some(p), Some(t)) = (find("prometheus"), find("promtool")) {
        return Some((p, t));
    }
    let why = format!(
        "prometheus and promtool not found ({TOOLS_ENV} unset and not on PATH): run \
         `cargo xtask test`, which fetches Debian's package, or install it (apt-get install prometheus)"
    );
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false");
    assert!(!ci, "{why}; CI must run this test");
    eprintln!("SKIPPED: {why}");
    None
}

/// The PrometheusRule's `spec`, de-indented: a plain Prometheus rule file.
fn rule_file() -> String {
    let text = std::fs::read_to_string(repo().join("deploy/kubernetes/vgpu-alerts.yaml")).unwrap();
    let mut lines = text.lines().skip_while(|l| *l != "spec:");
    assert_eq!(lines.next(), Some("spec:"), "no top-level `spec:`");
    lines
        .map(|l| {
            assert!(
                l.is_empty() || l.starts_with("  "),
                "`spec` ends before {l:?}"
            );
            format!("{}\n", l.strip_prefix("  ").unwrap_or(l))
        })
        .collect()
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    let Some((_, promtool)) = tools() else { return };
    let dir = TempDir::new("vgpu-rules").unwrap();
    std::fs::write(dir.path().join("vgpu-alerts.rules.yaml"), rule_file()).unwrap();
    let tests = dir.path().join("vgpu-alerts.test.yaml");
    std::fs::copy(
        repo().join("deploy/monitoring/vgpu-alerts.test.yaml"),
        &tests,
    )
    .unwrap();
    for args in [
        ["check", "rules", "vgpu-alerts.rules.yaml"],
        ["test", "rules", "vgpu-alerts.test.yaml"],
    ] {
        let mut cmd = Command::new(&promtool);
        cmd.current_dir(dir.path()).args(args);
        run(cmd).assert_success();
    }
}

/// Allocates ALLOC MiB (must succeed), then loops: a SPIN µs kernel when SPIN > 0, every
/// EVERY-th round (until MAX tries) one more STEP MiB allocation (kept if granted), a PAUSE µs
/// sleep. Prints READY after ten rounds.
const PROGRAM: &str = r#"
#include "standalone.h"
#include <unistd.h>
int main(int argc, char **argv) {
  if (argc < 7) return 1;
  unsigned long long alloc = strtoull(argv[1], 0, 10) << 20, step = strtoull(argv[2], 0, 10) << 20;
  long every = atol(argv[3]), max = atol(argv[4]), pause_us = atol(argv[6]);
  unsigned long long ns = strtoull(argv[5], 0, 10) * 1000;
  if (load_driver()) return 3;
  CUresult (*cuMemAlloc_v2)(unsigned long long *, size_t);
  NEED(cuMemAlloc_v2)
  int dev; H ctx, mod, f, s; unsigned long long p;
  CHECK(cuInit(0)); CHECK(cuDeviceGet(&dev, 0));
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev)); CHECK(cuCtxSetCurrent(ctx));
  if (alloc) CHECK(cuMemAlloc_v2(&p, alloc));
  CHECK(cuModuleLoadData(&mod, "vgpusim-module: spin"));
  CHECK(cuModuleGetFunction(&f, mod, "spin"));
  CHECK(cuStreamCreate(&s, 0));
  void *args[] = {&ns};
  long tries = 0, granted = 0;
  for (long n = 0;; n++) {
    if (ns) { CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, args, 0)); CHECK(cuStreamSynchronize(s)); }
    if (step && n % every == 0 && tries < max) { tries++; if (!cuMemAlloc_v2(&p, step)) granted++; }
    if (n == 10) { printf("READY pid=%d granted=%ld of %ld\n", (int)getpid(), granted, tries); fflush(stdout); }
    usleep(pause_us);
  }
}
"#;

/// One container: its pod, its device-plugin environment, what its program does.
struct Tenant {
    namespace: &'static str,
    pod: &'static str,
    uid: &'static str,
    container: &'static str,
    env: &'static [(&'static str, &'static str)],
    /// The program's arguments: ALLOC STEP EVERY MAX SPIN PAUSE.
    args: [u32; 6],
}

/// Exactly at its 256 MiB limit (224 MiB + the 32 MiB context) and asking for 128 MiB more,
/// again and again: every ask refused. A cap-mode SM limit: on the turn board.
const REFUSING: Tenant = Tenant {
    namespace: "team-a",
    pod: "train-0",
    uid: "6a1f0e2c-9b7d-4c3e-8f10-00000000000a",
    container: "main",
    env: &[
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "256m"),
        ("CUDA_DEVICE_SM_LIMIT", "30"),
    ],
    args: [224, 128, 5, 1_000_000, 2000, 5000],
};

/// Share mode, and a spill allowance its growth (16 MiB every ~0.7 s, 1.6 GiB at most) goes
/// into once its 256 MiB are full: host-backed memory growing, never refused.
const SPILLING: Tenant = Tenant {
    namespace: "team-b",
    pod: "infer-0",
    uid: "6a1f0e2c-9b7d-4c3e-8f10-00000000000b",
    container: "server",
    env: &[
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "256m"),
        ("CUDA_DEVICE_SM_LIMIT", "20"),
        ("VGPU_SM_MODE", "share"),
        ("CUDA_TASK_PRIORITY", "0"),
        ("VGPU_HOST_SPILL", "2g"),
    ],
    args: [160, 16, 100, 100, 1000, 5000],
};

/// No limit at all (what no device-plugin container should be).
const UNLIMITED: Tenant = Tenant {
    namespace: "team-c",
    pod: "batch-0",
    uid: "6a1f0e2c-9b7d-4c3e-8f10-00000000000c",
    container: "worker",
    env: &[],
    args: [64, 0, 1, 0, 0, 50_000],
};

/// Holds 128 MiB; the test lowers its limit to 64 MiB and kills it: above its limit, with a
/// dead process's memory still counted.
const KILLED: Tenant = Tenant {
    namespace: "team-d",
    pod: "eval-0",
    uid: "6a1f0e2c-9b7d-4c3e-8f10-00000000000d",
    container: "main",
    env: &[("CUDA_DEVICE_MEMORY_LIMIT_0", "256m")],
    args: [128, 0, 1, 0, 0, 20_000],
};

/// A tenant whose usage file is garbage (a tenant can write anything there).
const GARBAGE: (&str, &str, &str, &str) = (
    "team-e",
    "broken-0",
    "6a1f0e2c-9b7d-4c3e-8f10-00000000000e",
    "main",
);

/// The node: `containers/<pod UID>_<container>/`, `pods/<ns>_<pod>_<UID>` (the kubelet's),
/// `vgpulock/` (the turn boards), the built program, the hook and the simulated driver.
struct Node {
    sim: SimNode,
    program: PathBuf,
}

/// A tenant's running program.
struct Running {
    child: Reaped,
    lines: Receiver<String>,
    log: PathBuf,
}

impl Node {
    fn new() -> Self {
        let sim = SimNode::new("vgpu-monitoring");
        for d in ["containers", "pods", "vgpulock"] {
            std::fs::create_dir_all(sim.path(d)).unwrap();
        }
        let includes = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vgpu-hook/tests/programs");
        let program = compile_c(
            sim.dir.path(),
            "program",
            PROGRAM,
            ["-O2", &format!("-I{}", includes.display())],
        );
        Node { sim, program }
    }

    /// The pod's kubelet directory and the container's usage-file directory; the file's path.
    fn lay_out(&self, namespace: &str, pod: &str, uid: &str, container: &str) -> PathBuf {
        std::fs::create_dir_all(self.sim.path(&format!("pods/{namespace}_{pod}_{uid}"))).unwrap();
        let dir = self.sim.path(&format!("containers/{uid}_{container}"));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(format!("{uid}.cache"))
    }

    fn start(&self, t: &Tenant) -> (Running, PathBuf) {
        let cache = self.lay_out(t.namespace, t.pod, t.uid, t.container);
        let log = self.sim.path(&format!("{}.log", t.pod));
        let mut cmd = Command::new(&self.program);
        cmd.args(t.args.map(|a| a.to_string()))
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LD_PRELOAD", &self.sim.hook)
            .env("LD_LIBRARY_PATH", self.sim.driver())
            .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &cache)
            .env("VGPU_TURN_DIR", self.sim.path("vgpulock"))
            .env("VGPU_SIM_UUIDS", GPU)
            .env("VGPU_SIM_TOTAL_MEM", "8g")
            .env("VGPU_SIM_CTX_OVERHEAD", "32m")
            .envs(t.env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        let mut child = cmd.spawn().expect("the workload program");
        let lines = stdout_lines(&mut child);
        let running = Running {
            child: Reaped(child),
            lines,
            log,
        };
        running.ready(t.pod);
        (running, cache)
    }
}

impl Running {
    fn ready(&self, name: &str) {
        match self.lines.recv_timeout(Duration::from_secs(30)) {
            Ok(l) if l.starts_with("READY") => {}
            other => panic!(
                "{name} never became ready ({other:?}); its log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            ),
        }
    }
}

/// A free local port (nothing listens on it once this returns).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running Prometheus, killed on drop.
struct Prometheus {
    _child: Reaped,
    addr: String,
    log: PathBuf,
}

impl Prometheus {
    /// Scrapes `exporter` as the Operator does from the shipped ServiceMonitor, plus an
    /// exporter that is not there (`gone`), every second, and evaluates `rules`.
    fn start(bin: &Path, dir: &Path, exporter: &str, gone: &str, rules: &Path) -> Self {
        // The Operator's scrape configuration for the ServiceMonitor: honor_labels, job = the
        // Service's name, the target labels it takes from Kubernetes service discovery, and
        // `node` from the ServiceMonitor's relabeling.
        let target = |addr: &str, pod: &str, node: &str| {
            format!(
                "      - targets: [\"{addr}\"]\n        labels: {{namespace: kube-system, \
                 pod: {pod}, container: exporter, service: vgpu-exporter, endpoint: metrics, \
                 node: {node}}}\n"
            )
        };
        let config = format!(
            "global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}\n\
             rule_files: [\"{}\"]\n\
             scrape_configs:\n  - job_name: vgpu-exporter\n    honor_labels: true\n    \
             static_configs:\n{}{}",
            rules.display(),
            target(exporter, "vgpu-exporter-sim", "sim-node"),
            target(gone, "vgpu-exporter-gone", "gone-node"),
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let log = dir.join("prometheus.log");
        let child = Command::new(bin)
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start prometheus");
        let p = Prometheus {
            _child: Reaped(child),
            addr,
            log,
        };
        p.wait_for("its API", || match get(&p.addr, "/-/ready") {
            Ok((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        });
        p
    }

    /// Polls `check` until it gives a value, failing the test with its last complaint after
    /// [`PATIENCE`].
    fn wait_for<T>(&self, what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
        let end = Instant::now() + PATIENCE;
        loop {
            let why = match check() {
                Ok(v) => return v,
                Err(why) => why,
            };
            assert!(
                Instant::now() < end,
                "Prometheus never showed {what}: {why}\nits log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `GET /api/v1/<path>`'s `data`.
    fn api(&self, path: &str) -> Value {
        let (status, body) = get(&self.addr, &format!("/api/v1/{path}")).unwrap();
        let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        assert!(
            status == 200 && v["status"] == "success",
            "{path}: {status} {body}"
        );
        v["data"].clone()
    }

    /// The series an instant query returns: their labels.
    fn query(&self, expr: &str) -> Vec<BTreeMap<String, String>> {
        let data = self.api(&format!("query?query={}", url_encode(expr)));
        assert_eq!(data["resultType"], "vector", "{expr}: {data}");
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| labels(&s["metric"]))
            .collect()
    }
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// `GET path` over HTTP/1.0 (so the answer is never chunked): status and body.
fn get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_owned()))
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One query of the dashboard: where it is, its expression, the labels its legend prints.
#[derive(Debug)]
struct Query {
    place: String,
    expr: String,
    legend: Vec<String>,
}

/// Every query of the dashboard's panels (rows' nested panels included), with Grafana's
/// variables filled in as "All" would.
fn dashboard_queries(dashboard: &Value) -> Vec<Query> {
    fn walk(panels: &Value, out: &mut Vec<Query>) {
        for p in panels.as_array().into_iter().flatten() {
            walk(&p["panels"], out);
            for t in p["targets"].as_array().into_iter().flatten() {
                let legend = t["legendFormat"].as_str().unwrap_or_default();
                out.push(Query {
                    place: format!("panel {:?} query {}", p["title"], t["refId"]),
                    expr: fill_variables(t["expr"].as_str().expect("a Prometheus query")),
                    legend: legend
                        .split("{{")
                        .skip(1)
                        .filter_map(|s| s.split_once("}}"))
                        .map(|(l, _)| l.trim().to_owned())
                        .collect(),
                });
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

fn fill_variables(expr: &str) -> String {
    let filled = expr
        .replace("$__rate_interval", "1m")
        .replace("$node", ".*")
        .replace("$namespace", ".*")
        .replace("$pod", ".*");
    assert!(
        !filled.contains('$'),
        "a variable the test does not know: {expr}"
    );
    filled
}

/// The dashboard's `label_values(EXPR, LABEL)` variables, as (name, EXPR, LABEL).
fn dashboard_variables(dashboard: &Value) -> Vec<(String, String, String)> {
    dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["type"] == "query")
        .map(|v| {
            let q = v["query"].as_str().expect("a label_values query");
            let inner = q
                .strip_prefix("label_values(")
                .and_then(|q| q.strip_suffix(')'))
                .unwrap_or_else(|| panic!("not label_values(EXPR, LABEL): {q}"));
            let (expr, label) = inner.rsplit_once(',').unwrap();
            (
                v["name"].as_str().unwrap().to_owned(),
                fill_variables(expr.trim()),
                label.trim().to_owned(),
            )
        })
        .collect()
}

/// What `series` lacks of what `q` needs, or `None` when it has it all: some series; every
/// label the legend prints; on a per-container query whose legend names the pod, the tenants'
/// own namespace, pod and container (the exporter's, had honor_labels been lost, are not).
fn lacks(
    q: &Query,
    series: &[BTreeMap<String, String>],
    tenants: &[(&str, &str, &str)],
) -> Option<String> {
    if series.is_empty() {
        return Some("no series".into());
    }
    for s in series {
        for l in &q.legend {
            if s.get(l).is_none_or(String::is_empty) {
                return Some(format!("label {l} missing in {s:?}"));
            }
        }
        if q.expr.contains("pod_uid!=\"\"") && q.legend.iter().any(|l| l == "pod") {
            let who = |k: &str| s.get(k).map_or("", String::as_str);
            let id = (who("namespace"), who("pod"), who("container"));
            if !tenants.contains(&id) {
                return Some(format!("{id:?} is no tenant container: {s:?}"));
            }
        }
    }
    None
}

#[test]
fn the_dashboard_and_the_alerts_work_on_a_real_prometheus() {
    let Some((prometheus, _)) = tools() else {
        return;
    };
    let node = Node::new();
    let (_refusing, _) = node.start(&REFUSING);
    let (_spilling, _) = node.start(&SPILLING);
    let (_unlimited, _) = node.start(&UNLIMITED);
    let (mut killed, killed_cache) = node.start(&KILLED);
    let mut lower = vgpu();
    cache_args(&mut lower, &["set-limit", "--memory", "64m"], &killed_cache);
    run(lower).assert_success();
    killed.child.kill();
    let (ns, pod, uid, ctr) = GARBAGE;
    std::fs::write(node.lay_out(ns, pod, uid, ctr), vec![0x5a; 4096]).unwrap();

    let mut exporter = vgpu();
    exporter.env("VGPU_TURN_DIR", node.sim.path("vgpulock"));
    let glob = node.sim.path("containers/*/*.cache");
    let pods = node.sim.path("pods");
    let exporter = Exporter::start(
        exporter,
        &[
            "--cache",
            glob.to_str().unwrap(),
            "--pod-logs",
            pods.to_str().unwrap(),
        ],
    );
    let rules = node.sim.path("vgpu-alerts.rules.yaml");
    std::fs::write(&rules, rule_file()).unwrap();
    let gone = format!("127.0.0.1:{}", free_port());
    let prom = Prometheus::start(
        &prometheus,
        node.sim.dir.path(),
        &exporter.addr,
        &gone,
        &rules,
    );

    let tenants: Vec<(&str, &str, &str)> = [REFUSING, SPILLING, UNLIMITED, KILLED]
        .iter()
        .map(|t| (t.namespace, t.pod, t.container))
        .chain([(ns, pod, ctr)])
        .collect();
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/monitoring/vgpu-dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 20, "{queries:#?}");
    // One deadline for all of them: a query that has its series keeps them.
    let mut waiting: Vec<&Query> = queries.iter().collect();
    prom.wait_for("every dashboard query's series with its labels", || {
        let mut why = Vec::new();
        waiting.retain(|q| match lacks(q, &prom.query(&q.expr), &tenants) {
            None => false,
            Some(w) => {
                why.push(format!("\n  {} ({}): {w}", q.place, q.expr));
                true
            }
        });
        if why.is_empty() {
            Ok(())
        } else {
            Err(why.concat())
        }
    });
    for (name, expr, label) in dashboard_variables(&dashboard) {
        let values: BTreeSet<String> = prom
            .query(&format!("group by ({label}) ({expr})"))
            .into_iter()
            .filter_map(|s| s.get(&label).cloned())
            .collect();
        assert!(
            !values.is_empty(),
            "variable {name}: no values of {label} in {expr}"
        );
        if expr.contains("pod_uid!=\"\"") {
            let own: BTreeSet<String> = tenants
                .iter()
                .map(|(n, p, _)| if label == "namespace" { n } else { p }.to_string())
                .collect();
            assert!(
                values.is_subset(&own),
                "variable {name}: {values:?} beyond {own:?}"
            );
        }
    }

    // Every alert the rules define is active (pending or firing) for exactly the containers
    // in its state, named by the label that identifies them.
    let expected: BTreeMap<&str, (&str, BTreeSet<String>)> = [
        (
            "VgpuContainerAtMemoryLimit",
            ("pod", REFUSING.pod.to_owned()),
        ),
        (
            "VgpuHostBackedMemoryGrowing",
            ("pod", SPILLING.pod.to_owned()),
        ),
        (
            "VgpuContainerWithoutMemoryLimit",
            ("pod", UNLIMITED.pod.to_owned()),
        ),
        ("VgpuMemoryAboveLimit", ("pod", KILLED.pod.to_owned())),
        ("VgpuUsageFileUnreadable", ("pod", pod.to_owned())),
        ("VgpuExporterDown", ("instance", gone.clone())),
    ]
    .into_iter()
    .map(|(alert, (label, who))| (alert, (label, BTreeSet::from([who]))))
    .collect();
    let rules = prom.api("rules");
    let defined: BTreeSet<String> = rules["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .map(|r| {
            assert_eq!(r["health"], "ok", "{r}");
            r["name"].as_str().unwrap().to_owned()
        })
        .collect();
    let names: BTreeSet<String> = expected.keys().map(|s| s.to_string()).collect();
    assert_eq!(defined, names, "each alert needs its case here");
    prom.wait_for(&format!("the expected alerts {expected:?}"), || {
        let mut active: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for a in prom.api("alerts")["alerts"].as_array().unwrap() {
            let l = labels(&a["labels"]);
            let name = l["alertname"].clone();
            let key = expected.get(name.as_str()).map_or("pod", |(k, _)| k);
            active
                .entry(name)
                .or_default()
                .insert(l.get(key).cloned().unwrap_or_default());
        }
        let matches = expected
            .iter()
            .all(|(name, (_, who))| active.get(*name) == Some(who))
            && active.len() == expected.len();
        if matches {
            Ok(())
        } else {
            Err(format!("active: {active:?}"))
        }
    });
}
