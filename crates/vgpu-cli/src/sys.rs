//! The CLI's system calls that std does not wrap, each behind a safe function: the effective
//! uid, `access(2)`, local time (`localtime_r`, `strftime`), and what the job-cleanup watcher
//! does to itself and its job (a new session, `dup2` onto stdout, a pidfd and `poll` on it,
//! `kill(pid, 0)`). The driver (`cuda`) and the signal handlers (`signals`) have their own
//! boundary modules; every other module of the crate is safe Rust.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// This process's effective uid.
pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether this process may use `path` as `mode` says (`libc::R_OK`, `W_OK`, `X_OK`, or'ed),
/// by the real uid, as `access(2)` decides (ACLs and read-only mounts included).
pub(crate) fn may_access(path: &CStr, mode: libc::c_int) -> bool {
    // SAFETY: `path` is a valid NUL-terminated string; access reads nothing else.
    unsafe { libc::access(path.as_ptr(), mode) == 0 }
}

/// `unix_secs` broken down in the local time zone (the system's, or `$TZ`); `None` where
/// libc cannot represent it.
pub(crate) fn local_time(unix_secs: i64) -> Option<libc::tm> {
    let t: libc::time_t = unix_secs;
    // SAFETY: an all-zero `tm` is a valid value to be overwritten.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: localtime_r writes only into `tm` (glibc reads TZ once, on first use).
    let ok = unsafe { !libc::localtime_r(&t, &mut tm).is_null() };
    ok.then_some(tm)
}

/// `tm` formatted by `strftime` with `format`; empty if the result exceeds 63 bytes.
pub(crate) fn strftime(format: &CStr, tm: &libc::tm) -> String {
    let mut buf = [0u8; 64];
    // SAFETY: strftime writes at most `buf.len()` bytes and returns how many (0 on overflow);
    // `format` is NUL-terminated and `tm` a valid broken-down time.
    let n = unsafe { libc::strftime(buf.as_mut_ptr().cast(), buf.len(), format.as_ptr(), tm) };
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Make the child `cmd` starts the leader of a new session (no controlling terminal, so
/// Ctrl-C there does not reach it) holding no inherited descriptor above stderr.
pub(crate) fn detach_on_spawn(cmd: &mut Command) {
    // SAFETY: setsid and close_range are async-signal-safe system calls that touch no
    // memory of this process. Closing inherited descriptors (other than the stdio the
    // watcher needs) keeps it from holding a pipe the job's caller waits on; a kernel
    // without close_range (< 5.9) leaves them, which only matters for such pipes.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            Ok(())
        });
    }
}

/// Make this process's stdout a duplicate of `fd`.
pub(crate) fn redirect_stdout(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: dup2 of a valid descriptor onto stdout; it touches no memory of this process.
    if unsafe { libc::dup2(fd.as_raw_fd(), libc::STDOUT_FILENO) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A pidfd of process `pid` (Linux 5.3); `None` where the kernel has none or the process
/// is gone.
pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    (fd >= 0).then(|| {
        // SAFETY: `fd` is a descriptor just returned to us and owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    })
}

/// Block until `fd` is readable (a pidfd: its process has exited), retrying on EINTR;
/// false if poll fails otherwise.
pub(crate) fn wait_readable(fd: &impl AsFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, for the length given.
        if unsafe { libc::poll(&mut p, 1, -1) } > 0 {
            return true;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return false;
        }
    }
}

/// Whether process `pid` exists (`kill(pid, 0)`; a process of another user counts as gone).
pub(crate) fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_turns_readable_when_its_process_exits_and_a_reaped_one_is_gone() {
        let me = std::process::id() as i32;
        assert!(process_exists(me));
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // The kernel may lack pidfds (< 5.3); then only the pid path is checked.
        if let Some(fd) = pidfd_open(pid) {
            assert!(wait_readable(&fd), "readable once the child exits");
        }
        child.wait().unwrap();
        assert!(!process_exists(pid), "reaped");
    }

    #[test]
    fn access_is_decided_by_the_kernel() {
        assert!(may_access(c"/", libc::R_OK | libc::X_OK));
        assert!(!may_access(c"/nonexistent-vgpu-path", libc::R_OK));
    }

    #[test]
    fn local_time_formats_with_strftime() {
        let tm = local_time(0).unwrap();
        assert_eq!(strftime(c"%Y", &tm).len(), 4);
        let long = c"%Y-%m-%d %Y-%m-%d %Y-%m-%d %Y-%m-%d %Y-%m-%d %Y-%m-%d %Y-%m-%d";
        assert_eq!(strftime(long, &tm), "", "longer than the buffer");
    }
}
