//! The shared file as the limiter's container view: the limit in force, peers'
//! utilization, the monitor's fields, the turn board and the device's power.

use vgpu_alloc_core::DeviceIndex;
use vgpu_limiter::power::PowerState;
use vgpu_limiter::{
    ContainerView, DeviceSample, Nanos, PeerShare, PowerSample, ShareReport, ShareTenant,
    TurnTenant,
};

use super::SmLimiter;
use super::power_share::{PowerLog, Watts};
use super::probes::{NvmlProbe, TurnProbe};
use super::share_board::ShareProbe;
use crate::log::{DEBUG, INFO, vlog};

/// The shared file's view of one device (the environment's limits only, without a file).
pub(crate) struct FileView {
    device: usize,
    /// The limiter's process state: limits, slot, baselines and power readings.
    sm: &'static SmLimiter,
    nvml: NvmlProbe,
    turns: TurnProbe,
    /// Share mode's records on the turn board.
    share: ShareProbe,
    /// Which power-share conclusions were logged at INFO.
    power_log: PowerLog,
}

impl FileView {
    pub(super) fn new(device: usize, sm: &'static SmLimiter) -> Self {
        Self {
            device,
            sm,
            nvml: NvmlProbe::Unopened,
            turns: TurnProbe::Unopened,
            share: ShareProbe::default(),
            power_log: PowerLog::default(),
        }
    }

    /// At exit, in share mode: withdraws this container's turn entry, so that others stop
    /// counting it at once: its record (kept, for `vgpu status`) no longer counts for them,
    /// nor its rank, and the entry without a live record no longer reads as a busy cap-mode
    /// tenant. Another process of the same container announces itself again within a
    /// publish period. Cap mode's entries age out as before.
    pub(super) fn leave_board(&mut self) {
        if !self.share.has_record() {
            return;
        }
        if let TurnProbe::Open { board, key } = &mut self.turns {
            if let Err(e) = board.withdraw(*key) {
                vlog!(DEBUG, "device {}: turn entry at exit: {e}", self.device);
            }
        }
    }
}

/// A cap-mode container's view of a tenant on the board (it lays out windows of their
/// limits; the board hands it only tenants that take turns).
pub(super) fn turn_tenant(t: &vgpu_shm::Tenant) -> TurnTenant {
    TurnTenant {
        key: t.key,
        part_bp: t.limit_pct.min(100) * 100,
        launch_ns: t.launch_ns,
    }
}

/// Announcements older than this are not tenants (three publish periods).
pub(super) const TURN_MAX_AGE: Nanos = 300_000_000;
/// An entry this stale may be taken over.
pub(super) const TURN_STALE: Nanos = 1_000_000_000;

impl ContainerView for FileView {
    fn sm_limit_pct(&self) -> u32 {
        self.sm.limit_pct(self.device)
    }

    fn recent_kernel(&self) -> i32 {
        self.sm.slot().map_or(0, |s| s.table().recent_kernel())
    }

    fn utilization_switch(&self) -> i32 {
        // Without a file there is no monitor: treat the device as shared.
        self.sm.slot().map_or(1, |s| s.table().utilization_switch())
    }

    fn peers(&self) -> Vec<PeerShare> {
        let Some(me) = self.sm.slot() else {
            return Vec::new();
        };
        let Some(i) = self.sm.file_index(self.device) else {
            return Vec::new();
        };
        let snap = me.table().snapshot();
        snap.processes
            .iter()
            .filter(|p| p.slot != me.index() && p.alive)
            .filter_map(|p| p.devices.get(i))
            .map(|u| PeerShare {
                util_pct: u.sm_util.min(100) as u32,
                published_at: u.sm_util_at,
            })
            .collect()
    }

    fn publish_util(&mut self, util_pct: u32, now: Nanos) {
        vlog!(
            DEBUG,
            "device {}: achieved SM utilization {util_pct}%",
            self.device
        );
        if let Some(s) = self.sm.slot()
            && let Some(i) = self.sm.file_index(self.device)
        {
            s.publish_sm_util(DeviceIndex(i as u32), u64::from(util_pct), now);
        }
    }

    fn note_activity(&mut self, _now: Nanos) {
        // At most once a second (the limiter's activity period), and only in processes with
        // an SM limit: the unlimited launch path stays one relaxed load (docs/sm-limit.md).
        if let Some(s) = self.sm.slot() {
            s.table().note_kernel_activity();
        }
    }

    fn turn_tenants(&mut self, now: Nanos, launch_ns: u64) -> Option<(u64, Vec<TurnTenant>)> {
        if matches!(self.turns, TurnProbe::Unopened) {
            self.turns = TurnProbe::open(self.device, self.sm);
        }
        let TurnProbe::Open { board, key } = &mut self.turns else {
            return None;
        };
        let pct = self.sm.limit_pct(self.device);
        let tenants = match board.announce(*key, pct, launch_ns, now, TURN_STALE, TURN_MAX_AGE) {
            Ok(t) => t,
            Err(e) => {
                vlog!(DEBUG, "device {}: turn board: {e}", self.device);
                return None;
            }
        };
        Some((*key, tenants.iter().map(turn_tenant).collect()))
    }

    fn share_board(&mut self, now: Nanos, report: &ShareReport) -> Option<(u64, Vec<ShareTenant>)> {
        if matches!(self.turns, TurnProbe::Unopened) {
            self.turns = TurnProbe::open(self.device, self.sm);
        }
        let TurnProbe::Open { board, key } = &mut self.turns else {
            return None;
        };
        let tenants = self.share.announce(self.device, board, *key, report, now);
        // On a board now: keep it there while idle (a relaxed load once it runs).
        self.sm.want_heartbeat();
        vlog!(
            DEBUG,
            "device {}: share mode: part {}%, {} containers on the board",
            self.device,
            report.allot_pct,
            tenants.len()
        );
        Some((*key, tenants))
    }

    fn share_demand(&mut self, _now: Nanos, busy_until: Option<Nanos>) -> Option<Vec<ShareTenant>> {
        matches!(self.turns, TurnProbe::Open { .. })
            .then(|| self.share.demand(self.device, busy_until))
    }

    fn task_priority(&self) -> Option<i32> {
        // The file's (a live change there applies); the environment's without a file.
        self.sm.slot().map(|s| s.table().priority())
    }

    fn device_sample(&mut self) -> Option<DeviceSample> {
        let sample = self.nvml.sample(self.device);
        if let Some(s) = sample {
            vlog!(
                DEBUG,
                "device {}: NVML sees this process at {:.0}%{}",
                self.device,
                s.own * 100.0,
                if s.others_active {
                    ", others active"
                } else {
                    ""
                }
            );
        }
        sample
    }

    fn power_sample(&mut self, _now: Nanos) -> Option<PowerSample> {
        // The reader thread's latest (a few atomic loads; NVML is not called here).
        self.sm.power.latest(self.device)
    }

    fn power_baseline(&mut self) -> Option<PowerSample> {
        self.sm.baselines.take(self.device)
    }

    fn note_power(&mut self, state: &PowerState) {
        let d = self.device;
        vlog!(
            DEBUG,
            "device {d}: power {:.0} W, busy {:.0}%, idle {} W, busy {} W, limit {:.0} W, scale {:.2}",
            state.watts,
            state.busy * 100.0,
            Watts(state.idle_watts),
            Watts(state.busy_watts),
            state.limit_watts,
            state.scale
        );
        if self.power_log.wants_info(state) {
            vlog!(
                INFO,
                "device {d}: power share: idle {} W, {} W more per busy second, limit {:.0} W: \
                 SM limit scaled by {:.2}",
                Watts(state.idle_watts),
                Watts(state.busy_watts),
                state.limit_watts,
                state.scale
            );
        }
    }
}
