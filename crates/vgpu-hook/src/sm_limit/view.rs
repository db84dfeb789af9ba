//! The shared file as the limiter's container view: the limit in force, peers'
//! utilization, the monitor's fields and the container's priority.

use vgpu_alloc_core::DeviceIndex;
use vgpu_limiter::{ContainerView, Nanos, PeerShare};

use super::SmLimiter;
use crate::log::{DEBUG, vlog};

/// The shared file's view of one device (the environment's limits only, without a file).
pub(crate) struct FileView {
    device: usize,
    /// The limiter's process state: limits and slot.
    sm: &'static SmLimiter,
}

impl FileView {
    pub(super) fn new(device: usize, sm: &'static SmLimiter) -> Self {
        Self { device, sm }
    }
}

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

    fn task_priority(&self) -> Option<i32> {
        // The file's (a live change there applies); the environment's without a file.
        self.sm.slot().map(|s| s.table().priority())
    }
}
