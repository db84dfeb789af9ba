//! Just enough HTTP/1.x for a metrics endpoint: one request per connection, bounded
//! request size, and never a panic on what a client sends.
//!
//! What a client can cost the server is a connection slot and a render; what it controls is
//! how long it takes to send its request and to take the answer. So each connection has one
//! deadline for its whole request head ([`HEAD_DEADLINE`], however the bytes trickle in) and
//! one for its whole answer ([`ANSWER_DEADLINE`]); and when all [`MAX_CONNECTIONS`] slots are
//! taken, a newcomer takes the slot of the connection that has waited on its client the
//! longest, once that one has had [`DISPLACE_AFTER`]. A scraper that sends its request at once
//! and reads the answer, as Prometheus does, is done long before it could be displaced; slow
//! clients displace one another. A connection busy rendering is never displaced: a newcomer
//! is refused (503) only while every slot renders.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest request head accepted (request line + headers).
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// How long a client has to send its whole request head (408 after).
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long a client has to take the whole answer (Prometheus's default scrape timeout).
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(10);
/// How long a connection is safe from being displaced by a newcomer when all slots are taken:
/// far longer than a scraper takes to send its request.
pub const DISPLACE_AFTER: Duration = Duration::from_secs(1);

/// A parsed request line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `HEAD`, ...
    pub method: String,
    /// The path without the query string.
    pub path: String,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl Response {
    /// A plain-text answer.
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Read the request head: until the blank line, at most [`MAX_REQUEST_BYTES`].
pub fn read_request(stream: &mut impl Read) -> Result<Request, Response> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            break;
        }
        if buf.len() >= MAX_REQUEST_BYTES {
            return Err(Response::text(413, "request too large\n"));
        }
        match stream.read(&mut chunk) {
            Ok(0) if buf.is_empty() => return Err(Response::text(400, "empty request\n")),
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Response::text(408, "request timeout\n"));
            }
            Err(_) => return Err(Response::text(400, "unreadable request\n")),
        }
    }
    let head = String::from_utf8_lossy(&buf);
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Response::text(400, "malformed request line\n"));
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Err(Response::text(400, "malformed request line\n"));
    }
    let path = target.split(['?', '#']).next().unwrap_or("/").to_owned();
    Ok(Request {
        method: method.to_owned(),
        path,
    })
}

/// Write `response` (no body for HEAD) and close.
pub fn write_response(
    stream: &mut impl Write,
    response: &Response,
    head_only: bool,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(response.body.as_bytes())?;
    }
    stream.flush()
}

/// A stream whose reads (or writes) all end by one instant: each waits at most the time left,
/// so a client trickling bytes cannot stretch the deadline.
struct Deadlined<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Deadlined<'_> {
    fn time_left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.time_left()?))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.time_left()?))?;
        let mut stream = self.stream;
        stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let mut stream = self.stream;
        stream.flush()
    }
}

/// One connection being served.
#[derive(Debug)]
struct Slot {
    id: u64,
    accepted: Instant,
    /// Waiting on its client (for the request, or to take the answer), not rendering.
    waiting_on_client: bool,
    /// The connection, to shut down if it is displaced.
    stream: TcpStream,
}

/// Which of the connections `(accepted, waiting_on_client)` a newcomer displaces at `now`
/// when every slot is taken: the one accepted first among those waiting on their client that
/// have had [`DISPLACE_AFTER`]; `None` when there is none (the newcomer is refused).
fn to_displace(slots: impl IntoIterator<Item = (Instant, bool)>, now: Instant) -> Option<usize> {
    slots
        .into_iter()
        .enumerate()
        .filter(|(_, (accepted, waiting))| {
            *waiting && now.saturating_duration_since(*accepted) >= DISPLACE_AFTER
        })
        .min_by_key(|(_, (accepted, _))| *accepted)
        .map(|(i, _)| i)
}

/// The connections being served, at most [`MAX_CONNECTIONS`].
#[derive(Debug, Default)]
struct Connections {
    slots: Mutex<Vec<Slot>>,
    next_id: AtomicU64,
}

impl Connections {
    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for `stream`, accepted at `now`, displacing another if all are taken
    /// ([`to_displace`]); `None`: refuse it.
    fn admit(&self, stream: &TcpStream, now: Instant) -> Option<u64> {
        let handle = stream.try_clone().ok()?;
        let mut slots = self.slots();
        if slots.len() >= MAX_CONNECTIONS {
            let i = to_displace(slots.iter().map(|s| (s.accepted, s.waiting_on_client)), now)?;
            let displaced = slots.swap_remove(i);
            // Its thread's read or write fails now, and it ends.
            let _ = displaced.stream.shutdown(Shutdown::Both);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        slots.push(Slot {
            id,
            accepted: now,
            waiting_on_client: true,
            stream: handle,
        });
        Some(id)
    }

    /// Marks connection `id` waiting on its client or rendering; false if it was displaced.
    fn set_waiting(&self, id: u64, waiting_on_client: bool) -> bool {
        let mut slots = self.slots();
        let slot = slots.iter_mut().find(|s| s.id == id);
        slot.map(|s| s.waiting_on_client = waiting_on_client)
            .is_some()
    }

    /// Frees connection `id`'s slot (nothing if it was displaced).
    fn release(&self, id: u64) {
        self.slots().retain(|s| s.id != id);
    }
}

fn handle(
    stream: &TcpStream,
    accepted: Instant,
    id: u64,
    connections: &Connections,
    handler: &(dyn Fn(&Request) -> Response + Send + Sync),
) {
    let head = &mut Deadlined {
        stream,
        until: accepted + HEAD_DEADLINE,
    };
    let (response, head_only) = match read_request(head) {
        Err(r) => (r, false),
        Ok(req) => {
            if !connections.set_waiting(id, false) {
                return;
            }
            let head_only = req.method == "HEAD";
            // A bug in rendering must cost one request, not the server.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&req)))
                .unwrap_or_else(|_| Response::text(500, "internal error\n"));
            connections.set_waiting(id, true);
            (r, head_only)
        }
    };
    let answer = &mut Deadlined {
        stream,
        until: Instant::now() + ANSWER_DEADLINE,
    };
    let _ = write_response(answer, &response, head_only);
    let _ = stream.shutdown(Shutdown::Both);
}

/// Serve forever on `listener`: a thread per connection, at most [`MAX_CONNECTIONS`] at once.
pub fn serve(
    listener: TcpListener,
    handler: Arc<dyn Fn(&Request) -> Response + Send + Sync>,
) -> std::io::Error {
    let connections = Arc::new(Connections::default());
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            // Transient (EMFILE, ECONNABORTED): back off briefly and keep serving.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if e.raw_os_error()
                    .is_some_and(|c| c == libc::EINVAL || c == libc::EBADF) =>
            {
                return e;
            }
            Err(_) => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let accepted = Instant::now();
        let Some(id) = connections.admit(&stream, accepted) else {
            let mut stream = stream;
            let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = write_response(
                &mut stream,
                &Response::text(503, "too many connections\n"),
                false,
            );
            continue;
        };
        let handler = Arc::clone(&handler);
        let in_thread = Arc::clone(&connections);
        let spawned = std::thread::Builder::new()
            .name("vgpu-http".into())
            .spawn(move || {
                handle(&stream, accepted, id, &in_thread, handler.as_ref());
                in_thread.release(id);
            });
        if spawned.is_err() {
            connections.release(id);
        }
    }
}

/// A minimal `GET` client (for tests and `doctor`): returns status and body.
pub fn get(
    addr: impl ToSocketAddrs,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let addr = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("address resolves to nothing"))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {head:?}")))?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Result<Request, u16> {
        read_request(&mut &raw[..]).map_err(|r| r.status)
    }

    #[test]
    fn requests_parse_and_garbage_is_400() {
        assert_eq!(
            parse(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
            Ok(Request {
                method: "GET".into(),
                path: "/metrics".into()
            })
        );
        assert_eq!(parse(b"GET / HTTP/1.0\n\n").map(|r| r.path), Ok("/".into()));
        assert_eq!(parse(b""), Err(400));
        assert_eq!(parse(b"\r\n\r\n"), Err(400));
        assert_eq!(parse(b"GET\r\n\r\n"), Err(400));
        assert_eq!(parse(b"GET metrics HTTP/1.1\r\n\r\n"), Err(400));
        assert_eq!(parse(b"GET / SPDY/3\r\n\r\n"), Err(400));
        assert_eq!(parse(b"GET / HTTP/1.1 extra\r\n\r\n"), Err(400));
        assert_eq!(parse(&[0xff; 100]), Err(400));
        assert_eq!(parse(&vec![b'a'; MAX_REQUEST_BYTES + 10]), Err(413));
    }

    #[test]
    fn a_newcomer_displaces_the_longest_waiting_client_that_had_its_grace() {
        let now = Instant::now() + 10 * DISPLACE_AFTER;
        let ago = |d: Duration| now - d;
        let (old, older, oldest) = (
            ago(DISPLACE_AFTER),
            ago(2 * DISPLACE_AFTER),
            ago(3 * DISPLACE_AFTER),
        );
        // Waiting on the client: the one accepted first goes, rendering ones never.
        assert_eq!(
            to_displace([(old, true), (oldest, false), (older, true)], now),
            Some(2)
        );
        // Nobody waited long enough, or everyone renders: refuse the newcomer.
        let fresh = ago(DISPLACE_AFTER / 2);
        assert_eq!(to_displace([(fresh, true), (oldest, false)], now), None);
        assert_eq!(to_displace([], now), None);
    }

    #[test]
    fn responses_have_length_and_no_body_for_head() {
        let mut out = Vec::new();
        write_response(&mut out, &Response::text(200, "hi"), false).unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(
            s.starts_with("HTTP/1.1 200 OK\r\n")
                && s.contains("Content-Length: 2\r\n")
                && s.ends_with("\r\n\r\nhi")
        );
        let mut out = Vec::new();
        write_response(&mut out, &Response::text(404, "nope"), true).unwrap();
        assert!(
            String::from_utf8(out)
                .unwrap()
                .ends_with("Content-Length: 4\r\nConnection: close\r\n\r\n")
        );
    }
}
