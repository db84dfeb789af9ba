//! Share mode's records on the turn board (`VGPU_SM_MODE=share`; protocol in
//! `vgpu-shm/src/shares.rs`, arithmetic in `vgpu-limiter/src/share.rs`).
//!
//! Once per publish period the container announces itself on the board (under its lock),
//! reopens its handle on the board's file and rewrites its record; on the launch path, at
//! most every 0.5 ms, it reads all records with one `pread` through that handle and, when
//! its demand runs out soon, rewrites that one word. Everything read is hostile input: the
//! shm decoder refuses malformed records and the limiter's arithmetic never lets a record
//! lower this container's guarantee.

use std::fs::File;

use vgpu_limiter::{Nanos, ShareClaim, ShareReport, ShareTenant};
use vgpu_shm::TurnBoard;
use vgpu_shm::shares::{self, ShareRecord};

use super::view::{TURN_MAX_AGE, TURN_STALE};
use crate::log::{DEBUG, vlog};

/// `CUDA_TASK_PRIORITY`'s default (HAMi's): what a cap-mode container on the board counts as.
const DEFAULT_PRIORITY: i32 = 1;

/// This container's handle on the board's records and what it last read.
#[derive(Default)]
pub(super) struct ShareProbe {
    /// The board's file (reopened with every announcement).
    records: Option<File>,
    /// Our record's index (our turn entry).
    entry: Option<usize>,
    /// The key of every turn entry at the last announcement (records count under them).
    keys: Vec<u64>,
    /// Cap-mode containers on the board (a turn entry without a share record): each counts
    /// as busy with its limit as share and ceiling while it announces itself.
    capped: Vec<ShareTenant>,
}

impl ShareProbe {
    /// Announces `key` on `board` with `report` and returns every tenant there.
    pub(super) fn announce(
        &mut self,
        device: usize,
        board: &mut TurnBoard,
        key: u64,
        report: &ShareReport,
        now: Nanos,
    ) -> Vec<ShareTenant> {
        // Cap-mode containers lay out their turns from the entries' limits: show them our
        // part now (1..=99, the range an entry carries), or 0 while our demand ran out (an
        // idle tenant, for which nobody lays out a window: vgpu-shm's `turns`).
        let pct = if report.busy_until <= now {
            0
        } else {
            report.allot_pct.clamp(1, 99)
        };
        match board.announce(key, pct, report.launch_ns, now, TURN_STALE, TURN_MAX_AGE) {
            Ok(tenants) => {
                self.entry = board.entry();
                self.keys = board.entry_keys();
                self.capped = tenants
                    .iter()
                    .filter(|t| t.key != key)
                    .map(|t| ShareTenant {
                        key: t.key,
                        claim: ShareClaim {
                            share_pct: t.limit_pct,
                            ceiling_pct: t.limit_pct,
                            priority: DEFAULT_PRIORITY,
                        },
                        launch_ns: t.launch_ns,
                        busy_until: t.heartbeat_ns.saturating_add(TURN_MAX_AGE),
                        heartbeat: t.heartbeat_ns,
                        // Capped: its limit is what it may use.
                        util_pct: t.limit_pct,
                    })
                    .collect();
                match board.open_records() {
                    Ok(f) => self.records = Some(f),
                    Err(e) => vlog!(DEBUG, "device {device}: share records: {e}"),
                }
            }
            // Busy (another holder of the lock) or gone: keep the last handle and entry.
            Err(e) => vlog!(DEBUG, "device {device}: turn board: {e}"),
        }
        if let (Some(f), Some(e)) = (&self.records, self.entry) {
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
                vlog!(DEBUG, "device {device}: share record: {err}");
            }
        }
        self.read(device)
    }

    /// Whether this container has a record on the board (it announced itself in share
    /// mode).
    pub(super) fn has_record(&self) -> bool {
        self.records.is_some() && self.entry.is_some()
    }

    /// The hot path: writes `busy_until` if given, returns every tenant.
    pub(super) fn demand(&mut self, device: usize, busy_until: Option<Nanos>) -> Vec<ShareTenant> {
        if let (Some(f), Some(e), Some(b)) = (&self.records, self.entry, busy_until) {
            if let Err(err) = shares::write_busy_until(f, e, b) {
                vlog!(DEBUG, "device {device}: share demand: {err}");
            }
        }
        self.read(device)
    }

    fn read(&self, device: usize) -> Vec<ShareTenant> {
        let mut out = self.capped.clone();
        let Some(f) = &self.records else {
            return out;
        };
        match shares::read_records(f, &self.keys) {
            Ok(records) => {
                // A container with a share record is a share tenant, not a capped one.
                out.retain(|c| !records.iter().any(|r| r.key == c.key));
                out.extend(records.iter().map(|r| ShareTenant {
                    key: r.key,
                    claim: ShareClaim {
                        share_pct: u32::from(r.share_pct),
                        ceiling_pct: u32::from(r.ceiling_pct),
                        priority: r.priority,
                    },
                    launch_ns: r.launch_ns,
                    busy_until: r.busy_until,
                    heartbeat: r.heartbeat,
                    util_pct: u32::from(r.util_pct),
                }));
            }
            Err(e) => vlog!(DEBUG, "device {device}: share records: {e}"),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn report(share_pct: u32, busy_until: Nanos) -> ShareReport {
        ShareReport {
            claim: ShareClaim {
                share_pct,
                ceiling_pct: 100,
                priority: 1,
            },
            launch_ns: 50_000,
            busy_until,
            allot_pct: 60,
            util_pct: 55,
            lent_ns: 0,
            borrowed_ns: 7,
        }
    }

    const NOW: u64 = 10_000 * MS;

    /// A fresh board in a directory of its own (`name`) with a cap-mode container at 40%
    /// (key 0xc: a turn entry, no share record) announced at [`NOW`], and a share-mode
    /// container's handle and probe on it, not yet announced.
    fn beside_a_capped_container(
        name: &str,
    ) -> (
        std::path::PathBuf,
        std::path::PathBuf,
        TurnBoard,
        TurnBoard,
        ShareProbe,
    ) {
        let dir = std::env::temp_dir().join(format!("vgpu-share-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vgpu-turns-GPU-x");
        let mut capped = TurnBoard::open_or_create(&path).unwrap();
        capped
            .announce(0xc, 40, 0, NOW, TURN_STALE, TURN_MAX_AGE)
            .unwrap();
        let board = TurnBoard::open_or_create(&path).unwrap();
        (dir, path, capped, board, ShareProbe::default())
    }

    #[test]
    fn share_and_cap_mode_containers_see_each_other() {
        let (dir, _, capped, mut board, mut probe) = beside_a_capped_container("board");
        // A share-mode one: it sees the capped one as busy with 40% share and ceiling.
        let seen = probe.announce(0, &mut board, 0x5, &report(30, NOW + 2 * MS), NOW);
        let c = seen
            .iter()
            .find(|t| t.key == 0xc)
            .expect("the capped container");
        assert_eq!((c.claim.share_pct, c.claim.ceiling_pct), (40, 40));
        assert!(c.busy_until > NOW);
        let me = seen.iter().find(|t| t.key == 0x5).expect("our own record");
        assert_eq!((me.claim.share_pct, me.busy_until), (30, NOW + 2 * MS));
        // The cap-mode container reads our part now (60%) in our turn entry.
        let tenants = capped.tenants(NOW + MS, TURN_MAX_AGE);
        let ours = tenants.iter().find(|t| t.key == 0x5).unwrap();
        assert_eq!(ours.limit_pct, 60);
        // The hot path rewrites only our demand.
        let again = probe.demand(0, Some(NOW + 9 * MS));
        let me = again.iter().find(|t| t.key == 0x5).unwrap();
        assert_eq!(me.busy_until, NOW + 9 * MS);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cap_mode_neighbour_lays_out_no_window_for_an_idle_share_container() {
        use super::super::view::turn_tenant;
        use vgpu_limiter::Turn;
        let (dir, path, mut capped, mut board, mut probe) = beside_a_capped_container("idle");
        let now = NOW;
        // The share-mode container's demand ran out before now (its heartbeat, idle).
        probe.announce(0, &mut board, 0x5, &report(30, now - MS), now);
        let layout = |capped: &mut TurnBoard, at: u64| {
            let seen = capped
                .announce(0xc, 40, 0, at, TURN_STALE, TURN_MAX_AGE)
                .unwrap();
            let all: Vec<_> = seen.iter().map(turn_tenant).collect();
            Turn::layout(0xc, &all, 20 * MS)
        };
        assert_eq!(
            layout(&mut capped, now + MS),
            None,
            "alone: no window for the idle one"
        );
        // It is still on the board: listed for `vgpu status`, its record counts.
        let listed = vgpu_shm::NodeReader::default()
            .turn_tenants(&path, now + MS, TURN_MAX_AGE)
            .unwrap();
        assert!(
            listed.iter().any(|t| t.key == 0x5 && t.limit_pct == 0),
            "{listed:?}"
        );
        assert!(probe.read(0).iter().any(|t| t.key == 0x5));
        // Busy again (its next launch): a window of its part.
        probe.announce(0, &mut board, 0x5, &report(30, now + 9 * MS), now + 2 * MS);
        let turn = layout(&mut capped, now + 3 * MS).expect("two tenants take turns");
        assert!(turn.width > 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
