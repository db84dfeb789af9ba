//! The administrative sections: the cross-process administrative lock, sweeping dead
//! processes and registering this one.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::ShmError;
use crate::layout::{MAX_DEVICES, MAX_SLOTS};
use crate::protocol::{self, NoCrash, STATE_FREE, STATE_LIVE, ident_word, split_ident};
use crate::sys;

use super::{
    ADMIN_LOCK_OFFSET, ADMIN_LOCK_TIMEOUT, Mapped, ProcessSlot, SLOT_LOCK_BASE, UsageTable,
    now_secs,
};

impl UsageTable {
    /// Run `f` as the administrator: the in-process mutex, then the cross-process OFD lock
    /// (waiting at most `timeout`), a fresh admin epoch, and the repair of whatever a previous
    /// administrator killed inside left behind.
    pub(super) fn admin<R>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&Mapped<'_>, u64) -> Result<R, ShmError>,
    ) -> Result<R, ShmError> {
        let lock_file = self.check_writable()?;
        let deadline = Instant::now() + timeout;
        // Polled, not blocking: `leave` runs at exit, possibly in a signal handler that
        // interrupted this very thread inside an administrative section.
        let _local = loop {
            match self.inner.admin.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(e)) => break e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    return Err(ShmError::AdminLockTimeout {
                        path: self.inner.path.clone(),
                    });
                }
            }
        };
        loop {
            match sys::ofd_try_lock(lock_file, ADMIN_LOCK_OFFSET) {
                Ok(true) => break,
                Ok(false) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                Ok(false) => {
                    return Err(ShmError::AdminLockTimeout {
                        path: self.inner.path.clone(),
                    });
                }
                Err(source) => {
                    return Err(ShmError::Io {
                        path: self.inner.path.clone(),
                        op: "fcntl",
                        source,
                    });
                }
            }
        }
        struct Release<'a>(&'a File);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                sys::ofd_unlock(self.0, ADMIN_LOCK_OFFSET);
            }
        }
        let _release = Release(lock_file);
        let st = self.store();
        let header = &self.ext().header;
        let epoch = header
            .admin_epoch
            .fetch_add(1, Ordering::AcqRel)
            .wrapping_add(1);
        let me = protocol::admin_owner_word(epoch);
        if header.admin_dirty.swap(1, Ordering::AcqRel) != 0 {
            // The previous administrator died inside: repair everything it may have touched.
            let dead = protocol::find_dead(&st);
            let _ = protocol::normalize(&st, me, &dead, &NoCrash);
        }
        let result = f(&st, me);
        header.admin_dirty.store(0, Ordering::Release);
        result
    }

    /// Give dead processes' usage back to the pool now. Returns how many slots were freed.
    pub fn sweep_dead(&self) -> Result<usize, ShmError> {
        self.sweep_with_timeout(ADMIN_LOCK_TIMEOUT)
    }

    pub(super) fn sweep_with_timeout(&self, timeout: Duration) -> Result<usize, ShmError> {
        // Probing without the lock first keeps the common case (nobody died) cheap. A set
        // `admin_dirty` means an administrator is at work or died inside (then `admin` repairs).
        let dirty = self.ext().header.admin_dirty.load(Ordering::Acquire) != 0;
        if !dirty && protocol::find_dead(&self.store()).is_empty() {
            return Ok(0);
        }
        self.admin(timeout, |st, me| {
            let dead = protocol::find_dead(st);
            if dead.is_empty() {
                return Ok(0);
            }
            Ok(protocol::release_dead(st, me, &dead, &NoCrash).unwrap_or(0))
        })
    }

    /// Sweep if this handle has not in the last second (cheap when nobody died: one probe per
    /// live slot, no lock).
    pub(super) fn periodic_sweep(&self) {
        let now = now_secs();
        let last = &self.inner.last_periodic_sweep;
        let prev = last.load(Ordering::Relaxed);
        if now > prev
            && last
                .compare_exchange(prev, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let _ = self.sweep_with_timeout(Duration::ZERO);
        }
    }

    /// Register the calling process: take a free slot, hold its liveness lock, publish it in
    /// HAMi's `procs[]`. Fails with [`ShmError::TableFull`] when 1,024 live processes hold slots.
    pub fn register_self(&self) -> Result<ProcessSlot, ShmError> {
        let lock_file = self.check_writable()?;
        let pid = std::process::id() as i32;
        let start_time = sys::process_start_time(pid).unwrap_or(0);
        let (index, generation) = self.admin(ADMIN_LOCK_TIMEOUT, |st, me| {
            for attempt in 0..2 {
                if let Some(found) = self.claim_free_slot(st, lock_file, pid, start_time)? {
                    return Ok(found);
                }
                if attempt == 0 {
                    // Full: dead processes may be holding slots.
                    let dead = protocol::find_dead(st);
                    let _ = protocol::normalize(st, me, &dead, &NoCrash);
                }
            }
            Err(ShmError::TableFull {
                path: self.inner.path.clone(),
                slots: MAX_SLOTS,
            })
        })?;
        Ok(ProcessSlot {
            table: self.clone(),
            index,
            owner: AtomicU64::new(protocol::slot_owner_word(index, generation)),
            fork_epoch: self.inner.fork_epoch,
        })
    }

    fn claim_free_slot(
        &self,
        st: &Mapped<'_>,
        lock_file: &File,
        pid: i32,
        start_time: u64,
    ) -> Result<Option<(usize, u32)>, ShmError> {
        let n = st.region.proc_num.load(Ordering::Acquire);
        if !(0..MAX_SLOTS as i32).contains(&n) {
            return Ok(None);
        }
        for (j, rec) in st.ext.slots.iter().enumerate() {
            let (generation, state) = split_ident(rec.ident.load(Ordering::Acquire));
            if state != STATE_FREE {
                continue;
            }
            match sys::ofd_try_lock(lock_file, SLOT_LOCK_BASE + j as u64) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(source) => {
                    return Err(ShmError::Io {
                        path: self.inner.path.clone(),
                        op: "fcntl",
                        source,
                    });
                }
            }
            rec.pid.store(pid, Ordering::Relaxed);
            rec.hostpid.store(0, Ordering::Relaxed);
            rec.start_time.store(start_time, Ordering::Relaxed);
            rec.swapped_out.store(0, Ordering::Relaxed);
            let generation = generation.wrapping_add(1) & 0x7fff_ffff;
            // The new process keeps no host memory yet, and says so as this slot's process.
            rec.kept_host.store(0, Ordering::Relaxed);
            rec.kept_ident
                .store(ident_word(generation, STATE_LIVE), Ordering::Relaxed);
            if let Some(times) = self.times() {
                // The new process has published nothing yet.
                let t = &times.slots[j];
                for at in &t.sm_util_at {
                    at.store(0, Ordering::Relaxed);
                }
                t.ident
                    .store(ident_word(generation, STATE_LIVE), Ordering::Release);
            }
            for device in 0..MAX_DEVICES {
                rec.sm_util[device].store(0, Ordering::Relaxed);
                // A free slot holds nothing (normalize zeroes non-live slots).
                debug_assert!(
                    rec.held[device]
                        .iter()
                        .all(|h| h.load(Ordering::Relaxed) == 0)
                );
            }
            // Appending at `n` moves no live slot, so no device lock is needed.
            st.write_proc(n as usize, j, 0);
            rec.ident
                .store(ident_word(generation, STATE_LIVE), Ordering::Release);
            st.region.proc_num.store(n + 1, Ordering::Release);
            return Ok(Some((j, generation)));
        }
        Ok(None)
    }
}
