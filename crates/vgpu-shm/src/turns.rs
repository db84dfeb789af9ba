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
//! hands by compare-and-swap of its stale heartbeat (loom models below).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sync::Atomic64;
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

/// The key a container announces itself with: derived from its usage file's device and
/// inode, so every process of the container has the same one and two containers (two
/// files) differ. Never 0.
pub fn container_key(usage_file: impl AsRef<Path>) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(usage_file)?;
    Ok((m.dev().rotate_left(32) ^ m.ino()).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
}

/// The board's file name for the GPU with this UUID, inside the turn board directory.
pub fn board_file_name(gpu_uuid: &str) -> String {
    let name: String = gpu_uuid
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("vgpu-turns-{name}")
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
    /// When it last announced itself (`CLOCK_MONOTONIC` nanoseconds).
    pub heartbeat_ns: u64,
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

    /// Opens an existing board read-only (inspection: `vgpu status`); never creates or
    /// writes. A short, foreign or other-version file is an error.
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self, TurnBoardError> {
        let path = path.as_ref();
        let io = |op: &'static str| {
            let path = path.to_path_buf();
            move |source: io::Error| TurnBoardError::Io { path, op, source }
        };
        let file = File::open(path).map_err(io("open"))?;
        let meta = file.metadata().map_err(io("fstat"))?;
        if !meta.is_file() || meta.len() < TURN_FILE_LEN as u64 {
            return Err(io("open")(io::Error::other(
                "not a regular file of a turn board's length",
            )));
        }
        let map = Mapping::map(&file, TURN_FILE_LEN, false).map_err(io("mmap"))?;
        let board = Self {
            map,
            mine: None,
            _file: file,
        };
        let load = |i: usize| board.map.load_u64(i * 8).unwrap_or(0);
        if load(0) != MAGIC || load(1) != VERSION {
            return Err(board.foreign(path));
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
        let mine = announce_in(&self.map, self.mine, key, limit_pct, launch_ns, now, stale)
            .ok_or(TurnBoardError::Full)?;
        self.mine = Some(mine);
        Ok(())
    }

    /// Tenants whose heartbeat is at most `max_age` old at `now`, sorted by key, one per
    /// key.
    pub fn tenants(&self, now: u64, max_age: u64) -> Vec<Tenant> {
        tenants_in(&self.map, now, max_age)
    }

    /// Withdraws `key` (a container's last limited process exits), so others need not wait
    /// for its heartbeat to age out.
    pub fn withdraw(&mut self, key: u64) {
        withdraw_in(&self.map, key);
    }
}

/// The board's words wherever they live: the mapped file, or loom's atomics in the models.
pub(crate) trait BoardWords {
    type A: Atomic64;
    /// Word `i` of the board, if the board has it.
    fn word(&self, i: usize) -> Option<&Self::A>;
}

impl BoardWords for Mapping {
    type A = std::sync::atomic::AtomicU64;
    fn word(&self, i: usize) -> Option<&Self::A> {
        self.atomic_u64(i * 8)
    }
}

/// Entry `e`'s words: key, limit, heartbeat, launch length.
fn entry<W: BoardWords>(w: &W, e: usize) -> Option<[&W::A; 4]> {
    let base = HEADER_WORDS + e * ENTRY_WORDS;
    Some([
        w.word(base)?,
        w.word(base + 1)?,
        w.word(base + 2)?,
        w.word(base + 3)?,
    ])
}

/// [`TurnBoard::announce`] on any board; `hint` is the entry last written. Returns the
/// entry now holding `key`, or `None` when every entry is held by a live tenant.
pub(crate) fn announce_in<W: BoardWords>(
    w: &W,
    hint: Option<usize>,
    key: u64,
    limit_pct: u32,
    launch_ns: u64,
    now: u64,
    stale: u64,
) -> Option<usize> {
    let key = key.max(1);
    let write = |[_, pct, beat, launch]: [&W::A; 4]| {
        pct.store(u64::from(limit_pct), Ordering::Relaxed);
        launch.store(launch_ns, Ordering::Relaxed);
        beat.store(now, Ordering::Release);
    };
    if let Some((i, e)) = hint.and_then(|i| entry(w, i).map(|e| (i, e))) {
        if e[0].load(Ordering::Acquire) == key {
            write(e);
            return Some(i);
        }
    }
    // Our key may already be there (another process of the container).
    for i in 0..TURN_ENTRIES {
        let Some(e) = entry(w, i) else { break };
        if e[0].load(Ordering::Acquire) == key {
            write(e);
            return Some(i);
        }
    }
    for i in 0..TURN_ENTRIES {
        let Some(e) = entry(w, i) else { break };
        let beat = e[2].load(Ordering::Acquire);
        // A fresh heartbeat means a live tenant, or a newcomer that has just won the entry
        // and not yet written its key: either way, not ours to take.
        if beat != 0 && now.saturating_sub(beat) <= stale {
            continue;
        }
        // Win the entry by moving its heartbeat off the stale value we saw: of several
        // newcomers only one can (a claim by the key alone let a second newcomer see the
        // first one's key with the stale beat and take the entry again; loom found it).
        // Until our key lands, readers may see the old key with a fresh beat for a moment.
        if e[2]
            .compare_exchange(beat, now.max(1), Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        e[0].store(key, Ordering::Release);
        write(e);
        return Some(i);
    }
    None
}

/// [`TurnBoard::tenants`] on any board.
pub(crate) fn tenants_in<W: BoardWords>(w: &W, now: u64, max_age: u64) -> Vec<Tenant> {
    let mut out: Vec<Tenant> = Vec::new();
    for i in 0..TURN_ENTRIES {
        let Some([key, pct, beat, launch]) = entry(w, i) else {
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
                heartbeat_ns: b,
            });
        }
    }
    out.sort_by_key(|t| t.key);
    out
}

/// [`TurnBoard::withdraw`] on any board.
pub(crate) fn withdraw_in<W: BoardWords>(w: &W, key: u64) {
    let key = key.max(1);
    for i in 0..TURN_ENTRIES {
        let Some(e) = entry(w, i) else { break };
        if e[0].load(Ordering::Acquire) == key {
            e[2].store(0, Ordering::Release);
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
        let kp = |v: Vec<Tenant>| -> Vec<(u64, u32)> {
            v.iter().map(|t| (t.key, t.limit_pct)).collect()
        };
        let t = kp(a.tenants(1003 * MS, 300 * MS));
        assert_eq!(t, [(3, 70), (7, 30)]);
        // b stops announcing: it ages out; its entry is then reusable.
        a.announce(7, 30, 0, 1400 * MS, 500 * MS).unwrap();
        assert_eq!(kp(a.tenants(1400 * MS, 300 * MS)), [(7, 30)]);
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
        let t = late.tenants(600 * MS, 300 * MS);
        assert_eq!((t.len(), t[0].key, t[0].heartbeat_ns), (1, 1, 600 * MS));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_read_only_open_sees_the_tenants_and_never_creates() {
        let p = path("ro");
        assert!(
            TurnBoard::open_read_only(&p).is_err(),
            "no file: nothing created"
        );
        assert!(!p.exists());
        let mut w = TurnBoard::open_or_create(&p).unwrap();
        w.announce(5, 40, 123_000, 10 * MS, 500 * MS).unwrap();
        let r = TurnBoard::open_read_only(&p).unwrap();
        let t = r.tenants(11 * MS, 300 * MS);
        assert_eq!(
            (t[0].key, t[0].limit_pct, t[0].launch_ns, t[0].heartbeat_ns),
            (5, 40, 123_000, 10 * MS)
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

#[cfg(all(test, loom))]
mod loom_tests {
    //! Run: `RUSTFLAGS="--cfg loom" cargo test -p vgpu-shm --release --lib loom`.
    use super::*;
    use crate::sync::AtomicU64 as LoomU64;
    use loom::sync::Arc;
    use loom::thread;

    /// A board of `entries` entries in loom's atomics.
    struct HeapBoard(Vec<LoomU64>);

    impl HeapBoard {
        fn new(entries: usize) -> Self {
            Self(
                (0..HEADER_WORDS + entries * ENTRY_WORDS)
                    .map(|_| LoomU64::new(0))
                    .collect(),
            )
        }
    }

    impl BoardWords for HeapBoard {
        type A = LoomU64;
        fn word(&self, i: usize) -> Option<&LoomU64> {
            self.0.get(i)
        }
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(f);
    }

    /// Two containers announce at once on a board with room for both: each gets its own
    /// entry and both are listed.
    #[test]
    fn loom_two_tenants_announce_at_once_into_distinct_entries() {
        model(|| {
            let board = Arc::new(HeapBoard::new(2));
            let go = |key: u64, pct: u32, b: Arc<HeapBoard>| {
                move || announce_in(&*b, None, key, pct, 0, 100, 50)
            };
            let t1 = thread::spawn(go(7, 30, board.clone()));
            let t2 = thread::spawn(go(9, 70, board.clone()));
            let (e1, e2) = (t1.join().unwrap(), t2.join().unwrap());
            assert!(e1.is_some() && e2.is_some() && e1 != e2, "{e1:?} {e2:?}");
            let keys: Vec<(u64, u32)> = tenants_in(&*board, 100, 10)
                .iter()
                .map(|t| (t.key, t.limit_pct))
                .collect();
            assert_eq!(keys, [(7, 30), (9, 70)]);
        });
    }

    /// Two containers race for the last (stale) entry: exactly one takes it, the other is
    /// told the board is full; the entry holds the winner's limit, never a mix.
    #[test]
    fn loom_a_stale_entry_goes_to_exactly_one_newcomer() {
        model(|| {
            let board = Arc::new(HeapBoard::new(1));
            // A tenant that stopped announcing at time 10.
            assert_eq!(announce_in(&*board, None, 3, 50, 0, 10, 50), Some(0));
            let go = |key: u64, pct: u32, b: Arc<HeapBoard>| {
                move || announce_in(&*b, None, key, pct, 0, 1000, 50)
            };
            let t1 = thread::spawn(go(7, 30, board.clone()));
            let t2 = thread::spawn(go(9, 70, board.clone()));
            let (e1, e2) = (t1.join().unwrap(), t2.join().unwrap());
            assert!(e1.is_some() != e2.is_some(), "{e1:?} {e2:?}");
            let want = if e1.is_some() { (7, 30) } else { (9, 70) };
            let got: Vec<(u64, u32)> = tenants_in(&*board, 1000, 10)
                .iter()
                .map(|t| (t.key, t.limit_pct))
                .collect();
            assert_eq!(got, [want]);
        });
    }
}
