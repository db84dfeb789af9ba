//! The node's board as the limiter sees it (`vgpu_limiter::NodeBoard`): every container
//! limited on a GPU keeps a record there (protocol in `vgpu-shm/src/turns.rs` and
//! `shares.rs`, arithmetic in `vgpu-limiter/src/share.rs`).
//!
//! Once per publish period the container announces itself on the board (under its lock),
//! reopens its handle on the board's file and rewrites its record; on the launch path, once
//! per board poll (`vgpu_limiter`'s `board_poll`: 5 ms among one priority), it reads all records with one `pread` through that handle and,
//! when its demand runs out soon, rewrites that one word. Everything read is hostile input:
//! the shm decoder refuses malformed records and the limiter's arithmetic never lets a record
//! lower this container's guarantee, nor hold a launch longer than its longest hold.

use std::fs::File;

use vgpu_cuda_abi::{CUdevice, c_int};
use vgpu_limiter::{BoardRecord, BoardReport, Nanos, NodeBoard, ShareClaim};
use vgpu_shm::TurnBoard;
use vgpu_shm::shares::{self, ShareRecord};

use super::SmLimiter;
use crate::log::{DEBUG, INFO, WARN, vlog};

/// Announcements older than this are not tenants (three publish periods).
pub(super) const TURN_MAX_AGE: Nanos = 300_000_000;
/// An entry this stale may be taken over.
pub(super) const TURN_STALE: Nanos = 1_000_000_000;
/// `CUDA_TASK_PRIORITY`'s default (HAMi's): what a container of an older library, which
/// announces itself without a record, counts as.
const DEFAULT_PRIORITY: i32 = 1;

/// This container's place on the GPU's turn board.
enum Place {
    Unopened,
    Unavailable,
    Open { board: TurnBoard, key: u64 },
}

impl Place {
    #[cold]
    fn open(device: usize, sm: &SmLimiter) -> Self {
        // `VGPU_TURN_DIR` (vgpu-env), default /tmp/vgpulock; None = off.
        let Some(dir) = sm.turn_dir() else {
            return Self::Unavailable;
        };
        // Containers are told apart by their shared file (one per container); without one
        // this process is its own container.
        let key = match sm
            .slot()
            .and_then(|s| vgpu_shm::container_key(s.table().path()).ok())
        {
            Some(k) => k,
            None => u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        };
        let uuid = crate::real::cuda()
            .ok()
            .and_then(|cuda| crate::driver::device_uuid(cuda, CUdevice(device as c_int)).ok());
        let Some(uuid) = uuid else {
            return Self::Unavailable;
        };
        let path = std::path::Path::new(dir).join(vgpu_shm::board_file_name(&uuid));
        if !std::path::Path::new(dir).is_dir() {
            vlog!(
                INFO,
                "device {device}: no {dir} directory: this container does not see its neighbours' claims on this GPU"
            );
            return Self::Unavailable;
        }
        match TurnBoard::open_or_create(&path) {
            Ok(board) => Self::Open { board, key },
            Err(e) => {
                vlog!(
                    WARN,
                    "device {device}: {e}: this container does not see its neighbours' claims on this GPU"
                );
                Self::Unavailable
            }
        }
    }
}

/// The board of one device, as the limiter's [`NodeBoard`].
pub(crate) struct BoardView {
    device: usize,
    sm: &'static SmLimiter,
    place: Place,
    records: Records,
}

impl BoardView {
    pub(super) fn new(device: usize, sm: &'static SmLimiter) -> Self {
        Self {
            device,
            sm,
            place: Place::Unopened,
            records: Records::default(),
        }
    }
}

impl NodeBoard for BoardView {
    fn publish(&mut self, now: Nanos, report: &BoardReport) -> Option<(u64, Vec<BoardRecord>)> {
        if matches!(self.place, Place::Unopened) {
            self.place = Place::open(self.device, self.sm);
        }
        let Place::Open { board, key } = &mut self.place else {
            return None;
        };
        let records = self.records.announce(self.device, board, *key, report, now);
        // On a board now: keep it there while idle (a relaxed load once it runs).
        self.sm.want_heartbeat();
        vlog!(
            DEBUG,
            "device {}: part {}%, {} containers on the board",
            self.device,
            report.allot_pct,
            records.len()
        );
        Some((*key, records))
    }

    fn demand(&mut self, _now: Nanos, busy_until: Option<Nanos>) -> Option<Vec<BoardRecord>> {
        matches!(self.place, Place::Open { .. })
            .then(|| self.records.demand(self.device, busy_until))
    }

    /// At exit: withdraws this container's turn entry, so that others stop counting it at
    /// once (its record, kept for `vgpu status`, no longer counts, nor its rank). Another
    /// process of the same container announces itself again within a publish period.
    fn leave(&mut self) {
        if !self.records.has_record() {
            return;
        }
        if let Place::Open { board, key } = &mut self.place
            && let Err(e) = board.withdraw(*key)
        {
            vlog!(DEBUG, "device {}: turn entry at exit: {e}", self.device);
        }
    }
}

/// This container's handle on the board's records and what it last read.
#[derive(Default)]
struct Records {
    /// The board's file (reopened with every announcement).
    file: Option<File>,
    /// Our record's index (our turn entry).
    entry: Option<usize>,
    /// The key of every turn entry at the last announcement (records count under them).
    keys: Vec<u64>,
    /// Containers of an older library on the board (a turn entry without a record): each
    /// counts as busy with its limit as share and ceiling while it announces itself.
    recordless: Vec<BoardRecord>,
}

impl Records {
    /// Announces `key` on `board` with `report` and returns every record there.
    fn announce(
        &mut self,
        device: usize,
        board: &mut TurnBoard,
        key: u64,
        report: &BoardReport,
        now: Nanos,
    ) -> Vec<BoardRecord> {
        // The entry's limit word: our part now (1..=99, the range an entry carries), or 0
        // while our demand ran out (an idle tenant: vgpu-shm's `turns`).
        let pct = if report.busy_until <= now {
            0
        } else {
            report.allot_pct.clamp(1, 99)
        };
        match board.announce(key, pct, report.launch_ns, now, TURN_STALE, TURN_MAX_AGE) {
            Ok(tenants) => {
                self.entry = board.entry();
                self.keys = board.entry_keys();
                self.recordless = tenants
                    .iter()
                    .filter(|t| t.key != key)
                    .map(|t| BoardRecord {
                        key: t.key,
                        claim: ShareClaim {
                            share_pct: t.limit_pct,
                            ceiling_pct: t.limit_pct,
                            priority: DEFAULT_PRIORITY,
                        },
                        busy_until: t.heartbeat_ns.saturating_add(TURN_MAX_AGE),
                        heartbeat: t.heartbeat_ns,
                        util_pct: t.limit_pct,
                    })
                    .collect();
                match board.open_records() {
                    Ok(f) => self.file = Some(f),
                    Err(e) => vlog!(DEBUG, "device {device}: board records: {e}"),
                }
            }
            // Busy (another holder of the lock) or gone: keep the last handle and entry.
            Err(e) => vlog!(DEBUG, "device {device}: turn board: {e}"),
        }
        if let (Some(f), Some(e)) = (&self.file, self.entry) {
            let record = ShareRecord {
                key,
                share_pct: report.claim.share_pct.min(100) as u8,
                ceiling_pct: report.claim.ceiling_pct.clamp(1, 100) as u8,
                priority: report.claim.priority,
                launch_ns: report.launch_ns,
                busy_until: report.busy_until,
                heartbeat: now.max(1),
                util_pct: report.util_pct.min(100) as u8,
                allot_pct: report.allot_pct.min(100) as u8,
                lent_ns: report.lent_ns,
                borrowed_ns: report.borrowed_ns,
            };
            if let Err(err) = shares::write_record(f, e, &record) {
                vlog!(DEBUG, "device {device}: board record: {err}");
            }
        }
        self.read(device)
    }

    /// Whether this container has a record on the board.
    fn has_record(&self) -> bool {
        self.file.is_some() && self.entry.is_some()
    }

    /// The hot path: writes `busy_until` if given, returns every record.
    fn demand(&mut self, device: usize, busy_until: Option<Nanos>) -> Vec<BoardRecord> {
        if let (Some(f), Some(e), Some(b)) = (&self.file, self.entry, busy_until)
            && let Err(err) = shares::write_busy_until(f, e, b)
        {
            vlog!(DEBUG, "device {device}: board demand: {err}");
        }
        self.read(device)
    }

    fn read(&self, device: usize) -> Vec<BoardRecord> {
        let mut out = self.recordless.clone();
        let Some(f) = &self.file else {
            return out;
        };
        match shares::read_records(f, &self.keys) {
            Ok(records) => {
                // A container with a record is known by its record.
                out.retain(|c| !records.iter().any(|r| r.key == c.key));
                out.extend(records.iter().map(|r| BoardRecord {
                    key: r.key,
                    claim: ShareClaim {
                        share_pct: u32::from(r.share_pct),
                        ceiling_pct: u32::from(r.ceiling_pct),
                        priority: r.priority,
                    },
                    busy_until: r.busy_until,
                    heartbeat: r.heartbeat,
                    util_pct: u32::from(r.util_pct),
                }));
            }
            Err(e) => vlog!(DEBUG, "device {device}: board records: {e}"),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const NOW: u64 = 10_000 * MS;

    fn report(share_pct: u32, busy_until: Nanos) -> BoardReport {
        BoardReport {
            claim: ShareClaim {
                share_pct,
                ceiling_pct: 100,
                priority: 1,
            },
            busy_until,
            allot_pct: 60,
            launch_ns: 50_000,
            util_pct: 55,
            lent_ns: 0,
            borrowed_ns: 7,
        }
    }

    /// A fresh board in a directory of its own (`name`) with a container of an older
    /// library at 40% (key 0xc: a turn entry, no record) announced at [`NOW`], and a handle
    /// on it for a container of ours, not yet announced.
    fn beside_an_older_container(name: &str) -> (std::path::PathBuf, TurnBoard, TurnBoard) {
        let dir = std::env::temp_dir().join(format!("vgpu-board-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vgpu-turns-GPU-x");
        let mut older = TurnBoard::open_or_create(&path).unwrap();
        older
            .announce(0xc, 40, 0, NOW, TURN_STALE, TURN_MAX_AGE)
            .unwrap();
        let board = TurnBoard::open_or_create(&path).unwrap();
        (dir, older, board)
    }

    #[test]
    fn containers_with_and_without_records_see_each_other() {
        let (dir, older, mut board) = beside_an_older_container("see");
        let mut records = Records::default();
        // Ours: it sees the older one as busy with 40% share and ceiling.
        let seen = records.announce(0, &mut board, 0x5, &report(30, NOW + 2 * MS), NOW);
        let c = seen
            .iter()
            .find(|t| t.key == 0xc)
            .expect("the older container");
        assert_eq!((c.claim.share_pct, c.claim.ceiling_pct), (40, 40));
        assert!(c.busy_until > NOW);
        let me = seen.iter().find(|t| t.key == 0x5).expect("our own record");
        assert_eq!((me.claim.share_pct, me.busy_until), (30, NOW + 2 * MS));
        // The older one reads our part now (60%) in our turn entry.
        let tenants = older.tenants(NOW + MS, TURN_MAX_AGE);
        assert_eq!(tenants.iter().find(|t| t.key == 0x5).unwrap().limit_pct, 60);
        // The hot path rewrites only our demand.
        let again = records.demand(0, Some(NOW + 9 * MS));
        let me = again.iter().find(|t| t.key == 0x5).unwrap();
        assert_eq!(me.busy_until, NOW + 9 * MS);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_idle_container_stays_listed_with_an_idle_entry() {
        let (dir, _older, mut board) = beside_an_older_container("idle");
        let mut records = Records::default();
        records.announce(0, &mut board, 0x5, &report(30, NOW - MS), NOW);
        let path = dir.join("vgpu-turns-GPU-x");
        let listed = vgpu_shm::NodeReader::default()
            .turn_tenants(&path, NOW + MS, TURN_MAX_AGE)
            .unwrap();
        assert!(
            listed.iter().any(|t| t.key == 0x5 && t.limit_pct == 0),
            "{listed:?}"
        );
        assert!(records.read(0).iter().any(|t| t.key == 0x5));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
