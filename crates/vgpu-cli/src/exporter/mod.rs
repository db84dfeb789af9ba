//! `vgpu exporter`: Prometheus text metrics of one usage file or every file a glob matches.
//!
//! Every scrape re-expands the glob, re-reads the kubelet's pod directories and reads each
//! file through the node-side reader ([`usage_table::read`]), so containers that come and go are
//! picked up without a restart. The page ([`render`]) serves HAMi's families for containers
//! in the device plugins' layout ([`pods`]) beside vgpu's own.

pub mod pods;
pub mod render;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use crate::Failure;
use crate::cli::ExporterArgs;
use crate::glob;
use crate::http::{self, Request, Response};
use crate::usage_table;

pub use render::{Options, Scraped};

/// The files to scrape: a glob's matches, or one literal path (kept even while missing, so
/// `vgpu_up` says it is down rather than the series vanishing).
pub fn scrape_targets(pattern: &str) -> Result<Vec<PathBuf>, String> {
    if glob::has_magic(pattern) {
        glob::expand(pattern)
    } else {
        Ok(vec![PathBuf::from(pattern)])
    }
}

/// The failed reads per file after a scrape: `previous` counts carried over, one more for each
/// file that failed now. Only the files of this scrape are kept (a file renamed or removed is
/// forgotten, and comes back from 0), so the map never holds more names than one scrape
/// matches (at most [`glob::MAX_MATCHES`]) whatever a tenant renames.
fn count_errors(mut previous: BTreeMap<String, u64>, scraped: &[Scraped]) -> BTreeMap<String, u64> {
    scraped
        .iter()
        .filter_map(|f| {
            let before = previous.remove(&f.cache).unwrap_or(0);
            let now = before + u64::from(f.result.is_err());
            (now > 0).then(|| (f.cache.clone(), now))
        })
        .collect()
}

/// The exporter's state shared by connection threads.
#[derive(Debug)]
pub struct Exporter {
    pattern: String,
    pod_logs: PathBuf,
    dra_checkpoint: PathBuf,
    options: Options,
    /// Failed reads per file, for the files of the last scrape only ([`count_errors`]).
    errors_total: Mutex<BTreeMap<String, u64>>,
}

impl Exporter {
    /// An exporter for `pattern` (a path or a glob), with pod metadata from `pod_logs` and
    /// the DRA driver's `dra_checkpoint`.
    pub fn new(
        pattern: String,
        pod_logs: PathBuf,
        dra_checkpoint: PathBuf,
        options: Options,
    ) -> Self {
        Self {
            pattern,
            pod_logs,
            dra_checkpoint,
            options,
            errors_total: Mutex::new(BTreeMap::new()),
        }
    }

    /// Read every target now and render the metrics page.
    pub fn scrape(&self) -> String {
        let (targets, glob_error) = match scrape_targets(&self.pattern) {
            Ok(t) => (t, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let pods = pods::PodIndex::read(&self.pod_logs, Some(&self.dra_checkpoint));
        let scraped: Vec<Scraped> = targets
            .iter()
            .map(|p| Scraped {
                cache: p.display().to_string(),
                identity: pods.identify(p),
                result: usage_table::read(p),
            })
            .collect();
        let mut errors = self.errors_total.lock().unwrap_or_else(|e| e.into_inner());
        *errors = count_errors(std::mem::take(&mut *errors), &scraped);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        render::render(&scraped, &errors, glob_error.as_deref(), self.options, now)
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
        None => crate::usage_file::default_cache_path()
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
    let options = Options {
        hami: !args.no_hami_metrics,
        legacy: args.legacy_metrics,
        per_process: args.per_process,
    };
    let exporter = Arc::new(Exporter::new(
        pattern,
        args.pod_logs.clone(),
        args.dra_checkpoint.clone(),
        options,
    ));
    let err = http::serve(
        listener,
        Arc::new(move |req: &Request| exporter.respond(req)),
    );
    Err(Failure::msg(format!("accept failed: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report;
    use render::render;
    use std::path::Path;

    fn scraped(cache: &str, result: Result<report::StatusReport, String>) -> Scraped {
        Scraped {
            cache: cache.to_owned(),
            identity: pods::PodIndex::default().identify(Path::new(cache)),
            result,
        }
    }

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
                share: None,
            };
            2
        ];
        // This container in share mode.
        with_turns.devices[0].turns[0].share = Some(crate::report::tests::sample_share());
        with_turns.swap_kept_host_bytes = Some(48 << 20);
        with_turns.processes[0].swap_kept_host_bytes = Some(48 << 20);
        let results = vec![
            scraped("/tmp/x.cache", Ok(with_turns)),
            scraped("/tmp/bad\"name", Err("not a usage file".to_owned())),
        ];
        let mut errors = BTreeMap::new();
        errors.insert("/tmp/bad\"name".to_owned(), 3);
        let opts = Options {
            per_process: true,
            ..Options::default()
        };
        let text = render(&results, &errors, None, opts, 0);
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
        assert!(text.contains("vgpu_device_sm_share_percent{cache=\"/tmp/x.cache\",device=\"0\",uuid=\"GPU-00000000-0000-0000-0000-000000000001\",priority=\"0\"} 30\n"), "{text}");
        assert!(text.contains("vgpu_device_sm_borrowed_milliseconds_total{cache=\"/tmp/x.cache\",device=\"0\",uuid=\"GPU-00000000-0000-0000-0000-000000000001\"} 3400\n"), "{text}");
        assert!(text.contains("vgpu_process_memory_used_bytes{cache=\"/tmp/x.cache\",pid=\"42\",host_pid=\"4242\",device=\"0\"} 872415232\n"), "{text}");
        assert!(
            text.contains("vgpu_process_alive{cache=\"/tmp/x.cache\",pid=\"7\",host_pid=\"\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "vgpu_process_swapped_out{cache=\"/tmp/x.cache\",pid=\"7\",host_pid=\"\"} 0\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("vgpu_swap_kept_host_bytes{cache=\"/tmp/x.cache\"} 50331648\n"),
            "{text}"
        );
        assert!(text.contains("vgpu_process_swap_kept_host_bytes{cache=\"/tmp/x.cache\",pid=\"42\",host_pid=\"4242\"} 50331648\n"), "{text}");
        assert!(text.contains("vgpu_build_info{version=\""), "{text}");
        // A file outside the plugins' layout has no pod: no HAMi series for it.
        assert!(!text.contains("hami_vgpu_memory_used_bytes{"), "{text}");
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

    /// The families' help texts go out as they are: nothing in them needs the escapes of
    /// `# HELP` (backslash, line end).
    #[test]
    fn help_texts_need_no_escaping() {
        let all = Options {
            hami: true,
            legacy: true,
            per_process: true,
        };
        let text = render(&[], &BTreeMap::new(), None, all, 0);
        for line in text.lines().filter(|l| l.starts_with("# HELP ")) {
            assert!(!line.contains('\\') && !line.chars().any(crate::untrusted::is_unsafe));
        }
    }

    /// A file or a process that does not say what it keeps for swap-outs (an older library)
    /// has no sample, rather than a 0 nobody measured.
    #[test]
    fn kept_host_memory_nobody_said_has_no_sample() {
        let mut r = crate::report::tests::sample();
        r.swap_kept_host_bytes = None;
        r.processes[0].swap_kept_host_bytes = None;
        let opts = Options {
            per_process: true,
            ..Options::default()
        };
        let text = render(
            &[scraped("/tmp/x.cache", Ok(r))],
            &BTreeMap::new(),
            None,
            opts,
            0,
        );
        assert!(text.contains("# HELP vgpu_swap_kept_host_bytes "), "{text}");
        assert!(!text.contains("vgpu_swap_kept_host_bytes{"), "{text}");
        assert!(
            !text.contains("vgpu_process_swap_kept_host_bytes{cache=\"/tmp/x.cache\",pid=\"42\""),
            "{text}"
        );
    }

    #[test]
    fn per_process_series_are_opt_in() {
        let results = vec![scraped("/tmp/x.cache", Ok(crate::report::tests::sample()))];
        let text = render(&results, &BTreeMap::new(), None, Options::default(), 0);
        assert!(!text.contains("vgpu_process_"), "{text}");
        assert!(text.contains("vgpu_device_dead_processes{"), "{text}");
    }

    /// A tenant renaming an unreadable file again and again must not grow the exporter: the
    /// error counts keep only the files of the last scrape (they kept every name ever seen).
    #[test]
    fn error_counts_forget_files_that_are_gone() {
        let dir = crate::private_tempdir("vgpu-exp-forget").unwrap();
        let e = Exporter::new(
            format!("{}/*.cache", dir.path().display()),
            "/nonexistent/pods".into(),
            "/nonexistent/checkpoint.json".into(),
            Options::default(),
        );
        let mut bad = dir.path().join("bad0.cache");
        std::fs::write(&bad, b"").unwrap();
        for i in 1..=50 {
            assert!(e.scrape().contains("vgpu_scrape_errors_total{cache="));
            let next = dir.path().join(format!("bad{i}.cache"));
            std::fs::rename(&bad, &next).unwrap();
            bad = next;
        }
        let tracked = || e.errors_total.lock().unwrap().len();
        assert_eq!(tracked(), 1);
        std::fs::remove_file(&bad).unwrap();
        e.scrape();
        assert_eq!(tracked(), 0);
    }

    #[test]
    fn unknown_paths_and_methods_get_errors() {
        let e = Exporter::new(
            "/nonexistent/x.cache".into(),
            "/nonexistent/pods".into(),
            "/nonexistent/checkpoint.json".into(),
            Options::default(),
        );
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
