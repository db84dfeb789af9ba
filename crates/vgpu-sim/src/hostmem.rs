//! Host memory standing in for device memory: the only module that maps or touches raw memory.
//!
//! Device pointers are host addresses, so copies and memsets really move bytes. Every mapping is
//! `MAP_NORESERVE` and pages are committed only when touched, so a simulated 80 GiB device
//! costs nothing until a program writes to it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The host page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// Anonymous readable and writable memory: backs `cuMemAlloc` and friends.
#[derive(Debug)]
pub struct HostRegion {
    addr: usize,
    len: usize,
}

impl HostRegion {
    /// Maps `len` bytes (at least one page), or `None` when the host refuses.
    pub fn new(len: usize) -> Option<HostRegion> {
        let len = round_up(len.max(1), page_size())?;
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing touches no
        // existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            None
        } else {
            Some(HostRegion {
                addr: p as usize,
                len,
            })
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Mapped length (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true; present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: this region owns exactly this mapping.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// A reserved, inaccessible address range (`cuMemAddressReserve`): physical memory is mapped
/// into it with [`VaRange::map`].
#[derive(Debug)]
pub struct VaRange {
    addr: usize,
    len: usize,
}

impl VaRange {
    /// Reserves `len` bytes aligned to `align` (a power of two, at least a page).
    pub fn new(len: usize, align: usize) -> Option<VaRange> {
        let align = align.max(page_size());
        if !align.is_power_of_two() || len == 0 {
            return None;
        }
        let len = round_up(len, page_size())?;
        let over = len.checked_add(align)?;
        // SAFETY: a fresh inaccessible mapping at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let start = p as usize;
        let aligned = round_up(start, align)?;
        // SAFETY: both trimmed pieces lie inside the mapping just made and are not used.
        unsafe {
            if aligned > start {
                libc::munmap(start as *mut libc::c_void, aligned - start);
            }
            let tail = start + over - (aligned + len);
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
        }
        Some(VaRange { addr: aligned, len })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true; present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn contains(&self, addr: u64, len: usize) -> bool {
        let (a, l) = (addr as usize, len);
        a >= self.addr
            && a.checked_add(l)
                .is_some_and(|end| end <= self.addr + self.len)
    }

    /// Maps `len` bytes of `phys` from `offset` at `addr` (inside this range), readable and
    /// writable. Fails on a range outside the reservation or a host error.
    pub fn map(&self, addr: u64, len: usize, phys: &PhysMem, offset: usize) -> bool {
        if !self.contains(addr, len) || offset.checked_add(len).is_none_or(|e| e > phys.len) {
            return false;
        }
        // SAFETY: the target lies inside this reservation, which owns the address range, so
        // MAP_FIXED replaces nothing but our own placeholder (or a mapping we made earlier).
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                phys.fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        p != libc::MAP_FAILED
    }

    /// Puts the inaccessible placeholder back over `[addr, addr + len)`.
    pub fn unmap(&self, addr: u64, len: usize) -> bool {
        if !self.contains(addr, len) {
            return false;
        }
        // SAFETY: as in `map`, the range belongs to this reservation.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        p != libc::MAP_FAILED
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        // SAFETY: this reservation owns exactly this range (mappings inside it included).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// "Physical" memory of a `cuMemCreate` handle: a sparse memory file that can be mapped at
/// several addresses, so aliasing behaves as on a GPU.
#[derive(Debug)]
pub struct PhysMem {
    fd: OwnedFd,
    len: usize,
}

impl PhysMem {
    /// A sparse memory file of `len` bytes.
    pub fn new(len: usize) -> Option<PhysMem> {
        // SAFETY: the name is a valid C string; the flags are plain.
        let fd = unsafe { libc::memfd_create(c"vgpu-sim-phys".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return None;
        }
        Some(PhysMem { fd, len })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true; present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Runs `f` in the child after every `fork` (a `pthread_atfork` child handler).
pub fn at_fork_child(f: extern "C" fn()) {
    // SAFETY: registering a handler has no preconditions; `f` is a plain function that only
    // stores an atomic, which is async-signal-safe as a fork handler must be.
    unsafe { libc::pthread_atfork(None, None, Some(f)) };
}

/// Copies `n` bytes between addresses the caller checked.
///
/// # Safety
/// `src..src+n` must be readable and `dst..dst+n` writable for the whole call (device ranges
/// are checked against the live allocations, under the state lock, by the caller; host ranges
/// are the program's promise, as with the real driver).
pub unsafe fn copy(dst: u64, src: u64, n: usize) {
    if n == 0 {
        return;
    }
    // SAFETY: guaranteed by the caller; `copy` (memmove) tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
}

/// Fills `count` elements of `elem` bytes (1, 2 or 4) at `dst` with the low bytes of `value`.
///
/// # Safety
/// `dst..dst + count * elem` must be writable (checked by the caller as for [`copy`]).
pub unsafe fn fill(dst: u64, value: u32, elem: usize, count: usize) {
    // SAFETY: (all arms) the caller guarantees the range is writable; unaligned writes are used
    // because the driver allows any address for memset.
    unsafe {
        match elem {
            1 => std::ptr::write_bytes(dst as *mut u8, value as u8, count),
            2 => {
                for i in 0..count {
                    std::ptr::write_unaligned((dst as *mut u16).add(i), value as u16);
                }
            }
            _ => {
                for i in 0..count {
                    std::ptr::write_unaligned((dst as *mut u32).add(i), value);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_usable_and_lazy() {
        // 64 GiB of address space costs nothing until touched.
        let big = HostRegion::new(64 << 30).expect("NORESERVE mapping");
        let r = HostRegion::new(100).unwrap();
        assert_eq!(r.len(), page_size());
        // SAFETY: inside the fresh regions.
        unsafe {
            fill(r.addr(), 0xab, 1, 100);
            copy(big.addr() + 4096, r.addr(), 100);
            assert_eq!(*((big.addr() + 4096 + 99) as *const u8), 0xab);
        }
    }

    #[test]
    fn physical_memory_aliases_at_two_addresses() {
        let va = VaRange::new(4 << 20, 2 << 20).unwrap();
        assert_eq!(va.addr() % (2 << 20), 0);
        let phys = PhysMem::new(2 << 20).unwrap();
        assert!(va.map(va.addr(), 2 << 20, &phys, 0));
        assert!(va.map(va.addr() + (2 << 20), 2 << 20, &phys, 0));
        assert!(
            !va.map(va.addr() + (3 << 20), 2 << 20, &phys, 0),
            "outside the reservation"
        );
        // SAFETY: both halves are mapped read-write.
        unsafe {
            fill(va.addr(), 0x1234_5678, 4, 1);
            assert_eq!(*((va.addr() + (2 << 20)) as *const u32), 0x1234_5678);
        }
        assert!(va.unmap(va.addr(), 4 << 20));
    }
}
