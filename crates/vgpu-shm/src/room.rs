//! The room board (docs/swap.md, "For a more urgent container"): one small file per physical
//! GPU in the turn directory, where containers that swap meet over device memory. A container
//! that swaps and is not among the most urgent *offers* (its priority and the device bytes it
//! could give, refreshed every second); a container whose allocation found no room on the GPU
//! *wants* (its priority and the bytes, refreshed while it waits).
//!
//! The file is a turn board's format under another name (`vgpu-room-<uuid>`), so it has the
//! turn board's hardening (no link followed, regular files only, written under `flock`, 64
//! fixed entries; `turns.rs`); its entries are `[key, ROOM_TAG + kind × 100 + priority,
//! stamp, bytes]`. A turn reader never counts them (their limit word is far above 99); a room
//! reader takes only what it can decode, and only stamps within [`ROOM_MAX_AGE_NS`] of its
//! own clock on either side, so a record stamped in the future does not stay fresh forever.
//! What a forged record can do is in docs/swap.md: make idle, less urgent containers swap
//! out (they come back on their next call), or make an urgent container's failing
//! allocation wait up to its bound.

use std::path::Path;

use crate::turns::{TurnBoard, TurnBoardError, board_file_name};

/// The limit word's base for room records (a turn entry's is 0..=99).
const ROOM_TAG: u64 = 1000;
/// How far a record's stamp may lie from the reader's clock and still count: offers are
/// refreshed every second, wants every half second.
pub const ROOM_MAX_AGE_NS: u64 = 3_000_000_000;

/// What a record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomKind {
    /// "Swap me out for a more urgent container": `bytes` could go.
    Offer,
    /// "My allocation of `bytes` found no room".
    Want,
}

/// One container's record on a GPU's room board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomRecord {
    /// The container's key ([`crate::container_key`]).
    pub key: u64,
    /// What it says.
    pub kind: RoomKind,
    /// Its `CUDA_TASK_PRIORITY` (0 the most urgent), 0..=99.
    pub priority: u32,
    /// Bytes offered or wanted.
    pub bytes: u64,
    /// When it was written (`CLOCK_MONOTONIC` nanoseconds).
    pub stamp_ns: u64,
}

impl RoomRecord {
    fn limit_word(&self) -> u32 {
        let kind = match self.kind {
            RoomKind::Offer => 1,
            RoomKind::Want => 2,
        };
        (ROOM_TAG + kind * 100 + u64::from(self.priority.min(99))) as u32
    }

    fn decode([key, word, stamp, bytes]: [u64; 4]) -> Option<Self> {
        let code = word.checked_sub(ROOM_TAG)?;
        let kind = match code / 100 {
            1 => RoomKind::Offer,
            2 => RoomKind::Want,
            _ => return None,
        };
        Some(Self {
            key,
            kind,
            priority: (code % 100) as u32,
            bytes,
            stamp_ns: stamp,
        })
    }
}

/// The room board's file name for the GPU with this UUID, inside the turn directory.
pub fn room_file_name(gpu_uuid: &str) -> String {
    board_file_name(gpu_uuid).replacen("vgpu-turns-", "vgpu-room-", 1)
}

/// A GPU's room board: its path (every operation opens the file, as a turn board's do).
#[derive(Debug)]
pub struct RoomBoard {
    board: TurnBoard,
}

impl RoomBoard {
    /// Opens the board at `path`, creating it if needed (a foreign file is refused and left
    /// alone, as a turn board's is).
    pub fn open_or_create(path: impl AsRef<Path>) -> Result<Self, TurnBoardError> {
        TurnBoard::open_or_create(path).map(|board| Self { board })
    }

    /// Writes `record` as its container's one entry (an entry older than
    /// [`ROOM_MAX_AGE_NS`] may be taken over).
    pub fn post(&mut self, record: RoomRecord) -> Result<(), TurnBoardError> {
        self.board
            .announce(
                record.key,
                record.limit_word(),
                record.bytes,
                record.stamp_ns,
                ROOM_MAX_AGE_NS,
                0,
            )
            .map(drop)
    }

    /// Removes `key`'s record.
    pub fn withdraw(&mut self, key: u64) -> Result<(), TurnBoardError> {
        self.board.withdraw(key)
    }

    /// The records that count at `now`: decodable, stamped within [`ROOM_MAX_AGE_NS`] of
    /// `now` on either side, one per key (the first entry holding it).
    pub fn records(&self, now: u64) -> Vec<RoomRecord> {
        let mut out: Vec<RoomRecord> = Vec::new();
        for r in self
            .board
            .raw_entries()
            .into_iter()
            .filter_map(RoomRecord::decode)
        {
            if now.abs_diff(r.stamp_ns) <= ROOM_MAX_AGE_NS && !out.iter().any(|o| o.key == r.key) {
                out.push(r);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn path(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("vgpu-room-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    fn rec(key: u64, kind: RoomKind, priority: u32, bytes: u64, stamp_ns: u64) -> RoomRecord {
        RoomRecord {
            key,
            kind,
            priority,
            bytes,
            stamp_ns,
        }
    }

    #[test]
    fn offers_and_wants_are_read_back_and_age_out() {
        let p = path("basic");
        let mut a = RoomBoard::open_or_create(&p).unwrap();
        let mut b = RoomBoard::open_or_create(&p).unwrap();
        a.post(rec(7, RoomKind::Offer, 1, 24 << 30, 100 * S))
            .unwrap();
        b.post(rec(3, RoomKind::Want, 0, 8 << 30, 101 * S)).unwrap();
        let seen = a.records(101 * S);
        assert_eq!(seen.len(), 2);
        assert!(seen.contains(&rec(7, RoomKind::Offer, 1, 24 << 30, 100 * S)));
        assert!(seen.contains(&rec(3, RoomKind::Want, 0, 8 << 30, 101 * S)));
        // The offer is refreshed in place (one entry per container), the want ages out.
        a.post(rec(7, RoomKind::Offer, 1, 20 << 30, 104 * S))
            .unwrap();
        assert_eq!(
            a.records(104 * S + 1),
            [rec(7, RoomKind::Offer, 1, 20 << 30, 104 * S)]
        );
        a.withdraw(7).unwrap();
        assert!(a.records(104 * S + 1).is_empty());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn records_stamped_in_the_future_or_undecodable_do_not_count() {
        let p = path("hostile");
        let mut a = RoomBoard::open_or_create(&p).unwrap();
        // An hour ahead of the reader's clock: fresh forever if only age were checked.
        a.post(rec(9, RoomKind::Want, 0, 1 << 40, 3600 * S))
            .unwrap();
        // A turn tenant's entry in the same file (limit word 30): not a room record.
        let mut t = TurnBoard::open_or_create(&p).unwrap();
        t.announce(5, 30, 0, 10 * S, S, S).unwrap();
        assert!(a.records(10 * S).is_empty());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_turn_reader_never_counts_room_records() {
        let p = path("turns");
        let mut a = RoomBoard::open_or_create(&p).unwrap();
        a.post(rec(7, RoomKind::Offer, 1, 1 << 30, 10 * S)).unwrap();
        let t = TurnBoard::open_or_create(&p).unwrap();
        assert!(t.tenants(10 * S, S).is_empty());
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn the_file_name_is_the_gpus_with_its_own_prefix() {
        assert_eq!(room_file_name("GPU-ab/c"), "vgpu-room-GPU-ab_c");
    }
}
