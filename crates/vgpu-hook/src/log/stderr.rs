//! Writing one log line to the program's stderr (fd 2) so that the program cannot tell: no
//! signal, no wait, no change to its state.
//!
//! The program's stderr may be a pipe whose reader has gone (a write raises SIGPIPE, which
//! kills by default), a pipe nobody drains (a write blocks once it is full, forever), a
//! socket (systemd's journal), a file or a terminal. What never changes is the program's:
//! its signal dispositions and process mask, and the status flags of its stderr's open file
//! description (shared with every descriptor duplicated from it, often the parent's too:
//! setting `O_NONBLOCK` there, even on a `dup`, would make the program's own writes fail with
//! `EAGAIN`). So, by kind of file ([`route`], asked with `fstat` for each line):
//!
//! - **pipe or FIFO**: the line goes through a private open file description of the same
//!   pipe, opened `O_NONBLOCK` through `/proc/self/fd/2` for this one line and closed after
//!   it: a full pipe refuses it (`EAGAIN`: the line is dropped) instead of blocking. Lines are
//!   at most `PIPE_BUF` bytes, so a pipe takes each whole or not at all, never interleaved
//!   with other writers. Opening fails with `ENXIO` when no reader is left: the line is
//!   dropped unwritten. Where that open is not possible (no `/proc`, a pipe of another user
//!   after a `setuid`), the line is written on fd 2 only if `poll` says it has room; that
//!   fallback can still block if another writer fills the pipe between the `poll` and the
//!   write. The private descriptor is close-on-exec; a `fork` by another thread while one
//!   line is being written gives the child a copy of it, which holds the pipe open as the
//!   child's own inherited stderr already does.
//! - **socket**: `send` with `MSG_DONTWAIT | MSG_NOSIGNAL`, per call: no wait, no signal.
//! - **regular file, character or block device** (a terminal, `/dev/null`): `write(2)` on
//!   fd 2, as the program's own output does. None of them raises SIGPIPE; a terminal stopped
//!   by flow control (Ctrl-S) holds the line as it holds the program's own output.
//! - anything else (fd 2 closed, an eventfd): the line is dropped.
//!
//! **Signals.** A write that fails with `EPIPE` raises SIGPIPE, and one past the file size
//! limit (`EFBIG`) SIGXFSZ (which dumps core by default), both directed at the writing thread.
//! Every write above runs with both blocked in the calling thread only (`pthread_sigmask`),
//! and the one its failure raised is taken back with a zero-timeout `sigtimedwait` before the
//! thread's mask is restored, unless one was already pending before the write (the program's
//! own, which stays: a standard signal pending twice is pending once).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Longest line: a pipe writes at most this many bytes atomically.
pub(crate) const MAX_LINE: usize = libc::PIPE_BUF;

/// How a line reaches fd 2, by the kind of file it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    Pipe,
    Socket,
    Plain,
    Drop,
}

/// The route for a file of `st_mode`.
pub(crate) fn route(mode: libc::mode_t) -> Route {
    match mode & libc::S_IFMT {
        libc::S_IFIFO => Route::Pipe,
        libc::S_IFSOCK => Route::Socket,
        libc::S_IFREG | libc::S_IFCHR | libc::S_IFBLK => Route::Plain,
        _ => Route::Drop,
    }
}

/// Writes `line` (at most [`MAX_LINE`] bytes, one line) to fd 2, or drops it; never raises a
/// signal in, blocks, or changes the state of the program (see the module).
pub(crate) fn write_line(line: &[u8]) {
    debug_assert!(line.len() <= MAX_LINE);
    let Some(st) = fstat(2) else {
        return;
    };
    match route(st.st_mode) {
        Route::Pipe => write_pipe(line, &st),
        Route::Socket => send_all(line),
        Route::Plain => {
            signals_taken_back(|| write_all(2, line));
        }
        Route::Drop => {}
    }
}

fn fstat(fd: RawFd) -> Option<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer; an invalid fd is reported, not undefined.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some(st)
}

/// Why fd 2's pipe could not be opened afresh.
enum Reopen {
    /// No reader: nobody would read the line.
    NoReader,
    /// No private description to be had (no `/proc`, no permission, another file now).
    Unavailable,
}

fn write_pipe(line: &[u8], st: &libc::stat) {
    match reopen_nonblocking(st) {
        Ok(fd) => {
            // All or nothing (at most PIPE_BUF bytes): EAGAIN drops the line.
            signals_taken_back(|| write_once(fd.as_raw_fd(), line));
        }
        Err(Reopen::NoReader) => {}
        Err(Reopen::Unavailable) => {
            if has_room(2) {
                signals_taken_back(|| write_once(2, line));
            }
        }
    }
}

/// A private, non-blocking, close-on-exec open file description of the pipe fd 2 is now
/// (checked: the same pipe as `st`, which fd 2 was when asked).
fn reopen_nonblocking(st: &libc::stat) -> Result<OwnedFd, Reopen> {
    let flags = libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY;
    // SAFETY: a NUL-terminated path; `open` returns a new descriptor or -1.
    let fd = unsafe { libc::open(c"/proc/self/fd/2".as_ptr(), flags) };
    if fd < 0 {
        return Err(match errno() {
            libc::ENXIO => Reopen::NoReader,
            _ => Reopen::Unavailable,
        });
    }
    // SAFETY: `fd` was just opened by this function and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // The program may have put another file on fd 2 since the fstat: write only to the pipe
    // that was asked about (a regular file opened without O_APPEND would be overwritten).
    match fstat(fd.as_raw_fd()) {
        Some(now)
            if route(now.st_mode) == Route::Pipe
                && (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) =>
        {
            Ok(fd)
        }
        _ => Err(Reopen::Unavailable),
    }
}

/// Whether `fd` can take a write now (one `poll` with no wait).
fn has_room(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & libc::POLLOUT != 0 && p.revents & (libc::POLLERR | libc::POLLHUP) == 0
}

/// One `write(2)`: the bytes written or the errno.
fn write_once(fd: RawFd, bytes: &[u8]) -> Result<usize, i32> {
    // SAFETY: writes from a valid slice.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    if n < 0 { Err(errno()) } else { Ok(n as usize) }
}

/// `write(2)` until all of `bytes` is written or a call fails (`EINTR`: again).
fn write_all(fd: RawFd, mut bytes: &[u8]) -> Result<usize, i32> {
    let total = bytes.len();
    while !bytes.is_empty() {
        match write_once(fd, bytes) {
            Ok(0) => break,
            Ok(n) => bytes = &bytes[n..],
            Err(libc::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total - bytes.len())
}

/// `send` on fd 2 until all of `line` is sent; a full socket drops the rest.
fn send_all(mut line: &[u8]) {
    while !line.is_empty() {
        // SAFETY: sends from a valid slice; the flags ask for no wait and no SIGPIPE.
        let n = unsafe {
            libc::send(
                2,
                line.as_ptr().cast(),
                line.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        match n {
            n if n > 0 => line = &line[n as usize..],
            n if n < 0 && errno() == libc::EINTR => {}
            _ => return,
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Runs `write` with SIGPIPE and SIGXFSZ blocked in this thread, then takes back the one
/// its failure raised (unless one was pending before) and restores the thread's mask.
fn signals_taken_back(write: impl FnOnce() -> Result<usize, i32>) {
    let raised_by = |e: i32| match e {
        libc::EPIPE => Some(libc::SIGPIPE),
        libc::EFBIG => Some(libc::SIGXFSZ),
        _ => None,
    };
    let blocked = SigSet::of(&[libc::SIGPIPE, libc::SIGXFSZ]);
    let Some(old) = blocked.block_in_this_thread() else {
        return; // cannot block: no write, rather than a signal
    };
    let pending_before = SigSet::pending();
    let result = write();
    if let Err(e) = result
        && let Some(sig) = raised_by(e)
        && !pending_before.is_some_and(|p| p.has(sig))
    {
        SigSet::of(&[sig]).take_pending();
    }
    old.restore_in_this_thread();
}

/// A `sigset_t`.
struct SigSet(libc::sigset_t);

impl SigSet {
    fn of(signals: &[libc::c_int]) -> Self {
        // SAFETY: sigemptyset initializes the set it is given; sigaddset with valid signals.
        unsafe {
            let mut s: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut s);
            for &sig in signals {
                libc::sigaddset(&mut s, sig);
            }
            Self(s)
        }
    }

    /// Adds this set to the calling thread's mask; the previous mask.
    fn block_in_this_thread(&self) -> Option<SigSet> {
        // SAFETY: a zeroed sigset_t is a valid out-buffer.
        let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid set pointers; affects the calling thread only.
        let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &self.0, &mut old) };
        (r == 0).then_some(SigSet(old))
    }

    /// Makes this set the calling thread's mask again.
    fn restore_in_this_thread(&self) {
        // SAFETY: a valid set pointer; affects the calling thread only.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }

    /// The signals pending for this thread or the process.
    fn pending() -> Option<SigSet> {
        // SAFETY: a zeroed sigset_t is a valid out-buffer for sigpending.
        let mut s: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-pointer.
        (unsafe { libc::sigpending(&mut s) } == 0).then_some(SigSet(s))
    }

    fn has(&self, sig: libc::c_int) -> bool {
        // SAFETY: an initialized set and a valid signal number.
        unsafe { libc::sigismember(&self.0, sig) == 1 }
    }

    /// Takes one pending signal of this (blocked) set, if any, without waiting; the
    /// thread's own pending signals are taken before the process's.
    fn take_pending(&self) {
        let no_wait = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid set, a null info pointer (allowed) and a valid timeout.
        unsafe { libc::sigtimedwait(&self.0, std::ptr::null_mut(), &no_wait) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipes_and_sockets_are_the_routes_that_can_signal_or_block() {
        assert_eq!(route(libc::S_IFIFO | 0o600), Route::Pipe);
        assert_eq!(route(libc::S_IFSOCK | 0o777), Route::Socket);
        for plain in [libc::S_IFREG, libc::S_IFCHR, libc::S_IFBLK] {
            assert_eq!(route(plain | 0o644), Route::Plain);
        }
        // An anonymous inode (eventfd, epoll) has no file type; a directory is no stream.
        assert_eq!(route(0o600), Route::Drop);
        assert_eq!(route(libc::S_IFDIR | 0o755), Route::Drop);
    }

    /// A pipe with no reader.
    fn readerless_pipe() -> OwnedFd {
        let mut fds = [0; 2];
        // SAFETY: a valid array of two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned here.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        drop(r);
        w
    }

    fn sigpipe_blocked_in_this_thread() -> bool {
        // SAFETY: a zeroed sigset_t is a valid out-buffer.
        let mut m: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: a query of the calling thread's mask (no set given).
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut m) };
        SigSet(m).has(libc::SIGPIPE)
    }

    fn sigpipe_pending() -> bool {
        SigSet::pending().unwrap().has(libc::SIGPIPE)
    }

    #[test]
    fn a_write_that_raises_sigpipe_takes_it_back_and_leaves_the_program_s_pending_one() {
        // On a thread of its own that blocks SIGPIPE itself, as a program may: a SIGPIPE
        // left pending there would be seen (unblocked, the test harness ignores it).
        std::thread::spawn(|| {
            SigSet::of(&[libc::SIGPIPE]).block_in_this_thread().unwrap();
            let w = readerless_pipe();
            let mut result = None;
            signals_taken_back(|| {
                let r = write_once(w.as_raw_fd(), b"x\n");
                result = Some(r);
                r
            });
            assert_eq!(result, Some(Err(libc::EPIPE)));
            assert!(
                !sigpipe_pending(),
                "the SIGPIPE the write raised was taken back"
            );
            assert!(
                sigpipe_blocked_in_this_thread(),
                "the thread's mask is as it was"
            );
            // One of the program's own, pending before: it stays.
            // SAFETY: a signal to the calling thread, which blocks it.
            unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
            signals_taken_back(|| write_once(w.as_raw_fd(), b"x\n"));
            assert!(sigpipe_pending(), "the program's own SIGPIPE is not taken");
            SigSet::of(&[libc::SIGPIPE]).take_pending();
            assert!(!sigpipe_pending());
        })
        .join()
        .unwrap();
        // A thread that did not block it: unblocked again afterwards.
        std::thread::spawn(|| {
            let before = sigpipe_blocked_in_this_thread();
            signals_taken_back(|| write_once(readerless_pipe().as_raw_fd(), b"x\n"));
            assert_eq!(sigpipe_blocked_in_this_thread(), before);
        })
        .join()
        .unwrap();
    }
}
