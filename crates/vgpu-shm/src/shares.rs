//! Share-mode records on the turn board (`VGPU_SM_MODE=share`, docs/sm-limit.md).
//!
//! **Invariant.** Record `e` belongs to turn entry `e` and counts only while its key equals
//! that entry's key: the entry is allocated (and taken over when stale) under the board's
//! `flock` by [`crate::TurnBoard::announce`], so a record outlives neither its entry nor its
//! writer's heartbeat. Every word of every record is hostile input: [`decode`] refuses
//! out-of-range values, and the limiter's arithmetic (`vgpu_limiter::share::allot`) never
//! lets a record lower a reader's own guarantee, only what it borrows.
//!
//! Layout: a region after the turn entries (word [`REGION_WORD`], so readers of the turn
//! board alone never see it and a truncated file reads as no records), [`TURN_ENTRIES`]
//! records of [`RECORD_WORDS`] little-endian u64 words:
//! `[0]` key, `[1]` share % (bits 0..8) | ceiling % (8..16) | priority as u32 (16..48),
//! `[2]` GPU time of a typical launch (ns), `[3]` busy_until (`CLOCK_MONOTONIC` ns: until
//! when the tenant has work), `[4]` heartbeat (ns), `[5]` achieved % (0..8) | part now %
//! (8..16), `[6]` lent ns, `[7]` borrowed ns. A writer writes only its own record, without
//! the lock (the entry is its own once allocated); the hot path rewrites word 3 alone.

use std::io;

use std::path::Path;

use crate::TurnBoardError;
use crate::turns::{TURN_ENTRIES, TURN_IMAGE_WORDS, entry_keys_of, open_error, read_board};

/// First word of the share region in the board file.
pub const REGION_WORD: usize = TURN_IMAGE_WORDS;
/// Words per record.
pub const RECORD_WORDS: usize = 8;
const BUSY_WORD: usize = 3;

/// One container's share-mode record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShareRecord {
    /// The container's key (as in its turn entry; never 0).
    pub key: u64,
    /// Guaranteed share, percent (0..=100).
    pub share_pct: u8,
    /// Ceiling, percent (1..=100).
    pub ceiling_pct: u8,
    /// `CUDA_TASK_PRIORITY` (lower is more urgent).
    pub priority: i32,
    /// GPU time of its typical launch, ns.
    pub launch_ns: u64,
    /// Until when it has work.
    pub busy_until: u64,
    /// When it last wrote the record.
    pub heartbeat: u64,
    /// Achieved utilization, percent.
    pub util_pct: u8,
    /// Its part of the GPU now, percent.
    pub allot_pct: u8,
    /// GPU time of its guarantee lent to others so far, ns.
    pub lent_ns: u64,
    /// GPU time used above its guarantee so far, ns.
    pub borrowed_ns: u64,
}

/// Word storage of the share region (the board file; memory in tests).
pub trait RecordStore {
    /// Reads `buf.len()` words from word `first`; words past the end read as zero.
    fn read_words(&self, first: usize, buf: &mut [u64]) -> io::Result<()>;
    /// Writes `words` at word `first`.
    fn write_words(&self, first: usize, words: &[u64]) -> io::Result<()>;
}

impl RecordStore for std::fs::File {
    fn read_words(&self, first: usize, buf: &mut [u64]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0u8; buf.len() * 8];
        let mut done = 0;
        while done < bytes.len() {
            match self.read_at(&mut bytes[done..], (first * 8 + done) as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        for (w, chunk) in buf.iter_mut().zip(bytes.chunks_exact(8)) {
            *w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
        }
        Ok(())
    }

    fn write_words(&self, first: usize, words: &[u64]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.write_all_at(&bytes, (first * 8) as u64)
    }
}

/// The words of a record.
pub fn encode(r: &ShareRecord) -> [u64; RECORD_WORDS] {
    [
        r.key,
        u64::from(r.share_pct) | u64::from(r.ceiling_pct) << 8 | u64::from(r.priority as u32) << 16,
        r.launch_ns,
        r.busy_until,
        r.heartbeat,
        u64::from(r.util_pct) | u64::from(r.allot_pct) << 8,
        r.lent_ns,
        r.borrowed_ns,
    ]
}

/// A record from its words, or `None` when they cannot be one (free, or out of range).
pub fn decode(w: &[u64; RECORD_WORDS]) -> Option<ShareRecord> {
    let share = w[1] & 0xff;
    let ceiling = (w[1] >> 8) & 0xff;
    let (util, allot) = (w[5] & 0xff, (w[5] >> 8) & 0xff);
    let valid = w[0] != 0
        && w[4] != 0
        && share <= 100
        && (1..=100).contains(&ceiling)
        && w[1] >> 48 == 0
        && util <= 100
        && allot <= 100
        && w[5] >> 16 == 0;
    valid.then(|| ShareRecord {
        key: w[0],
        share_pct: share as u8,
        ceiling_pct: ceiling as u8,
        priority: ((w[1] >> 16) & 0xffff_ffff) as u32 as i32,
        launch_ns: w[2],
        busy_until: w[3],
        heartbeat: w[4],
        util_pct: util as u8,
        allot_pct: allot as u8,
        lent_ns: w[6],
        borrowed_ns: w[7],
    })
}

fn record_word(entry: usize) -> usize {
    REGION_WORD + entry * RECORD_WORDS
}

/// Writes `r` as record `entry` (this container's turn entry).
pub fn write_record(store: &impl RecordStore, entry: usize, r: &ShareRecord) -> io::Result<()> {
    if entry >= TURN_ENTRIES {
        return Err(io::Error::other("share record index out of range"));
    }
    store.write_words(record_word(entry), &encode(r))
}

/// Rewrites only the `busy_until` of record `entry` (the hot path: one `pwrite`).
pub fn write_busy_until(store: &impl RecordStore, entry: usize, busy_until: u64) -> io::Result<()> {
    if entry >= TURN_ENTRIES {
        return Err(io::Error::other("share record index out of range"));
    }
    store.write_words(record_word(entry) + BUSY_WORD, &[busy_until])
}

/// Every valid record whose key equals its turn entry's key (`keys[e]`, 0 = free), one per
/// key (the first), in entry order: one `pread` of the region.
pub fn read_records(store: &impl RecordStore, keys: &[u64]) -> io::Result<Vec<ShareRecord>> {
    // Records count only under an entry's key: read up to the last entry that has one (the
    // launch path reads this every 5 ms, every 50 µs beside a more urgent tenant; a board
    // holds a few tenants, not 64).
    let entries = keys
        .iter()
        .rposition(|&k| k != 0)
        .map_or(0, |i| i + 1)
        .min(TURN_ENTRIES);
    if entries == 0 {
        return Ok(Vec::new());
    }
    let mut words = vec![0u64; entries * RECORD_WORDS];
    store.read_words(REGION_WORD, &mut words)?;
    let mut out: Vec<ShareRecord> = Vec::new();
    for (e, chunk) in words.chunks_exact(RECORD_WORDS).enumerate() {
        let w: &[u64; RECORD_WORDS] = chunk.try_into().expect("chunk of RECORD_WORDS");
        let Some(r) = decode(w) else { continue };
        if keys.get(e).is_some_and(|&k| k == r.key) && !out.iter().any(|o| o.key == r.key) {
            out.push(r);
        }
    }
    Ok(out)
}

/// Every share record of the board at `path`, read-only (for `vgpu status` and the
/// exporter, through [`crate::NodeReader::share_records`]): the file is opened as every read
/// of a board is (no link followed, no FIFO waited on), the turn entries and the records are
/// copied with `pread`; a missing, refused or foreign file is an error.
pub(crate) fn read_share_records(path: &Path) -> Result<Vec<ShareRecord>, TurnBoardError> {
    let keys = entry_keys_of(&read_board(path)?);
    let file = crate::file::open_read_only(path)
        .map_err(|e| open_error(path, e))?
        .file;
    read_records(&file, &keys).map_err(|source| TurnBoardError::Io {
        path: path.to_path_buf(),
        op: "read",
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// Words in memory; reads past the end give zero, as a short file does.
    #[derive(Default)]
    struct Memory(RefCell<Vec<u64>>);

    impl RecordStore for Memory {
        fn read_words(&self, first: usize, buf: &mut [u64]) -> io::Result<()> {
            let m = self.0.borrow();
            for (i, w) in buf.iter_mut().enumerate() {
                *w = m.get(first + i).copied().unwrap_or(0);
            }
            Ok(())
        }
        fn write_words(&self, first: usize, words: &[u64]) -> io::Result<()> {
            let mut m = self.0.borrow_mut();
            if m.len() < first + words.len() {
                m.resize(first + words.len(), 0);
            }
            m[first..first + words.len()].copy_from_slice(words);
            Ok(())
        }
    }

    fn record(key: u64) -> ShareRecord {
        ShareRecord {
            key,
            share_pct: 30,
            ceiling_pct: 80,
            priority: -2,
            launch_ns: 47_000,
            busy_until: 123,
            heartbeat: 100,
            util_pct: 29,
            allot_pct: 30,
            lent_ns: 5,
            borrowed_ns: 6,
        }
    }

    fn keys(pairs: &[(usize, u64)]) -> Vec<u64> {
        let mut k = vec![0; TURN_ENTRIES];
        for &(e, key) in pairs {
            k[e] = key;
        }
        k
    }

    #[test]
    fn records_round_trip_and_the_hot_path_writes_one_word() {
        let m = Memory::default();
        write_record(&m, 3, &record(7)).unwrap();
        write_busy_until(&m, 3, 999).unwrap();
        let got = read_records(&m, &keys(&[(3, 7)])).unwrap();
        assert_eq!(
            got,
            [ShareRecord {
                busy_until: 999,
                ..record(7)
            }]
        );
        assert!(write_busy_until(&m, TURN_ENTRIES, 1).is_err());
    }

    #[test]
    fn a_record_counts_only_under_its_entrys_key() {
        // A taken-over entry keeps the old tenant's record until the new one writes: the
        // key no longer matches, so it is no tenant. A duplicated key counts once.
        let m = Memory::default();
        write_record(&m, 0, &record(7)).unwrap();
        write_record(&m, 1, &record(7)).unwrap();
        write_record(&m, 2, &record(8)).unwrap();
        let got = read_records(&m, &keys(&[(0, 7), (1, 7), (2, 9)])).unwrap();
        assert_eq!(got.iter().map(|r| r.key).collect::<Vec<_>>(), [7]);
        assert!(read_records(&m, &[]).unwrap().is_empty(), "no turn entries");
    }

    #[test]
    fn out_of_range_words_are_refused() {
        let good = encode(&record(7));
        assert!(decode(&good).is_some());
        let bad = |i: usize, v: u64| {
            let mut w = good;
            w[i] = v;
            decode(&w)
        };
        assert!(bad(0, 0).is_none(), "free");
        assert!(bad(4, 0).is_none(), "no heartbeat");
        assert!(bad(1, 101).is_none(), "share over 100");
        assert!(bad(1, 30).is_none(), "ceiling 0");
        assert!(bad(1, 30 | 101 << 8).is_none(), "ceiling over 100");
        assert!(bad(1, good[1] | 1 << 50).is_none(), "stray bits");
        assert!(bad(5, 101).is_none(), "utilization over 100");
        // Any priority is a priority (the arithmetic bounds what it can do).
        let p = |v: i32| {
            decode(&encode(&ShareRecord {
                priority: v,
                ..record(7)
            }))
            .unwrap()
        };
        assert_eq!(
            (p(i32::MIN).priority, p(i32::MAX).priority),
            (i32::MIN, i32::MAX)
        );
    }

    #[test]
    fn records_live_beside_the_turn_entries_of_a_real_board() {
        use crate::TurnBoard;
        const MS: u64 = 1_000_000;
        let p = std::env::temp_dir().join(format!("vgpu-shares-board-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let mut a = TurnBoard::open_or_create(&p).unwrap();
        let mut b = TurnBoard::open_or_create(&p).unwrap();
        a.announce(7, 30, 0, 10 * MS, 500 * MS, 300 * MS).unwrap();
        b.announce(9, 70, 0, 10 * MS, 500 * MS, 300 * MS).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        write_record(&file, a.entry().unwrap(), &record(7)).unwrap();
        write_record(&file, b.entry().unwrap(), &record(9)).unwrap();
        let got = read_records(&file, &a.entry_keys()).unwrap();
        assert_eq!(got.iter().map(|r| r.key).collect::<Vec<_>>(), [7, 9]);
        assert_eq!(crate::NodeReader::default().share_records(&p).unwrap(), got);
        // The hook's own handle on the records is opened as writes of the board are.
        let rw = a.open_records().unwrap();
        write_busy_until(&rw, a.entry().unwrap(), 4242).unwrap();
        assert_eq!(
            read_records(&rw, &a.entry_keys()).unwrap()[0].busy_until,
            4242
        );
        // The turn board itself still reads (its readers never look past the entries).
        assert_eq!(a.tenants(11 * MS, 300 * MS).len(), 2);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_file_holds_the_region_after_the_turn_entries_and_a_short_one_has_none() {
        let p = std::env::temp_dir().join(format!("vgpu-shares-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        assert!(read_records(&f, &keys(&[(5, 7)])).unwrap().is_empty());
        write_record(&f, 5, &record(7)).unwrap();
        let len = f.metadata().unwrap().len();
        assert_eq!(len, ((REGION_WORD + 6 * RECORD_WORDS) * 8) as u64);
        assert_eq!(read_records(&f, &keys(&[(5, 7)])).unwrap(), [record(7)]);
        f.set_len((REGION_WORD * 8) as u64).unwrap();
        assert!(read_records(&f, &keys(&[(5, 7)])).unwrap().is_empty());
        let _ = std::fs::remove_file(&p);
    }
}
