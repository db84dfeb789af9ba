//! What NVML reports about this process and its devices.

use super::*;

impl Sim {
    /// (total, free, used) of physical device `p` as NVML sees it (all processes).
    pub fn nvml_memory(&self, p: usize) -> (u64, u64, u64) {
        let d = &self.devices[p];
        let used = d.used.load(Ordering::Relaxed) + d.others();
        (d.total, d.total.saturating_sub(used), used)
    }

    /// Bytes this process uses on physical device `p`, and whether it has a context there.
    pub fn process_usage(&self, p: usize) -> (u64, bool) {
        let used = self.devices[p].used.load(Ordering::Relaxed);
        let has_ctx = match self.st.try_lock() {
            Ok(st) => st.ctxs.values().any(|c| c.dev == p),
            Err(_) => used > 0,
        };
        (used, has_ctx || used > 0)
    }

    /// Process id the simulator was started in.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The pid NVML lists this process under (`VGPU_SIM_NVML_PID`, else its own).
    pub fn nvml_pid(&self) -> u32 {
        self.cfg.nvml_pid.unwrap_or(self.pid)
    }
}
