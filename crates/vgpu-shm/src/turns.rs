//! The turn board: one small file per physical GPU in a directory every container of the
//! node mounts (HAMi's device plugin mounts the host's `/tmp/vgpulock` into each container),
//! where each container with an SM limit announces itself and keeps a record of its claim
//! (`shares.rs`), so that containers limited on the same GPU see each other's claims (see
//! docs/sm-limit.md). "Turn" is the file format's name; nothing takes turns on it.
//!
//! Layout (little-endian u64 words):
//! `[0]` magic `VGPUTURN`, `[1]` version, then [`TURN_ENTRIES`] entries of four words:
//! tenant key, SM limit in percent, heartbeat (CLOCK_MONOTONIC nanoseconds), and a launch
//! length in nanoseconds (read by earlier versions' turn cycles; the current limiter writes
//! 0). An entry whose heartbeat is older than the reader's `max_age` is not a tenant; a
//! writer may take it over. The limit word says what the entry asks for: 1..=99, a busy
//! tenant's part; 0, an *idle* tenant (a share-mode container alive but without work, which
//! refreshes its entry off its launch path so that `vgpu status` and its neighbours still
//! see it): it keeps its entry and its share record counts, but readers that list busy
//! tenants leave it out (every reader since version 1 skips limits outside 1..=99 there).
//! Anything else is not a tenant. Writers work under the file's `flock` (released by the
//! kernel if the holder dies) with ordinary reads and writes, never a shared mapping: the
//! directory is writable by every container of the node, and a mapped file that another
//! container truncates would fault (SIGBUS) every process that maps it. Every open goes
//! through `file` (no symbolic link followed, no FIFO waited on, only regular files), and
//! the header is written only into an empty file with one name, or a board cut short: never
//! into a file that holds anything else.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::file::{self, OpenError};
use crate::sys;

/// Entries in a board: tenants (containers) announced on one GPU at a time.
pub const TURN_ENTRIES: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"VGPUTURN");
const VERSION: u64 = 1;
const HEADER_WORDS: usize = 2;
const ENTRY_WORDS: usize = 4;

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
    /// The file is not one vgpu reads or writes (a symbolic link, not a regular file, an
    /// empty file with other names).
    #[error("turn board {path} {reason}")]
    Refused {
        /// The file.
        path: PathBuf,
        /// Why, in words.
        reason: String,
    },
    /// Every entry is held by a live tenant.
    #[error("turn board is full ({TURN_ENTRIES} live tenants)")]
    Full,
    /// Another process held the board's lock too long; try again next period.
    #[error("turn board is busy")]
    Busy,
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
    /// Its SM limit, percent: 1..=99 takes turns, 0 is an idle tenant
    /// ([`Tenant::takes_turns`]).
    pub limit_pct: u32,
    /// GPU time of its typical launch, nanoseconds (0: unknown).
    pub launch_ns: u64,
    /// When it last announced itself (`CLOCK_MONOTONIC` nanoseconds).
    pub heartbeat_ns: u64,
}

impl Tenant {
    /// Whether a window is laid out for it: an entry with limit 0 is idle (alive, no work).
    pub fn takes_turns(&self) -> bool {
        (1..100).contains(&self.limit_pct)
    }
}

/// A turn board: its path. Every operation opens the file, works under `flock` and closes
/// it again (a few system calls once per publish period): no mapping, so a board truncated
/// or replaced by another container cannot fault this process (a mapped page past the end
/// of a truncated file raises SIGBUS), and no descriptor is shared with a forked child.
#[derive(Debug)]
pub struct TurnBoard {
    path: PathBuf,
    /// The entry this process last wrote (a hint; verified by key on every write).
    mine: Option<usize>,
}

/// The board's words as read from the file (missing bytes read as zero).
type Image = [u64; IMAGE_WORDS];
const IMAGE_WORDS: usize = HEADER_WORDS + TURN_ENTRIES * ENTRY_WORDS;
/// Words of the turn entries; the share-mode records follow (`shares.rs`).
pub(crate) const TURN_IMAGE_WORDS: usize = IMAGE_WORDS;

/// How long an operation waits for the board's lock before giving up for this period (a
/// holder keeps it for a few microseconds; the limiter asks from a launch, once per 100 ms).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

impl TurnBoard {
    /// Opens the board at `path`, creating it (mode 0666 whatever the umask) and writing its
    /// header if needed; a foreign or other-version file is refused and left alone.
    pub fn open_or_create(path: impl AsRef<Path>) -> Result<Self, TurnBoardError> {
        let board = Self {
            path: path.as_ref().to_path_buf(),
            mine: None,
        };
        let header = board.locked(true, |file, _, fresh| {
            if fresh {
                write_words(file, 0, &[MAGIC, VERSION])?;
            }
            Ok(())
        });
        match header {
            // Someone else holds the lock now: the file exists, and the first announcement
            // writes the header if it is still missing.
            Ok(()) | Err(TurnBoardError::Busy) => Ok(board),
            Err(e) => Err(e),
        }
    }

    /// Opens an existing board read-only (inspection: `vgpu status`); never creates or
    /// writes. A missing, foreign or other-version file is an error.
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self, TurnBoardError> {
        let path = path.as_ref();
        read_board(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            mine: None,
        })
    }

    /// Runs `f` on the open file and its current image under the board's `flock` (waiting
    /// at most [`LOCK_WAIT`]); `create` creates the file if it is missing.
    fn locked<R>(
        &self,
        create: bool,
        f: impl FnOnce(&File, &Image, bool) -> io::Result<R>,
    ) -> Result<R, TurnBoardError> {
        let path = &self.path;
        let opened = file::open_writable(path, create).map_err(|e| open_error(path, e))?;
        let file = opened.file;
        // Released on every way out (`sys::Flock`), not only by closing `file`.
        let _lock =
            sys::flock_exclusive_within(&file, LOCK_WAIT, std::time::Duration::from_micros(100))
                .map_err(io_err(path, "flock"))?
                .ok_or(TurnBoardError::Busy)?;
        let len = file.metadata().map_err(io_err(path, "fstat"))?.len();
        let image = read_image(&file).map_err(io_err(path, "read"))?;
        let fresh = needs_header(&image, len);
        if len == 0 && !opened.created && opened.meta.nlink() != 1 {
            return Err(TurnBoardError::Refused {
                path: path.clone(),
                reason: format!(
                    "is an empty file with {} names that vgpu did not create (left as it is)",
                    opened.meta.nlink()
                ),
            });
        }
        if !fresh {
            check_header(path, &image)?;
        }
        f(&file, &image, fresh).map_err(io_err(path, "write"))
    }

    /// Announces tenant `key` (non-zero) with `limit_pct` and its typical launch length
    /// at time `now` (`limit_pct` 0: idle, see the module's doc); an entry whose heartbeat
    /// is older than `stale` (or never written) may be taken over. Returns every tenant that
    /// takes turns and whose heartbeat is at most `max_age` old, as [`TurnBoard::tenants`]
    /// would, read under the same lock.
    #[allow(clippy::too_many_arguments)]
    pub fn announce(
        &mut self,
        key: u64,
        limit_pct: u32,
        launch_ns: u64,
        now: u64,
        stale: u64,
        max_age: u64,
    ) -> Result<Vec<Tenant>, TurnBoardError> {
        let key = key.max(1);
        let hint = self.mine;
        let (entry, tenants) = self.locked(true, |file, image, fresh| {
            let mut image = *image;
            if fresh {
                // New, or truncated by someone: rewrite the header.
                image[0] = MAGIC;
                image[1] = VERSION;
                write_words(file, 0, &[MAGIC, VERSION])?;
            }
            let Some(e) = entry_for(&image, hint, key, now, stale) else {
                return Ok((None, Vec::new()));
            };
            let words = [key, u64::from(limit_pct), now.max(1), launch_ns];
            let base = HEADER_WORDS + e * ENTRY_WORDS;
            image[base..base + ENTRY_WORDS].copy_from_slice(&words);
            write_words(file, base, &words)?;
            Ok((Some(e), turn_takers_in(&image, now, max_age)))
        })?;
        self.mine = Some(entry.ok_or(TurnBoardError::Full)?);
        Ok(tenants)
    }

    /// Tenants that take turns and whose heartbeat is at most `max_age` old at `now`, sorted
    /// by key, one per key (idle ones left out: nobody lays out a window for them). Read
    /// without the lock (entries are independent; a torn read of one is at most one period
    /// stale or skipped); empty when the file cannot be read.
    pub fn tenants(&self, now: u64, max_age: u64) -> Vec<Tenant> {
        read_board(&self.path).map_or_else(|_| Vec::new(), |i| turn_takers_in(&i, now, max_age))
    }

    /// Every written entry's four words (key, the limit word, heartbeat, the fourth word),
    /// read without the lock; empty when the file cannot be read. For a board of this file
    /// format whose entries mean something else (`room.rs`), which decodes them itself.
    pub(crate) fn raw_entries(&self) -> Vec<[u64; ENTRY_WORDS]> {
        read_board(&self.path).map_or_else(
            |_| Vec::new(),
            |image| {
                entries_of(&image)
                    .filter(|w| w[0] != 0 && w[2] != 0)
                    .collect()
            },
        )
    }

    /// The entry this process announced itself in last (its share record's index).
    pub fn entry(&self) -> Option<usize> {
        self.mine
    }

    /// The board's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key of every entry (0 = free: never written, or withdrawn), read without the lock
    /// (opened as every read of a board is: no link followed, no FIFO waited on); empty when
    /// the file cannot be read. Share records count only under their entry's key, so a
    /// withdrawn container's record, kept for `vgpu status` (`crate::NodeReader`), no longer
    /// counts for its neighbours.
    pub fn entry_keys(&self) -> Vec<u64> {
        read_board(&self.path).map_or_else(
            |_| Vec::new(),
            |image| {
                // `withdraw` zeroes the heartbeat (word 2).
                entries_of(&image)
                    .map(|w| if w[2] == 0 { 0 } else { w[0] })
                    .collect()
            },
        )
    }

    /// The board's file for reading and writing this container's share record (opened as
    /// every write of a board is; the caller keeps it for its hot path and opens it again
    /// with each announcement, so a replaced file is followed within a period).
    pub fn open_records(&self) -> Result<File, TurnBoardError> {
        file::open_writable(&self.path, false)
            .map(|o| o.file)
            .map_err(|e| open_error(&self.path, e))
    }

    /// Withdraws `key` (a container's last limited process exits), so others need not wait
    /// for its heartbeat to age out.
    pub fn withdraw(&mut self, key: u64) -> Result<(), TurnBoardError> {
        let key = key.max(1);
        self.locked(false, |file, image, _| {
            for e in 0..TURN_ENTRIES {
                let base = HEADER_WORDS + e * ENTRY_WORDS;
                if image[base] == key {
                    write_words(file, base + 2, &[0])?;
                }
            }
            Ok(())
        })
    }
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> TurnBoardError {
    let path = path.to_path_buf();
    move |source| TurnBoardError::Io { path, op, source }
}

/// The tenants of the board at `path` whose heartbeat is at most `max_age` old at `now`, idle
/// ones included (inspection: `vgpu status` lists every live container), read without the
/// lock (see [`TurnBoard::tenants`]); a missing, refused or foreign file is an error. Never blocks on a FIFO nor follows a link; node-side callers bound its time with
/// [`crate::NodeReader`].
pub(crate) fn read_tenants(
    path: &Path,
    now: u64,
    max_age: u64,
) -> Result<Vec<Tenant>, TurnBoardError> {
    Ok(tenants_in(&read_board(path)?, now, max_age))
}

/// The key of every entry of an image.
pub(crate) fn entry_keys_of(image: &Image) -> Vec<u64> {
    (0..TURN_ENTRIES)
        .map(|e| image[HEADER_WORDS + e * ENTRY_WORDS])
        .collect()
}

/// The board's image, read-only; a missing, refused or foreign file is an error.
pub(crate) fn read_board(path: &Path) -> Result<Image, TurnBoardError> {
    let file = file::open_read_only(path)
        .map_err(|e| open_error(path, e))?
        .file;
    let image = read_image(&file).map_err(io_err(path, "read"))?;
    check_header(path, &image)?;
    Ok(image)
}

pub(crate) fn open_error(path: &Path, e: OpenError) -> TurnBoardError {
    let path = path.to_path_buf();
    match e {
        OpenError::Io(op, source) => TurnBoardError::Io { path, op, source },
        OpenError::Refused(reason) => TurnBoardError::Refused { path, reason },
    }
}

/// Whether the header is to be (re)written under the lock: the file is empty (new), or it is a
/// board cut short (what is left is a prefix of the header, or the magic without a version).
/// Anything else is not written into.
fn needs_header(image: &Image, len: u64) -> bool {
    let header: Vec<u8> = [MAGIC, VERSION]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    let kept: Vec<u8> = image[..HEADER_WORDS]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    match usize::try_from(len) {
        Ok(n) if n < header.len() => kept[..n] == header[..n],
        _ => image[0] == MAGIC && image[1] == 0,
    }
}

fn check_header(path: &Path, image: &Image) -> Result<(), TurnBoardError> {
    if image[0] == MAGIC && image[1] == VERSION {
        return Ok(());
    }
    Err(TurnBoardError::Foreign {
        path: path.to_path_buf(),
        magic: image[0],
        version: image[1],
    })
}

/// The file's words; bytes past its end (a short or truncated file) read as zero.
fn read_image(file: &File) -> io::Result<Image> {
    let mut bytes = vec![0u8; IMAGE_WORDS * 8];
    let mut done = 0;
    while done < bytes.len() {
        match file.read_at(&mut bytes[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut image = [0u64; IMAGE_WORDS];
    for (w, chunk) in image.iter_mut().zip(bytes.chunks_exact(8)) {
        *w = u64::from_le_bytes(chunk.try_into().unwrap_or([0; 8]));
    }
    Ok(image)
}

fn write_words(file: &File, first: usize, words: &[u64]) -> io::Result<()> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    file.write_all_at(&bytes, (first * 8) as u64)
}

/// The entry `key` should write: its own (the hint first), else one nobody holds (never
/// written, withdrawn, or with a heartbeat older than `stale`). `None` when all are held.
fn entry_for(image: &Image, hint: Option<usize>, key: u64, now: u64, stale: u64) -> Option<usize> {
    let word = |e: usize, i: usize| image[HEADER_WORDS + e * ENTRY_WORDS + i];
    if let Some(e) = hint.filter(|&e| e < TURN_ENTRIES && word(e, 0) == key) {
        return Some(e);
    }
    (0..TURN_ENTRIES).find(|&e| word(e, 0) == key).or_else(|| {
        (0..TURN_ENTRIES).find(|&e| {
            let beat = word(e, 2);
            beat == 0 || now.saturating_sub(beat) > stale
        })
    })
}

/// The tenants of an image that take turns (the layout's).
fn turn_takers_in(image: &Image, now: u64, max_age: u64) -> Vec<Tenant> {
    let mut all = tenants_in(image, now, max_age);
    all.retain(Tenant::takes_turns);
    all
}

/// Every entry's four words, in entry order.
fn entries_of(image: &Image) -> impl Iterator<Item = [u64; ENTRY_WORDS]> + '_ {
    (0..TURN_ENTRIES).map(move |e| {
        let b = HEADER_WORDS + e * ENTRY_WORDS;
        [image[b], image[b + 1], image[b + 2], image[b + 3]]
    })
}

/// The live tenants of an image, idle ones included.
fn tenants_in(image: &Image, now: u64, max_age: u64) -> Vec<Tenant> {
    let mut out: Vec<Tenant> = Vec::new();
    for [k, p, b, launch] in entries_of(image) {
        if k == 0 || b == 0 || now.saturating_sub(b) > max_age || p >= 100 {
            continue;
        }
        if !out.iter().any(|t| t.key == k) {
            out.push(Tenant {
                key: k,
                limit_pct: p as u32,
                launch_ns: launch,
                heartbeat_ns: b,
            });
        }
    }
    out.sort_by_key(|t| t.key);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const STALE: u64 = 500 * MS;
    const AGE: u64 = 300 * MS;

    fn path(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("vgpu-turns-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    fn kp(v: &[Tenant]) -> Vec<(u64, u32)> {
        v.iter().map(|t| (t.key, t.limit_pct)).collect()
    }

    #[test]
    fn tenants_announce_age_out_and_share_one_entry_per_key() {
        let p = path("basic");
        let mut a = TurnBoard::open_or_create(&p).unwrap();
        let mut a2 = TurnBoard::open_or_create(&p).unwrap(); // same container, other process
        let mut b = TurnBoard::open_or_create(&p).unwrap();
        a.announce(7, 30, 0, 1000 * MS, STALE, AGE).unwrap();
        a2.announce(7, 30, 0, 1001 * MS, STALE, AGE).unwrap();
        let seen = b.announce(3, 70, 0, 1002 * MS, STALE, AGE).unwrap();
        assert_eq!(kp(&seen), [(3, 70), (7, 30)]);
        assert_eq!(kp(&a.tenants(1003 * MS, AGE)), [(3, 70), (7, 30)]);
        assert_eq!(a.mine, a2.mine, "one entry per key");
        // b stops announcing: it ages out; its entry is then reusable.
        a.announce(7, 30, 0, 1400 * MS, STALE, AGE).unwrap();
        assert_eq!(kp(&a.tenants(1400 * MS, AGE)), [(7, 30)]);
        a.withdraw(7).unwrap();
        assert!(a.tenants(1400 * MS, AGE).is_empty());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_withdrawn_entry_is_free_to_share_readers() {
        // Share records count under `entry_keys`: a container that withdrew (its process
        // exited) has no key there, while its neighbour keeps its own.
        let p = path("withdrawn-keys");
        let mut a = TurnBoard::open_or_create(&p).unwrap();
        let mut b = TurnBoard::open_or_create(&p).unwrap();
        a.announce(7, 30, 0, 1000 * MS, STALE, AGE).unwrap();
        b.announce(3, 70, 0, 1001 * MS, STALE, AGE).unwrap();
        let live = |keys: Vec<u64>| keys.into_iter().filter(|&k| k != 0).collect::<Vec<_>>();
        assert_eq!(live(b.entry_keys()), [7, 3]);
        a.withdraw(7).unwrap();
        assert_eq!(live(b.entry_keys()), [3]);
        // Announced again (another process of the container), it counts again.
        a.announce(7, 30, 0, 1100 * MS, STALE, AGE).unwrap();
        assert_eq!(live(b.entry_keys()), [7, 3]);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn an_idle_entry_keeps_its_place_but_takes_no_turn() {
        // A share-mode container without work announces limit 0: the layout's readers (cap
        // mode, `tenants`, `announce`) skip it, its entry is not taken over while fresh and
        // its key still holds its share record, and inspection lists it. Once its heartbeat
        // ages (a killed process) it is gone for inspection too.
        let p = path("idle");
        let mut idle = TurnBoard::open_or_create(&p).unwrap();
        let mut capped = TurnBoard::open_or_create(&p).unwrap();
        idle.announce(7, 0, 50_000, 1000 * MS, STALE, AGE).unwrap();
        let seen = capped.announce(3, 40, 0, 1001 * MS, STALE, AGE).unwrap();
        assert_eq!(kp(&seen), [(3, 40)], "no window for the idle tenant");
        assert_eq!(kp(&capped.tenants(1002 * MS, AGE)), [(3, 40)]);
        assert!(capped.entry_keys().contains(&7), "its record still counts");
        let listed = read_tenants(&p, 1002 * MS, AGE).unwrap();
        assert_eq!(kp(&listed), [(3, 40), (7, 0)]);
        assert!(!listed[1].takes_turns() && listed[0].takes_turns());
        // Fresh, it keeps its entry against a newcomer on a full board.
        let mut others: Vec<TurnBoard> = (0..TURN_ENTRIES - 2)
            .map(|_| TurnBoard::open_or_create(&p).unwrap())
            .collect();
        for (i, b) in others.iter_mut().enumerate() {
            b.announce(100 + i as u64, 10, 0, 1003 * MS, STALE, AGE)
                .unwrap();
        }
        let mut late = TurnBoard::open_or_create(&p).unwrap();
        assert!(matches!(
            late.announce(1, 10, 0, 1004 * MS, STALE, AGE),
            Err(TurnBoardError::Full)
        ));
        // It stops refreshing: aged out for every reader.
        assert!(
            read_tenants(&p, 1000 * MS + AGE + 1, AGE)
                .unwrap()
                .iter()
                .all(|t| t.key != 7)
        );
        // A limit of 100 or more is no tenant at all.
        idle.announce(7, 100, 0, 1005 * MS, STALE, AGE).unwrap();
        assert!(
            read_tenants(&p, 1005 * MS, AGE)
                .unwrap()
                .iter()
                .all(|t| t.key != 7)
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_full_board_refuses_and_stale_entries_are_taken_over() {
        let p = path("full");
        let mut boards: Vec<TurnBoard> = (0..TURN_ENTRIES)
            .map(|_| TurnBoard::open_or_create(&p).unwrap())
            .collect();
        for (i, b) in boards.iter_mut().enumerate() {
            b.announce(100 + i as u64, 10, 0, 10 * MS, STALE, AGE)
                .unwrap();
        }
        let mut late = TurnBoard::open_or_create(&p).unwrap();
        assert!(matches!(
            late.announce(1, 10, 0, 20 * MS, STALE, AGE),
            Err(TurnBoardError::Full)
        ));
        // Half a second later every entry is stale: the newcomer takes one over.
        let seen = late.announce(1, 10, 0, 600 * MS, STALE, AGE).unwrap();
        assert_eq!(
            (seen.len(), seen[0].key, seen[0].heartbeat_ns),
            (1, 1, 600 * MS)
        );
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
        w.announce(5, 40, 123_000, 10 * MS, STALE, AGE).unwrap();
        let r = TurnBoard::open_read_only(&p).unwrap();
        let t = r.tenants(11 * MS, AGE);
        assert_eq!(
            (t[0].key, t[0].limit_pct, t[0].launch_ns, t[0].heartbeat_ns),
            (5, 40, 123_000, 10 * MS)
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_truncated_board_is_survived_and_rebuilt() {
        // Another container truncates the shared file: nothing faults (no mapping), the
        // next announcement rewrites the header and its own entry.
        let p = path("trunc");
        let mut a = TurnBoard::open_or_create(&p).unwrap();
        let mut b = TurnBoard::open_or_create(&p).unwrap();
        a.announce(7, 30, 0, 10 * MS, STALE, AGE).unwrap();
        b.announce(9, 70, 0, 10 * MS, STALE, AGE).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(8)
            .unwrap();
        assert!(a.tenants(11 * MS, AGE).is_empty());
        a.announce(7, 30, 0, 20 * MS, STALE, AGE).unwrap();
        let seen = b.announce(9, 70, 0, 21 * MS, STALE, AGE).unwrap();
        assert_eq!(kp(&seen), [(7, 30), (9, 70)]);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_held_lock_makes_the_board_busy_not_blocked() {
        let p = path("busy");
        let mut a = TurnBoard::open_or_create(&p).unwrap();
        let holder = File::open(&p).unwrap();
        assert!(sys::try_flock_exclusive(&holder).unwrap());
        let t0 = std::time::Instant::now();
        assert!(matches!(
            a.announce(7, 30, 0, 10 * MS, STALE, AGE),
            Err(TurnBoardError::Busy)
        ));
        assert!(t0.elapsed() < std::time::Duration::from_millis(500));
        sys::unflock(&holder);
        a.announce(7, 30, 0, 10 * MS, STALE, AGE).unwrap();
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    #[allow(unsafe_code)] // fork, kill and waitpid: the test's own child process
    fn a_child_forked_under_the_lock_does_not_keep_the_board_busy() {
        // A fork while another thread of the process works under the board's lock (the
        // share-mode heartbeat thread does, beside the program's own threads) copies the
        // descriptor, and a `flock` belongs to the open file description: closing the
        // parent's copy alone would leave the child holding the lock until it exits.
        let p = path("forked");
        let board = TurnBoard::open_or_create(&p).unwrap();
        let mut child = 0;
        board
            .locked(false, |_, _, _| {
                // SAFETY: the child only sleeps and exits, both async-signal-safe.
                child = unsafe { libc::fork() };
                if child == 0 {
                    // SAFETY: as above.
                    unsafe {
                        libc::sleep(30);
                        libc::_exit(0);
                    }
                }
                Ok(())
            })
            .unwrap();
        assert!(child > 0);
        let other = File::open(&p).unwrap();
        let free = sys::try_flock_exclusive(&other).unwrap();
        // SAFETY: our own child; reaped below.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        assert!(free, "the board stays locked while the forked child lives");
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_foreign_file_is_refused_and_left_alone() {
        let p = path("foreign");
        std::fs::write(&p, b"not a turn board, just some bytes").unwrap();
        let err = TurnBoard::open_or_create(&p).unwrap_err();
        assert!(matches!(err, TurnBoardError::Foreign { .. }), "{err}");
        assert_eq!(
            std::fs::read(&p).unwrap(),
            b"not a turn board, just some bytes"
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn nothing_is_written_through_a_link_or_into_a_file_that_is_not_a_board() {
        // A link in the shared directory to a file of the writer's own filesystem.
        let target = path("link-target");
        std::fs::write(&target, b"").unwrap();
        let p = path("link");
        std::os::unix::fs::symlink(&target, &p).unwrap();
        for err in [
            TurnBoard::open_or_create(&p).unwrap_err(),
            TurnBoard::open_read_only(&p).unwrap_err(),
        ] {
            assert!(matches!(err, TurnBoardError::Refused { .. }), "{err}");
        }
        assert_eq!(std::fs::metadata(&target).unwrap().len(), 0);
        // Zeros where the header goes, data after them: not a board.
        let zeros = path("zeros");
        let data: Vec<u8> = (0..64).map(|i| if i < 16 { 0 } else { i }).collect();
        std::fs::write(&zeros, &data).unwrap();
        let err = TurnBoard::open_or_create(&zeros).unwrap_err();
        assert!(matches!(err, TurnBoardError::Foreign { .. }), "{err}");
        assert_eq!(std::fs::read(&zeros).unwrap(), data);
        // An empty file with a second name (a hard link to somebody's file).
        let other = path("other");
        std::fs::write(&other, b"").unwrap();
        let two = path("two");
        std::fs::hard_link(&other, &two).unwrap();
        let err = TurnBoard::open_or_create(&two).unwrap_err();
        assert!(matches!(err, TurnBoardError::Refused { .. }), "{err}");
        assert_eq!(std::fs::metadata(&other).unwrap().len(), 0);
        for f in [target, p, zeros, other, two] {
            let _ = std::fs::remove_file(f);
        }
    }
}
