//! One sub-allocator region: a device allocation of OVERSIZE bytes cut into BITSIZE
//! chunks, tracked by a bitmap of `u64` words (bit set = chunk in use), a next-fit
//! mark and a count of free chunks (HAMi-core's allocator design).
//!
//! Plain `u64` words rather than `bitvec`: the hot operations are "first zero/one bit
//! from here" and "set/clear a run", i.e. `trailing_zeros`, two edge masks and a slice
//! fill. Measured with callgrind, the same next-fit search written with `bitvec`'s
//! `first_zero`/`first_one`/`fill`/`all` took 520 instructions per 2-chunk allocate+free
//! and 2056 per 4095-chunk pair, against 325 and 1440 here (which also keeps the run-start
//! bitmap).

use crate::backend::DevicePtr;

/// Why a chunk run could not be returned to its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// The run lies (partly) outside the region.
    #[error("chunk run {start}+{count} outside a region of {chunks} chunks")]
    OutOfRange {
        /// First chunk.
        start: u32,
        /// Chunks in the run.
        count: u32,
        /// Chunks in the region.
        chunks: u32,
    },
    /// Some chunk of the run is not in use (double free or corrupted bookkeeping).
    #[error("chunk run {start}+{count} is not fully allocated")]
    NotAllocated {
        /// First chunk.
        start: u32,
        /// Chunks in the run.
        count: u32,
    },
}

/// Chunks of `1 << shift` bytes needed for `bytes` (at least one). Shifts, not
/// `div_ceil`: the divisor is not a constant, and a division costs tens of cycles.
#[inline]
pub fn chunks_for(bytes: u32, shift: u32) -> u32 {
    let mask = (1u64 << shift) - 1;
    ((u64::from(bytes.max(1)) + mask) >> shift) as u32
}

/// A region's bitmap and its device base address.
#[derive(Debug, Clone)]
pub struct Region {
    base: DevicePtr,
    chunk_shift: u32,
    chunks: u32,
    free_chunks: u32,
    next_fit: u32,
    /// Bit set = chunk in use.
    words: Box<[u64]>,
    /// Bit set = first chunk of a live run, so an interior address finds its run.
    starts: Box<[u64]>,
    /// Bytes requested for the sized run starting at each chunk (0: none starts there).
    /// A sub-allocation needs no other record: its base address gives the region and
    /// the chunk, this gives its length. Zero-initialized memory comes from the
    /// allocator's calloc (fresh pages), so only the pages of chunks that start runs are
    /// ever touched: 4 bytes per chunk, 1 MiB of address space per 128 MiB region.
    requested: Box<[u32]>,
}

impl Region {
    /// A region of `chunks` chunks of `1 << chunk_shift` bytes at `base`, all free.
    pub fn new(base: DevicePtr, chunk_shift: u32, chunks: u32) -> Self {
        let n_words = chunks.div_ceil(64) as usize;
        let mut words = vec![0u64; n_words].into_boxed_slice();
        // Bits past the last chunk are permanently "in use" so searches never return them.
        let tail = chunks % 64;
        if tail != 0 {
            if let Some(last) = words.last_mut() {
                *last = !0u64 << tail;
            }
        }
        Self {
            base,
            chunk_shift,
            chunks,
            free_chunks: chunks,
            next_fit: 0,
            words,
            starts: vec![0u64; n_words].into_boxed_slice(),
            requested: vec![0u32; chunks as usize].into_boxed_slice(),
        }
    }

    /// Chunks needed for `bytes` (at least one).
    #[inline]
    fn chunks_for(&self, bytes: u32) -> u32 {
        chunks_for(bytes, self.chunk_shift)
    }

    /// Mark enough chunks for `bytes` (> 0) in use, like [`Region::allocate`], and remember
    /// the size so the run can be freed and measured from its start alone
    /// ([`Region::free_sized`], [`Region::requested_at`]). Always inlined, like
    /// [`Region::free_sized`]: each sub-allocation's path, where a call frame costs a
    /// tenth of it.
    #[inline(always)]
    pub fn allocate_sized(&mut self, bytes: u32) -> Option<u32> {
        if bytes == 0 {
            return None;
        }
        let start = self.allocate(self.chunks_for(bytes))?;
        self.requested[start as usize] = bytes;
        Some(start)
    }

    /// Bytes requested for the live sized run starting at chunk `start`, if one does.
    #[inline]
    pub fn requested_at(&self, start: u32) -> Option<u32> {
        let bytes = *self.requested.get(start as usize)?;
        (bytes != 0 && self.bit(&self.starts, start)).then_some(bytes)
    }

    /// Return the sized run starting at `start`; returns its requested bytes and chunks.
    #[inline(always)]
    pub fn free_sized(&mut self, start: u32) -> Result<(u32, u32), RegionError> {
        let Some(bytes) = self.requested_at(start) else {
            return Err(RegionError::NotAllocated { start, count: 0 });
        };
        let count = self.chunks_for(bytes);
        self.free(start, count)?;
        Ok((bytes, count))
    }

    /// Every live sized run as (first chunk, requested bytes), in address order
    /// (diagnostics; O(chunks / 64)).
    pub fn sized_runs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.starts.iter().enumerate().flat_map(move |(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let i = w as u32 * 64 + bits.trailing_zeros();
                bits &= bits - 1;
                Some(i)
            })
            .filter_map(move |i| self.requested_at(i).map(|b| (i, b)))
        })
    }

    /// Number of live runs (diagnostics; O(chunks / 64)).
    pub fn live_runs(&self) -> usize {
        self.starts.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Device address of the region's first byte.
    pub fn base(&self) -> DevicePtr {
        self.base
    }

    /// Chunks not in use.
    pub fn free_chunks(&self) -> u32 {
        self.free_chunks
    }

    /// Chunks in the region.
    pub fn chunks(&self) -> u32 {
        self.chunks
    }

    /// True when no chunk is in use.
    pub fn is_empty(&self) -> bool {
        self.free_chunks == self.chunks
    }

    /// Device address of chunk `index`.
    pub fn address_of(&self, index: u32) -> DevicePtr {
        // The driver never maps a region across the top of the address space; wrap
        // rather than panic if a broken backend ever claims otherwise.
        DevicePtr(
            self.base
                .0
                .wrapping_add(u64::from(index) << self.chunk_shift),
        )
    }

    /// Whether `ptr` lies inside the region.
    pub fn contains(&self, ptr: DevicePtr) -> bool {
        ptr.0 >= self.base.0 && (ptr.0 - self.base.0) >> self.chunk_shift < u64::from(self.chunks)
    }

    /// Mark `count` consecutive free chunks in use, searching next-fit from the mark;
    /// returns the first chunk's index, or `None` if no run is long enough. The common
    /// case inlines into the caller; the search is out of line.
    #[inline]
    pub fn allocate(&mut self, count: u32) -> Option<u32> {
        if count == 0 || count > self.free_chunks {
            return None;
        }
        if let Some(start) = self.allocate_in_word(count) {
            return Some(start);
        }
        self.allocate_searching(count)
    }

    /// [`Region::allocate`] past its common case (`count` > 0, at most the free chunks).
    #[inline(never)]
    fn allocate_searching(&mut self, count: u32) -> Option<u32> {
        let start = self
            .find_run(self.next_fit, self.chunks, count)
            .or_else(|| {
                // Runs that start before the mark end at most count - 1 chunks past it.
                let to = self.next_fit.saturating_add(count - 1).min(self.chunks);
                self.find_run(0, to, count)
            })?;
        self.set_run(start, count, true);
        self.starts[(start / 64) as usize] |= 1 << (start % 64);
        self.free_chunks -= count;
        let next = start + count;
        self.next_fit = if next >= self.chunks { 0 } else { next };
        Some(start)
    }

    /// The common case of [`Region::allocate`], in a few instructions: the first free
    /// chunk at or after the mark starts a long enough run inside the same word. That is
    /// the run the general search would return (it too takes the first free chunk from
    /// the mark when its run is long enough), so both give the same layouts.
    #[inline]
    fn allocate_in_word(&mut self, count: u32) -> Option<u32> {
        if count >= 64 {
            return None;
        }
        let w = (self.next_fit / 64) as usize;
        let used = *self.words.get(w)?;
        let free = !used & (!0u64 << (self.next_fit % 64));
        if free == 0 {
            return None;
        }
        let shift = free.trailing_zeros();
        if shift + count > 64 {
            return None;
        }
        let mask = ((1u64 << count) - 1) << shift;
        // Phantom bits past the last chunk are set, so a clear run is all real chunks.
        if used & mask != 0 {
            return None;
        }
        self.words[w] = used | mask;
        self.starts[w] |= 1 << shift;
        self.free_chunks -= count;
        let start = w as u32 * 64 + shift;
        let next = start + count;
        self.next_fit = if next >= self.chunks { 0 } else { next };
        Some(start)
    }

    /// Return a run previously handed out by [`Region::allocate`]. The common case
    /// inlines into the caller; the general path, which also reports errors, is out of
    /// line.
    #[inline]
    pub fn free(&mut self, start: u32, count: u32) -> Result<(), RegionError> {
        if self.free_in_word(start, count) {
            return Ok(());
        }
        self.free_general(start, count)
    }

    /// [`Region::free`] past its common case.
    #[inline(never)]
    fn free_general(&mut self, start: u32, count: u32) -> Result<(), RegionError> {
        let end = start
            .checked_add(count)
            .filter(|&e| e <= self.chunks && count > 0);
        if end.is_none() {
            return Err(RegionError::OutOfRange {
                start,
                count,
                chunks: self.chunks,
            });
        }
        let start_bit = 1u64 << (start % 64);
        // Exactly one whole run: it starts here, is fully in use, and the chunk after it
        // is free or starts another run...
        let end = start + count;
        let run_continues =
            end < self.chunks && self.bit(&self.words, end) && !self.bit(&self.starts, end);
        // ...and holds no other run's start (two adjacent runs freed as one).
        let holds_another = next_bit_in(&self.starts, start + 1, end, true).is_some();
        if self.starts[(start / 64) as usize] & start_bit == 0
            || !self.run_is_set(start, count)
            || run_continues
            || holds_another
        {
            return Err(RegionError::NotAllocated { start, count });
        }
        self.starts[(start / 64) as usize] &= !start_bit;
        self.requested[start as usize] = 0;
        self.set_run(start, count, false);
        self.free_chunks += count;
        Ok(())
    }

    /// The common case of [`Region::free`]: a run that ends inside its first word, with
    /// the same checks (it starts a run, is fully in use, and the chunk after it is free
    /// or starts another run) done with masks. False means "not handled here" (not
    /// "invalid"): the general path then decides, and reports any error.
    #[inline(always)]
    fn free_in_word(&mut self, start: u32, count: u32) -> bool {
        let shift = start % 64;
        // end < chunks keeps the chunk after the run real (phantom tail bits are "in use").
        if count == 0
            || count >= 64 - shift
            || u64::from(start) + u64::from(count) >= u64::from(self.chunks)
        {
            return false;
        }
        let w = (start / 64) as usize;
        let (used, starts) = (self.words[w], self.starts[w]);
        let mask = ((1u64 << count) - 1) << shift;
        let first = 1u64 << shift;
        let after = 1u64 << (shift + count);
        let whole_run = starts & mask == first && used & mask == mask;
        let run_continues = used & after != 0 && starts & after == 0;
        if !whole_run || run_continues {
            return false;
        }
        self.words[w] = used & !mask;
        self.starts[w] = starts & !first;
        self.requested[start as usize] = 0;
        self.free_chunks += count;
        true
    }

    /// The start of the latest live run beginning at or before `chunk` and at most
    /// `max_run - 1` chunks before it (no run is longer than `max_run`): the only run
    /// that can cover `chunk`. The caller checks the run's length. Scans at most
    /// `max_run / 64 + 1` words.
    pub fn run_start_at_or_before(&self, chunk: u32, max_run: u32) -> Option<u32> {
        if chunk >= self.chunks {
            return None;
        }
        let lo = chunk.saturating_sub(max_run.saturating_sub(1));
        let mut w = chunk / 64;
        // Keep bits 0..=chunk%64 of the first word.
        let mut word = self.starts[w as usize] & (!0u64 >> (63 - chunk % 64));
        loop {
            if word != 0 {
                let i = w * 64 + 63 - word.leading_zeros();
                return (i >= lo).then_some(i);
            }
            if w == 0 || w * 64 <= lo {
                return None;
            }
            w -= 1;
            word = self.starts[w as usize];
        }
    }

    /// First run of `count` free chunks lying entirely in `[from, to)`.
    fn find_run(&self, from: u32, to: u32, count: u32) -> Option<u32> {
        let mut pos = from;
        while pos < to {
            let start = self.next_bit(pos, to, false)?;
            let limit = start.saturating_add(count).min(to);
            let end = self.next_bit(start, limit, true).unwrap_or(limit);
            if end - start >= count {
                return Some(start);
            }
            pos = end;
        }
        None
    }

    /// Index of the first bit equal to `value` in `[pos, to)`.
    fn next_bit(&self, pos: u32, to: u32, value: bool) -> Option<u32> {
        next_bit_in(&self.words, pos, to, value)
    }

    fn bit(&self, map: &[u64], i: u32) -> bool {
        map[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn run_is_set(&self, start: u32, count: u32) -> bool {
        self.next_bit(start, start + count, false).is_none()
    }

    fn set_run(&mut self, start: u32, count: u32, value: bool) {
        let end = start + count; // callers keep end <= chunks
        let first = (start / 64) as usize;
        let last = ((end - 1) / 64) as usize;
        let head = !0u64 << (start % 64);
        let tail = !0u64 >> (63 - (end - 1) % 64);
        let fill = if value { !0u64 } else { 0 };
        let apply = |word: &mut u64, mask: u64| {
            *word = if value { *word | mask } else { *word & !mask };
        };
        if first == last {
            apply(&mut self.words[first], head & tail);
        } else {
            apply(&mut self.words[first], head);
            self.words[first + 1..last].fill(fill);
            apply(&mut self.words[last], tail);
        }
    }
}

/// The first bit equal to `value` in `map` at or after `pos` and before `to`.
fn next_bit_in(map: &[u64], pos: u32, to: u32, value: bool) -> Option<u32> {
    if pos >= to {
        return None;
    }
    // A word "has a hit" when it differs from `skip` (all ones when looking for a
    // zero, all zeros when looking for a one).
    let skip = if value { 0 } else { !0u64 };
    let first = (pos / 64) as usize;
    // Bits below `pos` in the first word must not count. Most searches end here.
    let head = (*map.get(first)? ^ skip) & (!0u64 << (pos % 64));
    let (w, hits) = if head != 0 {
        (first, head)
    } else {
        let last = ((to - 1) / 64) as usize;
        let rest = map.get(first + 1..=last)?;
        let k = rest.iter().position(|&x| x != skip)?;
        (first + 1 + k, rest[k] ^ skip)
    };
    let i = w as u32 * 64 + hits.trailing_zeros();
    (i < to).then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_next_fit_and_reuses_holes() {
        let mut r = Region::new(DevicePtr(0x1000_0000), 9, 200);
        assert_eq!(r.allocate(10), Some(0));
        assert_eq!(r.allocate(70), Some(10));
        assert_eq!(r.allocate(1), Some(80));
        r.free(0, 10).unwrap();
        // Next fit continues after the mark rather than filling the hole at once.
        assert_eq!(r.allocate(5), Some(81));
        assert_eq!(r.allocate(114), Some(86));
        assert_eq!(r.free_chunks(), 10);
        // The tail is full: the search wraps to the hole at the start.
        assert_eq!(r.allocate(10), Some(0));
        assert_eq!(r.allocate(1), None);
        assert_eq!(r.free_chunks(), 0);
        assert_eq!(r.address_of(81), DevicePtr(0x1000_0000 + 81 * 512));
        assert_eq!(r.run_start_at_or_before(85, 16), Some(81));
        assert_eq!(r.run_start_at_or_before(199, 200), Some(86));
        assert_eq!(
            r.run_start_at_or_before(199, 100),
            None,
            "too far back to cover 199"
        );
        assert_eq!(r.run_start_at_or_before(200, 16), None, "past the end");
    }

    #[test]
    fn runs_crossing_words_and_the_tail_are_exact() {
        let mut r = Region::new(DevicePtr(0), 9, 130);
        assert_eq!(r.allocate(63), Some(0));
        assert_eq!(r.allocate(66), Some(63));
        assert_eq!(r.allocate(2), None); // one chunk left; phantom tail bits never count
        assert_eq!(r.allocate(1), Some(129));
        r.free(63, 66).unwrap();
        assert_eq!(r.allocate(67), None);
        assert_eq!(r.allocate(66), Some(63));
    }

    #[test]
    fn bad_frees_are_errors_and_change_nothing() {
        let mut r = Region::new(DevicePtr(0), 9, 128);
        let a = r.allocate(4).unwrap();
        assert_eq!(
            r.free(a, 5),
            Err(RegionError::NotAllocated { start: a, count: 5 })
        );
        // Only a whole run, from its first chunk, can be freed.
        for (start, count) in [(a + 1, 3), (a, 3)] {
            assert_eq!(
                r.free(start, count),
                Err(RegionError::NotAllocated { start, count })
            );
        }
        assert_eq!(
            r.free(127, 2),
            Err(RegionError::OutOfRange {
                start: 127,
                count: 2,
                chunks: 128
            })
        );
        assert_eq!(
            r.free(u32::MAX, 2),
            Err(RegionError::OutOfRange {
                start: u32::MAX,
                count: 2,
                chunks: 128
            })
        );
        assert_eq!(
            r.free(0, 0),
            Err(RegionError::OutOfRange {
                start: 0,
                count: 0,
                chunks: 128
            })
        );
        assert_eq!(r.free_chunks(), 124);
        r.free(a, 4).unwrap();
        assert!(r.is_empty());
        assert_eq!(
            r.free(a, 4),
            Err(RegionError::NotAllocated { start: a, count: 4 })
        );
    }

    #[test]
    fn two_adjacent_runs_are_not_freed_as_one_across_words() {
        // The proptest model's case: runs meeting inside a longer span that crosses a word.
        let mut r = Region::new(DevicePtr(0), 9, 233);
        assert_eq!(r.allocate(50), Some(0));
        assert_eq!(r.allocate(40), Some(50));
        assert_eq!(r.allocate(30), Some(90));
        assert_eq!(
            r.free(50, 70),
            Err(RegionError::NotAllocated {
                start: 50,
                count: 70
            }),
            "runs (50, 40) and (90, 30) freed as one"
        );
        assert_eq!(r.free_chunks(), 233 - 120);
        r.free(50, 40).unwrap();
        r.free(90, 30).unwrap();
        r.free(0, 50).unwrap();
        assert!(r.is_empty());
    }

    #[test]
    fn sized_runs_free_from_their_start_alone() {
        let mut r = Region::new(DevicePtr(0), 9, 256);
        let a = r.allocate_sized(1000).unwrap(); // 2 chunks
        let b = r.allocate_sized(1).unwrap(); // 1 chunk
        let c = r.allocate_sized(512 * 70 + 3).unwrap(); // 71 chunks, crosses a word
        assert_eq!((a, b, c), (0, 2, 3));
        assert_eq!(r.allocate_sized(0), None);
        assert_eq!(r.requested_at(a), Some(1000));
        assert_eq!(r.requested_at(a + 1), None, "interior chunk");
        assert_eq!(
            r.sized_runs().collect::<Vec<_>>(),
            [(0, 1000), (2, 1), (3, 512 * 70 + 3)]
        );
        assert_eq!(r.live_runs(), 3);
        assert_eq!(r.free_sized(c), Ok((512 * 70 + 3, 71)));
        assert_eq!(
            r.free_sized(c),
            Err(RegionError::NotAllocated { start: c, count: 0 }),
            "double free"
        );
        assert_eq!(
            r.free_sized(a + 1),
            Err(RegionError::NotAllocated { start: 1, count: 0 })
        );
        // An unsized run (raw allocate) is not freed by the sized call.
        let raw = r.allocate(4).unwrap();
        assert!(r.free_sized(raw).is_err());
        r.free(raw, 4).unwrap();
        assert_eq!(r.free_sized(a), Ok((1000, 2)));
        assert_eq!(r.free_sized(b), Ok((1, 1)));
        assert!(r.is_empty());
        assert_eq!(r.sized_runs().count(), 0);
    }

    #[test]
    fn whole_default_region_fills_exactly() {
        let mut r = Region::new(DevicePtr(1 << 40), 9, 262_144);
        let mut n = 0;
        while r.allocate(4095).is_some() {
            n += 1;
        }
        assert_eq!(n, 262_144 / 4095);
        assert_eq!(r.free_chunks(), 262_144 % 4095);
        assert!(r.allocate(r.free_chunks()).is_some());
        assert_eq!(r.free_chunks(), 0);
        assert!(r.contains(DevicePtr((1 << 40) + (128 << 20) - 1)));
        assert!(!r.contains(DevicePtr((1 << 40) + (128 << 20))));
        assert!(!r.contains(DevicePtr((1 << 40) - 1)));
    }
}
