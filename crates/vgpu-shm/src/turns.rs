//! The turn board: one small file per physical GPU in a directory every container of the
//! node mounts (HAMi's device plugin mounts the host's `/tmp/vgpulock` into each container),
//! where each container with an SM limit announces itself, so that containers limited on the
//! same GPU can take turns instead of time-slicing each other's work (see docs/sm-limit.md).
//!
//! Layout (little-endian u64 words, all accessed atomically):
//! `[0]` magic `VGPUTURN`, `[1]` version, then [`TURN_ENTRIES`] entries of four words:
//! tenant key, SM limit in percent, heartbeat (CLOCK_MONOTONIC nanoseconds), and the GPU
//! time of the tenant's typical launch in nanoseconds (which sets the common cycle).
//! An entry whose heartbeat is older than the reader's `max_age` is not a tenant; a writer
//! may take it over. No locks: a tenant only ever writes its own entry, and an entry changes
//! hands by compare-and-swap of its key.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sys::Mapping;
use crate::table::open_or_create_shared;

/// Entries in a board: tenants (containers) announced on one GPU at a time.
pub const TURN_ENTRIES: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"VGPUTURN");
const VERSION: u64 = 1;
const HEADER_WORDS: usize = 2;
const ENTRY_WORDS: usize = 4;
/// File length: header and entries, rounded to a page.
pub const TURN_FILE_LEN: usize = 4096;
const _: () = assert!((HEADER_WORDS + TURN_ENTRIES * ENTRY_WORDS) * 8 <= TURN_FILE_LEN);

/// Why a turn board cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TurnBoardError {
    /// A system call failed.
    #[error("turn board {path}: {op} failed: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was attempted.
        op: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The file is something else, or another version.
    #[error("turn board {path} is not a vgpu turn board (magic {magic:#x}, version {version})")]
    Foreign {
        /// The file.
        path: PathBuf,
        /// Word 0.
        magic: u64,
        /// Word 1.
        version: u64,
    },
    /// Every entry is held by a live tenant.
    #[error("turn board is full ({TURN_ENTRIES} live tenants)")]
    Full,
}

/// One announced tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant {
    /// Its key (the same for every process of one container).
    pub key: u64,
    /// Its SM limit, percent (1..=99).
    pub limit_pct: u32,
    /// GPU time of its typical launch, nanoseconds (0: unknown).
    pub launch_ns: u64,
}

/// An open turn board.
#[derive(Debug)]
pub struct TurnBoard {
    map: Mapping,
    /// The entry this process last wrote (a hint; verified by key on every write).
    mine: Option<usize>,
    _file: File,
}

impl TurnBoard {
    /// Opens the board at `path`, creating it (mode 0666 whatever the umask) if needed.
    pub fn open_or_create(path: impl AsRef<Path>) -> Result<Self, TurnBoardError> {
        let path = path.as_ref();
        let io = |op: &'static str| {
            let path = path.to_path_buf();
            move |source: io::Error| TurnBoardError::Io { path, op, source }
        };
        let file = open_or_create_shared(path).map_err(|(op, e)| io(op)(e))?;
        let meta = file.metadata().map_err(io("fstat"))?;
        if !meta.is_file() {
            return Err(io("open")(io::Error::other("not a regular file")));
        }
        if meta.len() < TURN_FILE_LEN as u64 {
            // Growing only zero-fills; concurrent openers may both do it.
            file.set_len(TURN_FILE_LEN as u64)
                .map_err(io("ftruncate"))?;
        }
        let map = Mapping::map(&file, TURN_FILE_LEN, true).map_err(io("mmap"))?;
        let board = Self {
            map,
            mine: None,
            _file: file,
        };
        let (magic, version) = (board.word(0)?, board.word(1)?);
        // A zero header is a fresh file: claim it. Otherwise it must be ours.
        match magic.compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => version.store(VERSION, Ordering::Release),
            Err(MAGIC) => {
                // The creator stores the version right after the magic.
                let mut v = version.load(Ordering::Acquire);
                for _ in 0..1000 {
                    if v != 0 {
                        break;
                    }
                    std::thread::yield_now();
                    v = version.load(Ordering::Acquire);
                }
                if v != VERSION {
                    return Err(board.foreign(path));
                }
            }
            Err(_) => return Err(board.foreign(path)),
        }
        Ok(board)
    }

    fn foreign(&self, path: &Path) -> TurnBoardError {
        let load = |i: usize| self.map.load_u64(i * 8).unwrap_or(0);
        TurnBoardError::Foreign {
            path: path.to_path_buf(),
            magic: load(0),
            version: load(1),
        }
    }

    fn word(&self, i: usize) -> Result<&AtomicU64, TurnBoardError> {
        self.map.atomic_u64(i * 8).ok_or(TurnBoardError::Full)
    }

    fn entry(&self, e: usize) -> Option<[&AtomicU64; 4]> {
        let base = (HEADER_WORDS + e * ENTRY_WORDS) * 8;
        Some([
            self.map.atomic_u64(base)?,
            self.map.atomic_u64(base + 8)?,
            self.map.atomic_u64(base + 16)?,
            self.map.atomic_u64(base + 24)?,
        ])
    }

    /// Announces tenant `key` (non-zero) with `limit_pct` and its typical launch length
    /// at time `now`; an entry whose heartbeat is older than `stale` (or never written)
    /// may be taken over.
    pub fn announce(
        &mut self,
        key: u64,
        limit_pct: u32,
        launch_ns: u64,
        now: u64,
        stale: u64,
    ) -> Result<(), TurnBoardError> {
        let key = key.max(1);
        let write = |[_, pct, beat, launch]: [&AtomicU64; 4]| {
            pct.store(u64::from(limit_pct), Ordering::Relaxed);
            launch.store(launch_ns, Ordering::Relaxed);
            beat.store(now, Ordering::Release);
        };
        if let Some(e) = self.mine.and_then(|i| self.entry(i).map(|w| (i, w))) {
            if e.1[0].load(Ordering::Acquire) == key {
                write(e.1);
                return Ok(());
            }
        }
        // Our key may already be there (another process of the container).
        for i in 0..TURN_ENTRIES {
            let Some(w) = self.entry(i) else { break };
            if w[0].load(Ordering::Acquire) == key {
                write(w);
                self.mine = Some(i);
                return Ok(());
            }
        }
        for i in 0..TURN_ENTRIES {
            let Some(w) = self.entry(i) else { break };
            let old = w[0].load(Ordering::Acquire);
            let beat = w[2].load(Ordering::Acquire);
            if old != 0 && now.saturating_sub(beat) <= stale {
                continue;
            }
            // Refresh the heartbeat first so that readers never see our key with the old
            // holder's stale beat counted as ours for long; then take the key.
            if w[0]
                .compare_exchange(old, key, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                write(w);
                self.mine = Some(i);
                return Ok(());
            }
        }
        Err(TurnBoardError::Full)
    }

    /// Tenants whose heartbeat is at most `max_age` old at `now`, sorted by key, one per
    /// key (the freshest).
    pub fn tenants(&self, now: u64, max_age: u64) -> Vec<Tenant> {
        let mut out: Vec<Tenant> = Vec::new();
        for i in 0..TURN_ENTRIES {
            let Some([key, pct, beat, launch]) = self.entry(i) else {
                break;
            };
            let k = key.load(Ordering::Acquire);
            let b = beat.load(Ordering::Acquire);
            let p = pct.load(Ordering::Relaxed);
            if k == 0 || now.saturating_sub(b) > max_age || !(1..100).contains(&p) {
                continue;
            }
            if !out.iter().any(|t| t.key == k) {
                out.push(Tenant {
                    key: k,
                    limit_pct: p as u32,
                    launch_ns: launch.load(Ordering::Relaxed),
                });
            }
        }
        out.sort_by_key(|t| t.key);
        out
    }

    /// Withdraws `key` (a container's last limited process exits), so others need not wait
    /// for its heartbeat to age out.
    pub fn withdraw(&mut self, key: u64) {
        let key = key.max(1);
        for i in 0..TURN_ENTRIES {
            let Some(w) = self.entry(i) else { break };
            if w[0].load(Ordering::Acquire) == key {
                w[2].store(0, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn path(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vgpu-turns-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        dir
    }

    #[test]
    fn tenants_announce_age_out_and_share_one_entry_per_key() {
        let p = path("basic");
        let mut a = TurnBoard::open_or_create(&p).unwrap();
        let mut a2 = TurnBoard::open_or_create(&p).unwrap(); // same container, other process
        let mut b = TurnBoard::open_or_create(&p).unwrap();
        a.announce(7, 30, 0, 1000 * MS, 500 * MS).unwrap();
        a2.announce(7, 30, 0, 1001 * MS, 500 * MS).unwrap();
        b.announce(3, 70, 0, 1002 * MS, 500 * MS).unwrap();
        let t = a.tenants(1003 * MS, 300 * MS);
        assert_eq!(
            t,
            [
                Tenant {
                    key: 3,
                    limit_pct: 70,
                    launch_ns: 0
                },
                Tenant {
                    key: 7,
                    limit_pct: 30,
                    launch_ns: 0
                }
            ]
        );
        // b stops announcing: it ages out; its entry is then reusable.
        a.announce(7, 30, 0, 1400 * MS, 500 * MS).unwrap();
        assert_eq!(
            a.tenants(1400 * MS, 300 * MS),
            [Tenant {
                key: 7,
                limit_pct: 30,
                launch_ns: 0
            }]
        );
        a.withdraw(7);
        assert!(a.tenants(1400 * MS, 300 * MS).is_empty());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_full_board_refuses_and_stale_entries_are_taken_over() {
        let p = path("full");
        let mut boards: Vec<TurnBoard> = (0..TURN_ENTRIES)
            .map(|_| TurnBoard::open_or_create(&p).unwrap())
            .collect();
        for (i, b) in boards.iter_mut().enumerate() {
            b.announce(100 + i as u64, 10, 0, 10 * MS, 500 * MS)
                .unwrap();
        }
        let mut late = TurnBoard::open_or_create(&p).unwrap();
        assert!(matches!(
            late.announce(1, 10, 0, 20 * MS, 500 * MS),
            Err(TurnBoardError::Full)
        ));
        // Half a second later every entry is stale: the newcomer takes one over.
        late.announce(1, 10, 0, 600 * MS, 500 * MS).unwrap();
        assert_eq!(
            late.tenants(600 * MS, 300 * MS),
            [Tenant {
                key: 1,
                limit_pct: 10,
                launch_ns: 0
            }]
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_foreign_file_is_refused_and_left_alone() {
        let p = path("foreign");
        std::fs::write(&p, b"not a turn board, just some bytes").unwrap();
        let err = TurnBoard::open_or_create(&p).unwrap_err();
        assert!(matches!(err, TurnBoardError::Foreign { .. }), "{err}");
        let _ = std::fs::remove_file(&p);
    }
}
