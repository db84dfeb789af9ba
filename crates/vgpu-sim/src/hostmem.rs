//! Host memory standing in for device memory: the only module that maps or touches raw memory.
//!
//! Device pointers are host addresses, so copies and memsets really move bytes. Every mapping is
//! `MAP_NORESERVE` and pages are committed only when touched, so a simulated 80 GiB device
//! costs nothing until a program writes to it.

use std::marker::PhantomData;
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

/// `len` bytes of address space at `addr`, unmapped on drop: what a [`HostRegion`] and a
/// [`VaRange`] own (they dereference to it).
#[derive(Debug)]
pub struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Length in bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true; present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: this mapping owns exactly this range (mappings placed inside it included).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// A fresh private anonymous `MAP_NORESERVE` mapping of `len` bytes with protection `prot`
/// at an address of the kernel's choosing; its address, or `None` when the host refuses.
fn map_anonymous(len: usize, prot: libc::c_int) -> Option<usize> {
    // SAFETY: a new mapping where the kernel chooses touches no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as usize)
}

/// Anonymous readable and writable memory: backs `cuMemAlloc` and friends.
#[derive(Debug)]
pub struct HostRegion(Mapping);

impl HostRegion {
    /// Maps `len` bytes (at least one page), or `None` when the host refuses.
    pub fn new(len: usize) -> Option<HostRegion> {
        let len = round_up(len.max(1), page_size())?;
        let addr = map_anonymous(len, libc::PROT_READ | libc::PROT_WRITE)?;
        Some(HostRegion(Mapping { addr, len }))
    }
}

impl std::ops::Deref for HostRegion {
    type Target = Mapping;
    fn deref(&self) -> &Mapping {
        &self.0
    }
}

/// A reserved, inaccessible address range (`cuMemAddressReserve`): physical memory is mapped
/// into it with [`VaRange::map`].
#[derive(Debug)]
pub struct VaRange(Mapping);

impl std::ops::Deref for VaRange {
    type Target = Mapping;
    fn deref(&self) -> &Mapping {
        &self.0
    }
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
        let start = map_anonymous(over, libc::PROT_NONE)?;
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
        Some(VaRange(Mapping { addr: aligned, len }))
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
    // loads and stores atomics, which is async-signal-safe as a fork handler must be.
    unsafe { libc::pthread_atfork(None, None, Some(f)) };
}

/// Bytes the simulator may read and write: simulated device memory, borrowed from the mapping
/// that backs it ([`HostRegion::span`], [`VaRange::span`]), or host memory a program passed to a
/// driver call ([`HostPtr::span`]). [`copy`] and [`fill`] take nothing else, so the code that
/// implements the driver's semantics moves bytes without `unsafe`.
#[derive(Debug, Clone, Copy)]
pub struct Span<'a> {
    addr: usize,
    len: usize,
    _mem: PhantomData<&'a ()>,
}

impl<'a> Span<'a> {
    /// No bytes (a zero-length copy or memset, at any address).
    pub fn empty() -> Span<'static> {
        Span {
            addr: 0,
            len: 0,
            _mem: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `[addr, addr + len)` when it lies inside this span.
    pub fn sub(self, addr: u64, len: u64) -> Option<Span<'a>> {
        inside(self.addr, self.len, addr, len)
    }
}

/// `[addr, addr + len)` when it lies inside `[base, base + cap)`.
fn inside<'a>(base: usize, cap: usize, addr: u64, len: u64) -> Option<Span<'a>> {
    let (a, l) = (usize::try_from(addr).ok()?, usize::try_from(len).ok()?);
    (a >= base && a.checked_add(l)? <= base.checked_add(cap)?).then_some(Span {
        addr: a,
        len: l,
        _mem: PhantomData,
    })
}

/// The 32-bit word `span` holds, read atomically (a stream wait polls a word the host writes
/// concurrently); `None` unless `span` is 4 bytes at a 4-aligned address.
pub fn load_u32(span: Span<'_>) -> Option<u32> {
    if span.len != 4 || span.addr % 4 != 0 {
        return None;
    }
    // SAFETY: a span is readable memory for its lifetime; the word is aligned and in bounds,
    // and every access the simulator makes to it while others may write is atomic.
    let word = unsafe { &*(span.addr as *const std::sync::atomic::AtomicU32) };
    Some(word.load(std::sync::atomic::Ordering::Acquire))
}

/// A host pointer a program passed to a driver call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPtr(u64);

impl HostPtr {
    /// Wraps a host pointer from a driver call.
    ///
    /// # Safety
    /// Every [`span`](HostPtr::span) made from it must be readable and writable for as long as
    /// the call, or the stream work it queues, uses it: the driver API's contract for host
    /// pointers (the real driver trusts it the same way).
    pub unsafe fn new(addr: u64) -> HostPtr {
        HostPtr(addr)
    }

    /// The address.
    pub fn addr(self) -> u64 {
        self.0
    }

    /// `len` bytes from it (`None` for a null pointer or a range past the address space).
    pub fn span(self, len: u64) -> Option<Span<'static>> {
        if self.0 == 0 {
            return None;
        }
        inside(0, usize::MAX, self.0, len)
    }
}

impl HostRegion {
    /// `[addr, addr + len)` when it lies inside this region.
    pub fn span(&self, addr: u64, len: u64) -> Option<Span<'_>> {
        inside(self.addr, self.len, addr, len)
    }
}

impl VaRange {
    /// `[addr, addr + len)` when it lies inside this reservation. Pages not mapped are the
    /// inaccessible placeholder (the caller checks the mappings): a mistake faults, it never
    /// touches memory outside the reservation.
    pub fn span(&self, addr: u64, len: u64) -> Option<Span<'_>> {
        inside(self.addr, self.len, addr, len)
    }
}

/// Copies `src` to `dst` (they may overlap); both have the same length.
pub fn copy(dst: Span<'_>, src: Span<'_>) {
    assert_eq!(dst.len, src.len, "copy between spans of different lengths");
    if dst.len == 0 {
        return;
    }
    // SAFETY: a span is memory a live mapping owns (borrowed for 'a) or a host range the
    // program promised when it made the `HostPtr`; `copy` (memmove) tolerates overlap.
    unsafe { std::ptr::copy(src.addr as *const u8, dst.addr as *mut u8, dst.len) };
}

/// Fills `dst` with elements of `elem` bytes (1, 2 or 4), the low bytes of `value`; a partial
/// element at the end is left alone.
pub fn fill(dst: Span<'_>, value: u32, elem: usize) {
    let count = dst.len / elem.max(1);
    // SAFETY: (all arms) as in `copy`, the span is writable; unaligned writes because the
    // driver allows any address for memset.
    unsafe {
        match elem {
            1 => std::ptr::write_bytes(dst.addr as *mut u8, value as u8, count),
            2 => {
                for i in 0..count {
                    std::ptr::write_unaligned((dst.addr as *mut u16).add(i), value as u16);
                }
            }
            _ => {
                for i in 0..count {
                    std::ptr::write_unaligned((dst.addr as *mut u32).add(i), value);
                }
            }
        }
    }
}

/// Reads `out.len()` bytes of `src` (tests and checks).
pub fn read(src: Span<'_>, out: &mut [u8]) {
    let n = out.len().min(src.len);
    // SAFETY: as in `copy`; `out` is a distinct Rust buffer.
    unsafe { std::ptr::copy_nonoverlapping(src.addr as *const u8, out.as_mut_ptr(), n) };
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
        fill(r.span(r.addr(), 100).unwrap(), 0xab, 1);
        copy(
            big.span(big.addr() + 4096, 100).unwrap(),
            r.span(r.addr(), 100).unwrap(),
        );
        let mut b = [0u8; 100];
        read(big.span(big.addr() + 4096, 100).unwrap(), &mut b);
        assert!(b.iter().all(|&x| x == 0xab));
        assert!(
            r.span(r.addr() + 1, page_size() as u64).is_none(),
            "past the region"
        );
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
        fill(va.span(va.addr(), 4).unwrap(), 0x1234_5678, 4);
        let mut w = [0u8; 4];
        read(va.span(va.addr() + (2 << 20), 4).unwrap(), &mut w);
        assert_eq!(u32::from_le_bytes(w), 0x1234_5678);
        assert!(va.unmap(va.addr(), 4 << 20));
    }
}
