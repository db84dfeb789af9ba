//! Helpers for the multi-process tests: forking, a control block shared with the children.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Words shared between the test process and its forked children (anonymous shared mapping).
pub struct Control {
    words: *mut AtomicU64,
    len: usize,
}

impl Control {
    pub fn new(len: usize) -> Self {
        // SAFETY: a fresh anonymous shared mapping, zero-filled by the kernel, sized for `len`
        // AtomicU64s; it is never unmapped (the test process exits soon after).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Self {
            words: ptr.cast(),
            len,
        }
    }

    pub fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len);
        // SAFETY: in bounds of the mapping, 8-aligned (page-aligned base), zero is a valid
        // AtomicU64, and all access is atomic.
        unsafe { &*self.words.add(i) }
    }
}

/// Fork; the child runs `f` and exits with its return code (101 on panic), never returning.
pub fn fork_child(f: impl FnOnce() -> i32) -> libc::pid_t {
    // SAFETY: the test binary holds one test per file, so no other thread holds a lock the
    // child could need; the child leaves only through _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(101);
        // SAFETY: ends the child without running the parent's atexit handlers.
        unsafe { libc::_exit(code) };
    }
    pid
}

/// Wait for `pid`; its exit code, or 128 + signal.
pub fn wait(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: waitpid on our own child with a valid out pointer.
    let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(rc, pid);
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

pub fn kill9(pid: libc::pid_t) {
    // SAFETY: sending SIGKILL to our own child.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

pub struct XorShift(pub u64);
impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub struct TempPath(pub PathBuf);
impl TempPath {
    /// Nothing is there: a file a killed run of the same pid left is removed first.
    pub fn new(tag: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("vgpu-shm-it-{tag}-{}.cache", std::process::id()));
        let _ = std::fs::remove_file(&p);
        Self(p)
    }
}
impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    cond()
}

pub fn load(w: &AtomicU64) -> u64 {
    w.load(Ordering::SeqCst)
}

/// One GPU named `uuid` with a memory limit of `limit` bytes and no SM limit.
pub fn one_gpu(uuid: &str, limit: u64) -> vgpu_shm::TableInit {
    vgpu_shm::TableInit {
        uuids: vec![uuid.into()],
        memory_limits: vec![Some(limit)],
        sm_limits: vec![None],
        priority: 1,
    }
}

/// A table file created with `init` at a fresh path named after `tag`: made before any child
/// is forked, so that they all open the one file.
pub fn table_file(tag: &str, init: &vgpu_shm::TableInit) -> TempPath {
    let path = TempPath::new(tag);
    drop(vgpu_shm::UsageTable::open_or_create(&path.0, init).unwrap());
    path
}

/// Opens the table at `path` (creating it with `init` if there is none) and registers this
/// process in it.
pub fn join(
    path: &TempPath,
    init: &vgpu_shm::TableInit,
) -> (vgpu_shm::UsageTable, vgpu_shm::ProcessSlot) {
    let t = vgpu_shm::UsageTable::open_or_create(&path.0, init).unwrap();
    let me = t.register_self().unwrap();
    (t, me)
}
