//! Every system call and every `unsafe` block of the crate: the mapping, the aligned copy
//! node-side readers decode, `flock`, open file description (OFD) record locks, the effective
//! uid, and the fork hook.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::Once;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use crate::layout::{
    EXT_OFFSET, Extension, FILE_LEN, HOST_OFFSET, HamiRegion, HostHeld, PublishTimes, REGION_SIZE,
    TIMES_OFFSET,
};

/// A shared mapping of the whole file.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all access goes through atomics (`layout` makes
// every field atomic, and the `load_*` helpers are atomic loads), so it may be used from any
// thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: concurrent access is only through atomics.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Map `len` bytes of `file` shared, read-write if `writable`.
    pub(crate) fn map(file: &File, len: usize, writable: bool) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty file"));
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh mapping chosen by the kernel (addr null) of a file we hold open; it
        // aliases no Rust object. The length was taken from fstat by the caller; if the file is
        // truncated later, access beyond its end raises SIGBUS, which is the documented limit
        // of sharing a file (see docs/security.md).
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null pointer"))?;
        Ok(Self { ptr, len })
    }

    /// Mapped length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// HAMi's region, if the mapping is long enough.
    pub(crate) fn region(&self) -> Option<&HamiRegion> {
        if self.len < REGION_SIZE {
            return None;
        }
        // SAFETY: the mapping is page aligned (>= the 8-byte alignment of HamiRegion) and at
        // least REGION_SIZE bytes long; every field is an atomic, so a shared reference stays
        // sound while other processes write; the reference lives no longer than `self`.
        Some(unsafe { &*self.ptr.as_ptr().cast::<HamiRegion>() })
    }

    /// vgpu's extension, if the mapping is long enough.
    pub(crate) fn extension(&self) -> Option<&Extension> {
        if self.len < EXT_OFFSET + size_of::<Extension>() {
            return None;
        }
        // SAFETY: EXT_OFFSET is a multiple of 64 (asserted in `layout`) from a page-aligned
        // base, so the pointer meets Extension's alignment; the bounds were checked above; all
        // fields are atomics (see `region`).
        Some(unsafe { &*self.ptr.as_ptr().add(EXT_OFFSET).cast::<Extension>() })
    }

    /// The publish-time table (extension minor version 1), if the mapping is long enough.
    /// Whether the file's minor version says it is there is the caller's question.
    pub(crate) fn publish_times(&self) -> Option<&PublishTimes> {
        if self.len < TIMES_OFFSET + size_of::<PublishTimes>() {
            return None;
        }
        // SAFETY: TIMES_OFFSET is a multiple of 64 (asserted in `layout`) from a page-aligned
        // base, which meets PublishTimes' alignment; the bounds were checked above; all fields
        // are atomics (see `region`).
        Some(unsafe { &*self.ptr.as_ptr().add(TIMES_OFFSET).cast::<PublishTimes>() })
    }

    /// The host-backed usage table (extension minor version 2), if the mapping is long
    /// enough. Whether the file's minor version says it is there is the caller's question.
    pub(crate) fn host_held(&self) -> Option<&HostHeld> {
        if self.len < HOST_OFFSET + size_of::<HostHeld>() {
            return None;
        }
        // SAFETY: HOST_OFFSET is a multiple of 64 (asserted in `layout`) from a page-aligned
        // base, which meets HostHeld's alignment; the bounds were checked above; all fields
        // are atomics (see `region`).
        Some(unsafe { &*self.ptr.as_ptr().add(HOST_OFFSET).cast::<HostHeld>() })
    }

    /// HAMi's region, vgpu's extension and the host-backed table together, if the mapping
    /// holds the whole current layout: one length check for the three (the hot path's view).
    #[inline]
    pub(crate) fn parts(&self) -> Option<(&HamiRegion, &Extension, &HostHeld)> {
        if self.len < FILE_LEN {
            return None;
        }
        Some((self.region()?, self.extension()?, self.host_held()?))
    }

    /// Atomic load of the little-endian u32 at `offset` (must be 4-aligned).
    pub(crate) fn load_u32(&self, offset: usize) -> Option<u32> {
        if offset % 4 != 0 || offset.checked_add(4)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 4-aligned (page-aligned base); atomic like every writer.
        let v = unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast()) };
        Some(v.load(Ordering::Acquire))
    }

    /// Atomic load of the little-endian u64 at `offset` (must be 8-aligned).
    pub(crate) fn load_u64(&self, offset: usize) -> Option<u64> {
        if offset % 8 != 0 || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 8-aligned (page-aligned base); atomic like every writer.
        let v = unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(offset).cast()) };
        Some(v.load(Ordering::Acquire))
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped; no reference derived from it outlives
        // `self` (they all borrow `self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// A private copy of (a prefix of) a file, read with `pread` and 64-byte aligned, so that it can
/// be decoded through the same `layout` structs as the mapping. Node-side readers use it: a
/// file a tenant can truncate is never mapped by them (a mapped page past a truncated end
/// raises SIGBUS), and the copy cannot change under the decoder.
#[derive(Debug)]
pub(crate) struct OwnedImage {
    /// `len` bytes from `start` are the file's; 64 spare bytes make room for the alignment.
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl OwnedImage {
    /// Read at most `max` bytes of `file` from offset 0 (fewer if it ends first, for instance
    /// because it was truncated while being read).
    pub(crate) fn read(file: &File, max: usize) -> io::Result<Self> {
        let mut buf = vec![0u8; max + 64];
        let start = buf.as_ptr().align_offset(64);
        let mut len = 0;
        while len < max {
            match file.read_at(&mut buf[start + len..start + max], len as u64) {
                Ok(0) => break,
                Ok(n) => len += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(Self { buf, start, len })
    }

    /// The bytes read.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The layout struct `T` at `offset`, if the copy holds all of it.
    fn view<T>(&self, offset: usize) -> Option<&T> {
        if offset.checked_add(size_of::<T>())? > self.len || offset % align_of::<T>() != 0 {
            return None;
        }
        // SAFETY: in bounds (checked above); `start` is 64-aligned and `offset` a multiple of
        // T's alignment (every layout struct is aligned to at most 64), so the pointer is
        // aligned; T is made only of atomics, for which every bit pattern is valid; the buffer
        // is owned by `self` and outlives the reference, and nothing writes it after `read`.
        Some(unsafe { &*self.buf.as_ptr().add(self.start + offset).cast::<T>() })
    }

    /// HAMi's region, if the copy is long enough.
    pub(crate) fn region(&self) -> Option<&HamiRegion> {
        self.view(0)
    }

    /// vgpu's extension, if the copy is long enough.
    pub(crate) fn extension(&self) -> Option<&Extension> {
        self.view(EXT_OFFSET)
    }

    /// The publish-time table, if the copy is long enough.
    pub(crate) fn publish_times(&self) -> Option<&PublishTimes> {
        self.view(TIMES_OFFSET)
    }

    /// The host-backed usage table, if the copy is long enough.
    pub(crate) fn host_held(&self) -> Option<&HostHeld> {
        self.view(HOST_OFFSET)
    }
}

/// The calling process's effective uid (the owner of files it creates).
pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) takes no arguments and cannot fail.
    unsafe { libc::geteuid() }
}

/// `clock_gettime(CLOCK_MONOTONIC)` in nanoseconds (a vDSO read, no system call). Every
/// process of a host, containers included, shares this time line (the monotonic clock is not
/// namespaced unless a time namespace is set up, which container runtimes do not do), so the
/// shared file's publish times and the turn board's heartbeats compare across processes.
/// Inlined: rate limits on the allocation path read it.
#[inline]
pub fn monotonic_ns() -> u64 {
    let ts = clock_now(libc::CLOCK_MONOTONIC);
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Whole seconds of `CLOCK_MONOTONIC_COARSE` (the time line of [`monotonic_ns`] at the
/// kernel tick's resolution): for checks due once a second on a hot path, which need neither
/// the exact clock nor a conversion to nanoseconds (the coarse clock is a plain vDSO load).
#[inline]
pub fn monotonic_coarse_secs() -> u64 {
    clock_now(libc::CLOCK_MONOTONIC_COARSE).tv_sec as u64
}

/// The time of `clock`, one of the two above (inlined into both: they are on hot paths).
#[inline(always)]
fn clock_now(clock: libc::clockid_t) -> libc::timespec {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes the timespec we own; CLOCK_MONOTONIC always exists on
    // Linux and CLOCK_MONOTONIC_COARSE on every Linux since 2.6.32, so it cannot fail with
    // valid arguments.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts
}

/// `flock(LOCK_EX | LOCK_NB)`: `Ok(false)` if someone else holds it.
pub(crate) fn try_flock_exclusive(file: &File) -> io::Result<bool> {
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}

/// An exclusive `flock` on a file, released when dropped, however its holder leaves. The
/// release is explicit, not left to closing the descriptor: a `flock` belongs to the open
/// file description, which a child forked meanwhile (from another thread) shares and would
/// hold until it exits.
pub(crate) struct Flock<'a>(&'a File);

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        unflock(self.0);
    }
}

/// Takes an exclusive `flock` on `file`, trying every `poll` for at most `wait`: `Ok(None)`
/// if another holder kept it that long.
pub(crate) fn flock_exclusive_within(
    file: &File,
    wait: std::time::Duration,
    poll: std::time::Duration,
) -> io::Result<Option<Flock<'_>>> {
    let deadline = std::time::Instant::now() + wait;
    while !try_flock_exclusive(file)? {
        if std::time::Instant::now() > deadline {
            return Ok(None);
        }
        std::thread::sleep(poll);
    }
    Ok(Some(Flock(file)))
}

/// Release a `flock`.
pub(crate) fn unflock(file: &File) {
    // SAFETY: flock on a descriptor we own; no memory is passed.
    unsafe {
        libc::flock(file.as_raw_fd(), libc::LOCK_UN);
    }
}

fn ofd_lock_request(kind: libc::c_int, offset: u64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = offset as libc::off_t;
    fl.l_len = 1;
    fl.l_pid = 0; // required by F_OFD_*
    fl
}

/// Take the one-byte OFD write lock at `offset` without waiting: `Ok(false)` if another open
/// file description holds it. The kernel drops it when the description is closed, i.e. when
/// the process dies.
pub(crate) fn ofd_try_lock(file: &File, offset: u64) -> io::Result<bool> {
    let fl = ofd_lock_request(libc::F_WRLCK, offset);
    // SAFETY: fcntl with a pointer to a live, initialized `flock` on a descriptor we own.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(err),
    }
}

/// Release the OFD lock at `offset`.
pub(crate) fn ofd_unlock(file: &File, offset: u64) {
    let fl = ofd_lock_request(libc::F_UNLCK, offset);
    // SAFETY: as in `ofd_try_lock`.
    unsafe {
        libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &fl);
    }
}

/// Whether any open file description other than `probe`'s holds a write lock on the byte at
/// `offset`. `probe` must never hold locks itself (its own locks never conflict). Errors are
/// answered "held": a wrong "dead" would give away a live process's usage.
pub(crate) fn ofd_is_locked(probe: &File, offset: u64) -> bool {
    let mut fl = ofd_lock_request(libc::F_RDLCK, offset);
    // SAFETY: fcntl F_OFD_GETLK writes into the live `flock` we pass.
    let rc = unsafe { libc::fcntl(probe.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    rc != 0 || fl.l_type != libc::F_UNLCK as libc::c_short
}

/// `/proc/<pid>/stat` field 22: start time in clock ticks after boot.
pub(crate) fn process_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

// --- fork -----------------------------------------------------------------------------------

/// Descriptors a forked child must not keep: they carry this process's liveness locks.
static FORK_FDS: [AtomicI32; 256] = [const { AtomicI32::new(-1) }; 256];
/// Incremented in every forked child; handles opened before a fork refuse to work after it.
static FORK_EPOCH: AtomicU64 = AtomicU64::new(0);
static ATFORK: Once = Once::new();

extern "C" fn close_lock_fds_in_child() {
    FORK_EPOCH.fetch_add(1, Ordering::SeqCst);
    for slot in &FORK_FDS {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: `fd` was registered by a live handle; in the child it is a copy that only
            // this handler closes (the handle sees the new fork epoch and forgets it). close is
            // async-signal-safe, as required after fork.
            unsafe {
                libc::close(fd);
            }
        }
    }
}

/// The current fork epoch.
pub(crate) fn fork_epoch() -> u64 {
    FORK_EPOCH.load(Ordering::Relaxed)
}

/// Have forked children close `fd`; `false` if the registry is full (a child then keeps the
/// descriptor, and this process's slots look alive while it lives, until it execs or exits).
pub(crate) fn register_fork_fd(fd: RawFd) -> bool {
    ATFORK.call_once(|| {
        // SAFETY: registers a handler that only touches static atomics and calls close().
        unsafe {
            libc::pthread_atfork(None, None, Some(close_lock_fds_in_child));
        }
    });
    FORK_FDS.iter().any(|s| {
        s.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })
}

/// Forget `fd` (before closing it).
pub(crate) fn unregister_fork_fd(fd: RawFd) {
    for s in &FORK_FDS {
        let _ = s.compare_exchange(fd, -1, Ordering::SeqCst, Ordering::SeqCst);
    }
}
