//! `vgpu exporter` scraped over loopback: an ephemeral port, bounded waits, bad requests.

mod common;
use common::*;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::Duration;

use vgpu_cli::http;

const T: Duration = Duration::from_secs(5);

/// A running exporter, killed on drop.
#[derive(Debug)]
pub struct Exporter {
    child: Child,
    pub addr: String,
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `vgpu exporter --listen 127.0.0.1:0 --cache PATTERN` and read the address it prints.
pub fn start(pattern: &str) -> Exporter {
    let mut cmd = vgpu();
    cmd.args(["exporter", "--listen", "127.0.0.1:0", "--cache", pattern])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(T).expect("exporter printed its address");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    Exporter { child, addr }
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
