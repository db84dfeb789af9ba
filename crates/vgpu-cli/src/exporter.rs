//! `vgpu exporter`: Prometheus text metrics of one usage file or every file a glob matches.
//!
//! Every scrape re-expands the glob and reads each file through a read-only snapshot, so
//! containers that come and go are picked up without a restart.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use crate::Failure;
use crate::cli::{CacheArg, ExporterArgs};
use crate::glob;
use crate::http::{self, Request, Response};
use crate::report::{self, StatusReport};

/// The files to scrape: a glob's matches, or one literal path (kept even while missing, so
/// `vgpu_up` says it is down rather than the series vanishing).
pub fn scrape_targets(pattern: &str) -> Result<Vec<PathBuf>, String> {
    if glob::has_magic(pattern) {
        glob::expand(pattern)
    } else {
        Ok(vec![PathBuf::from(pattern)])
    }
}

/// Escape a label value (backslash, quote, newline).
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Metric families in output order: name, type, help.
const FAMILIES: &[(&str, &str, &str)] = &[
    (
        "vgpu_up",
        "gauge",
        "1 if the usage file was read, 0 if it is missing or invalid.",
    ),
    (
        "vgpu_scrape_errors_total",
        "counter",
        "Failed reads of the usage file since the exporter started.",
    ),
    (
        "vgpu_exporter_files",
        "gauge",
        "Usage files matched by the glob at this scrape.",
    ),
    (
        "vgpu_device_memory_limit_bytes",
        "gauge",
        "Device memory limit in bytes (0 = unlimited).",
    ),
    (
        "vgpu_device_memory_used_bytes",
        "gauge",
        "Device memory in use by all processes of the file, bytes.",
    ),
    (
        "vgpu_device_memory_class_bytes",
        "gauge",
        "Device memory in use by class (context, module, data), bytes.",
    ),
    (
        "vgpu_device_host_backed_bytes",
        "gauge",
        "Host memory standing in for device memory at the device's addresses \
         (CUDA_OVERSUBSCRIBE, VGPU_HOST_SPILL), bytes; not in the device memory figures.",
    ),
    (
        "vgpu_device_host_spill_bytes",
        "gauge",
        "Host-backed bytes allowed beyond the limit (VGPU_HOST_SPILL; 0 = none).",
    ),
    (
        "vgpu_device_sm_limit_percent",
        "gauge",
        "SM (compute) limit in percent (0 = unlimited).",
    ),
    (
        "vgpu_device_sm_utilization_percent",
        "gauge",
        "Sum of the processes' SM utilization, percent.",
    ),
    (
        "vgpu_device_processes",
        "gauge",
        "Processes registered in the file using the device.",
    ),
    (
        "vgpu_device_turn_containers",
        "gauge",
        "Limited containers taking turns on the GPU (its turn board; 0 = no turns).",
    ),
    (
        "vgpu_process_memory_used_bytes",
        "gauge",
        "Device memory in use by one process, bytes.",
    ),
    (
        "vgpu_process_sm_utilization_percent",
        "gauge",
        "SM utilization of one process on one device, percent.",
    ),
    (
        "vgpu_process_alive",
        "gauge",
        "1 if the process exists, 0 if it is dead but still counted.",
    ),
];

/// The result of reading one file at one scrape.
pub type ScrapeResult = (String, Result<StatusReport, String>);

/// Render the Prometheus text format for the scraped files.
pub fn render_metrics(
    results: &[ScrapeResult],
    errors_total: &BTreeMap<String, u64>,
    glob_error: Option<&str>,
) -> String {
    let mut samples: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut add = |name: &'static str, labels: String, value: u64| {
        samples
            .entry(name)
            .or_default()
            .push(format!("{name}{{{labels}}} {value}"));
    };
    for (cache, result) in results {
        let c = format!("cache=\"{}\"", esc(cache));
        add("vgpu_up", c.clone(), u64::from(result.is_ok()));
        add(
            "vgpu_scrape_errors_total",
            c.clone(),
            errors_total.get(cache).copied().unwrap_or(0),
        );
        let Ok(report) = result else { continue };
        for d in &report.devices {
            let l = format!(
                "{c},device=\"{}\",uuid=\"{}\"",
                d.index,
                esc(d.uuid.as_deref().unwrap_or(""))
            );
            add(
                "vgpu_device_memory_limit_bytes",
                l.clone(),
                d.memory_limit_bytes.unwrap_or(0),
            );
            add(
                "vgpu_device_memory_used_bytes",
                l.clone(),
                d.memory_used_bytes,
            );
            for (class, v) in [
                ("context", d.context_bytes),
                ("module", d.module_bytes),
                ("data", d.data_bytes),
            ] {
                add(
                    "vgpu_device_memory_class_bytes",
                    format!("{l},class=\"{class}\""),
                    v,
                );
            }
            add(
                "vgpu_device_host_backed_bytes",
                l.clone(),
                d.host_backed_bytes,
            );
            add(
                "vgpu_device_host_spill_bytes",
                l.clone(),
                d.host_spill_bytes,
            );
            add(
                "vgpu_device_sm_limit_percent",
                l.clone(),
                d.sm_limit_percent.unwrap_or(0),
            );
            add(
                "vgpu_device_sm_utilization_percent",
                l.clone(),
                d.sm_utilization_percent,
            );
            let users = report
                .processes
                .iter()
                .filter(|p| p.devices.iter().any(|pd| pd.index == d.index))
                .count();
            add("vgpu_device_processes", l.clone(), users as u64);
            add("vgpu_device_turn_containers", l, d.turns.len() as u64);
        }
        for p in &report.processes {
            let host = p.host_pid.map_or_else(String::new, |h| h.to_string());
            let pl = format!("{c},pid=\"{}\",host_pid=\"{host}\"", p.pid);
            add("vgpu_process_alive", pl.clone(), u64::from(p.alive));
            for d in &p.devices {
                let l = format!("{pl},device=\"{}\"", d.index);
                add(
                    "vgpu_process_memory_used_bytes",
                    l.clone(),
                    d.memory_used_bytes,
                );
                add(
                    "vgpu_process_sm_utilization_percent",
                    l,
                    d.sm_utilization_percent,
                );
            }
        }
    }
    let mut out = String::new();
    if let Some(e) = glob_error {
        // Comments are ignored by Prometheus but visible to a person reading the page.
        let _ = writeln!(out, "# glob error: {}", e.replace('\n', " "));
    }
    for (cache, result) in results {
        if let Err(e) = result {
            let _ = writeln!(out, "# error reading {cache}: {}", e.replace('\n', " "));
        }
    }
    for (name, kind, help) in FAMILIES {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        if *name == "vgpu_exporter_files" {
            let _ = writeln!(out, "vgpu_exporter_files {}", results.len());
        }
        for line in samples.get(name).into_iter().flatten() {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

/// The exporter's state shared by connection threads.
#[derive(Debug)]
pub struct Exporter {
    pattern: String,
    errors_total: Mutex<BTreeMap<String, u64>>,
}

impl Exporter {
    /// An exporter for `pattern` (a path or a glob).
    pub fn new(pattern: String) -> Self {
        Self {
            pattern,
            errors_total: Mutex::new(BTreeMap::new()),
        }
    }

    /// Read every target now and render the metrics page.
    pub fn scrape(&self) -> String {
        let (targets, glob_error) = match scrape_targets(&self.pattern) {
            Ok(t) => (t, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let results: Vec<ScrapeResult> = targets
            .iter()
            .map(|p| (p.display().to_string(), report::read(p)))
            .collect();
        let mut errors = self.errors_total.lock().unwrap_or_else(|e| e.into_inner());
        for (cache, r) in &results {
            if r.is_err() {
                *errors.entry(cache.clone()).or_insert(0) += 1;
            }
        }
        render_metrics(&results, &errors, glob_error.as_deref())
    }

    /// Answer one HTTP request.
    pub fn respond(&self, req: &Request) -> Response {
        if req.method != "GET" && req.method != "HEAD" {
            return Response::text(405, "only GET and HEAD\n");
        }
        match req.path.as_str() {
            "/metrics" => Response {
                status: 200,
                content_type: "text/plain; version=0.0.4; charset=utf-8",
                body: self.scrape(),
            },
            "/" => Response {
                status: 200,
                content_type: "text/html; charset=utf-8",
                body: format!(
                    "<!doctype html><html><head><title>vgpu exporter</title></head><body>\
                     <h1>vgpu exporter</h1><p>Usage files: <code>{}</code></p>\
                     <p><a href=\"/metrics\">Metrics</a></p></body></html>\n",
                    self.pattern
                        .replace('&', "&amp;")
                        .replace('<', "&lt;")
                        .replace('>', "&gt;")
                ),
            },
            _ => Response::text(404, "not found; try /metrics\n"),
        }
    }
}

/// `vgpu exporter`: bind, print the address, serve until killed.
pub fn exporter(args: &ExporterArgs) -> Result<ExitCode, Failure> {
    let pattern = match &args.cache {
        Some(p) if p.trim().is_empty() => return Err(Failure::usage("--cache is empty")),
        Some(p) => p.clone(),
        None => report::cache_path(&CacheArg { cache: None })
            .display()
            .to_string(),
    };
    // Fail now on a glob that can never work rather than at every scrape.
    if let Err(e) = scrape_targets(&pattern) {
        return Err(Failure::msg(format!("--cache {pattern}: {e}")));
    }
    let listener = TcpListener::bind(&args.listen)
        .map_err(|e| Failure::msg(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::msg(format!("listening socket: {e}")))?;
    println!("vgpu exporter: serving http://{addr}/metrics for {pattern}");
    let _ = std::io::stdout().flush();
    let exporter = Arc::new(Exporter::new(pattern));
    let err = http::serve(
        listener,
        Arc::new(move |req: &Request| exporter.respond(req)),
    );
    Err(Failure::msg(format!("accept failed: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_grouped_by_family_with_labels() {
        let mut with_turns = crate::report::tests::sample();
        with_turns.devices[0].turns = vec![
            crate::report::TurnTenantStatus {
                key: "1".into(),
                this_container: true,
                sm_limit_percent: 50,
                launch_us: 47,
                age_ms: 10,
            };
            2
        ];
        let results = vec![
            ("/tmp/x.cache".to_owned(), Ok(with_turns)),
            (
                "/tmp/bad\"name".to_owned(),
                Err("not a usage file".to_owned()),
            ),
        ];
        let mut errors = BTreeMap::new();
        errors.insert("/tmp/bad\"name".to_owned(), 3);
        let text = render_metrics(&results, &errors, None);
        assert!(
            text.contains("vgpu_up{cache=\"/tmp/x.cache\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("vgpu_up{cache=\"/tmp/bad\\\"name\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("vgpu_scrape_errors_total{cache=\"/tmp/bad\\\"name\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("vgpu_exporter_files 2\n"), "{text}");
        assert!(
            text.contains("# error reading /tmp/bad\"name: not a usage file\n"),
            "{text}"
        );
        assert!(text.contains(
            "vgpu_device_memory_limit_bytes{cache=\"/tmp/x.cache\",device=\"0\",uuid=\"GPU-00000000-0000-0000-0000-000000000001\"} 1073741824\n"
        ), "{text}");
        assert!(text.contains(",class=\"data\"} 805306368\n"), "{text}");
        assert!(text.contains("vgpu_device_turn_containers{cache=\"/tmp/x.cache\",device=\"0\",uuid=\"GPU-00000000-0000-0000-0000-000000000001\"} 2\n"), "{text}");
        assert!(text.contains("vgpu_process_memory_used_bytes{cache=\"/tmp/x.cache\",pid=\"42\",host_pid=\"4242\",device=\"0\"} 872415232\n"), "{text}");
        assert!(
            text.contains("vgpu_process_alive{cache=\"/tmp/x.cache\",pid=\"7\",host_pid=\"\"} 0\n"),
            "{text}"
        );
        // Every sample line belongs to the family declared just before it.
        let mut current = "";
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                current = rest.split(' ').next().unwrap();
            } else if !line.starts_with('#') {
                assert!(
                    line.starts_with(current),
                    "{line} outside its family {current}"
                );
            }
        }
    }

    #[test]
    fn unknown_paths_and_methods_get_errors() {
        let e = Exporter::new("/nonexistent/x.cache".into());
        let get = |path: &str| Request {
            method: "GET".into(),
            path: path.into(),
        };
        assert_eq!(e.respond(&get("/nope")).status, 404);
        assert_eq!(
            e.respond(&Request {
                method: "POST".into(),
                path: "/metrics".into()
            })
            .status,
            405
        );
        assert_eq!(e.respond(&get("/")).status, 200);
        let m = e.respond(&get("/metrics"));
        assert!(
            m.body.contains("vgpu_up{cache=\"/nonexistent/x.cache\"} 0"),
            "{}",
            m.body
        );
        assert!(
            e.respond(&get("/metrics"))
                .body
                .contains("vgpu_scrape_errors_total{cache=\"/nonexistent/x.cache\"} 2")
        );
    }
}
