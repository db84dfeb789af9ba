//! Just enough HTTP/1.x for a metrics endpoint: one request per connection, bounded
//! request size, read/write timeouts, a cap on concurrent connections, and never a panic on
//! what a client sends.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Largest request head accepted (request line + headers).
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Connections served at once; more get 503 immediately.
pub const MAX_CONNECTIONS: usize = 32;
/// How long a client may take to send its request or read the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

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

fn handle(mut stream: TcpStream, handler: &(dyn Fn(&Request) -> Response + Send + Sync)) {
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let (response, head_only) = match read_request(&mut stream) {
        Err(r) => (r, false),
        Ok(req) => {
            let head_only = req.method == "HEAD";
            // A bug in rendering must cost one request, not the server.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(&req)))
                .unwrap_or_else(|_| Response::text(500, "internal error\n"));
            (r, head_only)
        }
    };
    let _ = write_response(&mut stream, &response, head_only);
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Serve forever on `listener`: a thread per connection, at most [`MAX_CONNECTIONS`] at once.
pub fn serve(
    listener: TcpListener,
    handler: Arc<dyn Fn(&Request) -> Response + Send + Sync>,
) -> std::io::Error {
    let active = Arc::new(AtomicUsize::new(0));
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
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            let mut stream = stream;
            let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = write_response(
                &mut stream,
                &Response::text(503, "too many connections\n"),
                false,
            );
            continue;
        }
        let handler = Arc::clone(&handler);
        let active_in_thread = Arc::clone(&active);
        let spawned = std::thread::Builder::new()
            .name("vgpu-http".into())
            .spawn(move || {
                handle(stream, handler.as_ref());
                active_in_thread.fetch_sub(1, Ordering::AcqRel);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
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
