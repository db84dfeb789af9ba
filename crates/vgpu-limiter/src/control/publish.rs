//! The limiter's publishing: once per publish period from a launch (the achieved
//! utilization in the usage file, the container's turn or share record on the board), and in
//! share mode the idle heartbeat that keeps a container without launches on the board.

use super::Limiter;
use crate::share::{ShareReport, Sharing};
use crate::traits::{Clock, ContainerView, GpuTimer, Nanos, Turn};

/// How far (a fraction) the learned launch cost moves before it is published again.
const LAUNCH_REPUBLISH: f64 = 0.25;

impl<C: Clock, T: GpuTimer, V: ContainerView> Limiter<C, T, V> {
    /// Once per publish period, from an admission: the achieved utilization, the peers'
    /// shares, the power share's sample, and the board (share mode's record, or cap mode's
    /// turn).
    pub(super) fn maybe_publish(&mut self, now: Nanos, pct: u32) {
        if now < self.next_publish {
            return;
        }
        let (bin_busy, elapsed) = self.close_bin(now, true);
        if self.cfg.share_with_peers {
            self.peers = self.fresh_peers(now);
        }
        self.sample_power(now);
        let launch_ns = self.launch_to_publish();
        if self.sharing.is_some() {
            let busy_until = (self.horizon.max(now as f64) as Nanos)
                .saturating_add(self.cfg.idle_grace_in_turns);
            self.publish_share(now, pct, launch_ns, busy_until, (bin_busy, elapsed));
        } else {
            let turn = self
                .view
                .turn_tenants(now, launch_ns)
                .and_then(|(me, all)| Turn::layout(me, &all, self.cfg.turn_cycle));
            self.set_turn(turn);
        }
        self.next_publish = now + self.cfg.publish_period;
        self.last_published = now;
    }

    /// Share mode, off the launch path (the hook's heartbeat thread, every 50 ms): while no
    /// launch comes, keeps this container's record and turn entry fresh, once per publish
    /// period, so that a container alive but idle (a service between requests) stays on the
    /// board: `vgpu status` lists it, and lower priorities stay outranked by it. Its demand
    /// is left as last written, so once that ran out it is idle to the others (its part 0,
    /// and its turn entry marked idle: no window is laid out for it). The next launch
    /// publishes at once. Does nothing in cap mode (an idle capped container leaves the
    /// turns), before the container first announced itself, or while launches come (each
    /// admission publishes in time). Never touches the GPU timer, NVML or the usage file's
    /// utilization (peers there count only values published by launches).
    pub fn idle_heartbeat(&mut self) {
        if !self.sharing.as_ref().is_some_and(Sharing::announced) {
            return;
        }
        let now = self.clock.now();
        let quiet = now.saturating_sub(self.last_admit) >= self.cfg.publish_period / 2;
        if !quiet || now.saturating_sub(self.last_published) < self.cfg.publish_period {
            return;
        }
        if self.sibling_keeps_the_record(now) {
            return;
        }
        let pct = self.view.sm_limit_pct();
        let bin = self.close_bin(now, false);
        let busy_until = self.sharing.as_ref().map_or(0, Sharing::published_busy);
        self.publish_share(now, pct, self.published_launch, busy_until, bin);
        self.last_published = now;
        // The first launch after the spell announces its part at once.
        self.next_publish = now;
    }

    /// Whether another process of this container (same key, so the same record) keeps the
    /// record: it has work (a demand not ours that has not run out; its launch path rewrites
    /// that word alone), or it rewrote the record since this process last did, lately. An
    /// idle beat would overwrite its demand and part with this process's idle ones. One read
    /// of the records.
    fn sibling_keeps_the_record(&mut self, now: Nanos) -> bool {
        let Some(s) = self.sharing.as_ref() else {
            return false;
        };
        let (key, ours) = (s.key(), s.published_busy());
        let fresh = self.cfg.publish_period + self.cfg.publish_period / 2;
        let last = self.last_published;
        self.view.share_demand(now, None).is_some_and(|records| {
            records.iter().any(|r| {
                Some(r.key) == key
                    && ((r.busy_until > now && r.busy_until != ours)
                        || (r.heartbeat > last && now.saturating_sub(r.heartbeat) < fresh))
            })
        })
    }

    /// Ends the utilization bin: updates the achieved utilization (published in the usage
    /// file when `to_file`) and returns the bin's GPU time and length.
    fn close_bin(&mut self, now: Nanos, to_file: bool) -> (f64, Nanos) {
        let elapsed = now.saturating_sub(self.bin_start);
        let bin_busy = self.bin_busy;
        if elapsed > 0 && self.stats.launches > 0 {
            let bin = (self.bin_busy / elapsed as f64).min(1.0);
            let util = match self.util {
                Some(u) => 0.5 * u + 0.5 * bin,
                None => bin,
            };
            self.util = Some(util);
            if to_file {
                self.view.publish_util((util * 100.0).round() as u32, now);
            }
        }
        self.bin_start = now;
        self.bin_busy = 0.0;
        (bin_busy, elapsed)
    }

    /// Share mode: writes the full record (demand `busy_until`) and reads the board; `bin`
    /// is the utilization bin just ended (GPU time, length).
    fn publish_share(
        &mut self,
        now: Nanos,
        pct: u32,
        launch_ns: u64,
        busy_until: Nanos,
        bin: (f64, Nanos),
    ) {
        // Idle (the demand ran out): no part now.
        let allot_pct = match self.allotment() {
            Some(a) if busy_until > now => (a.fraction * 100.0).round() as u32,
            _ => 0,
        };
        let report = ShareReport {
            claim: self.claim(pct),
            launch_ns,
            busy_until,
            allot_pct,
            util_pct: self.util.map_or(0, |u| (u * 100.0).round() as u32),
            lent_ns: 0,
            borrowed_ns: 0,
        };
        let rules = self.cfg.share_rules;
        if let Some(s) = self.sharing.as_mut() {
            s.publish(&mut self.view, now, report, bin.0, bin.1, rules);
        }
    }

    /// The typical launch length others read on the board: the learned cost, republished
    /// only once it moved by more than [`LAUNCH_REPUBLISH`] from what was published. Every
    /// container lays the turns out from these values (the cycle doubles with them), so a
    /// cost that wanders around a cycle's boundary would flip the layout, and each flip
    /// leaves the GPU idle while the containers find their new windows (H200: 60-80 turn
    /// changes in 20 s, the device 91-99% busy with one of four tenants idle).
    fn launch_to_publish(&mut self) -> u64 {
        let cost = self.turn_cost.unwrap_or(0.0).max(0.0);
        let old = self.published_launch as f64;
        if old <= 0.0 || (cost - old).abs() > LAUNCH_REPUBLISH * old {
            if self.published_launch != cost as u64 {
                self.stats.launch_publishes += 1;
            }
            self.published_launch = cost as u64;
        }
        self.published_launch
    }
}
