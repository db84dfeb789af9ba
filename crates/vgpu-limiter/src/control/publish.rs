//! What the limiter tells others: once per publish period the achieved utilization (the
//! usage file) and the container's record (the board); from the launch path, once per board
//! poll ([`Limiter::board_poll`]) and at the first launch after its demand ran out, its demand
//! (`busy_until`) and the others' records; while idle, a heartbeat that keeps a live container
//! on the board.

use super::Limiter;
use crate::plan::Plan;
use crate::share::{Allotment, BoardRecord, BoardReport, NodeBoard, ShareClaim, SmMode, allot};
use crate::traits::{Clock, ContainerView, GpuTimer, Nanos, PeerUsage};

/// The container's standing on the board: its key, the records as last read, and what it
/// last wrote.
#[derive(Debug, Default)]
pub(super) struct Standing {
    /// Its key on the board (`None`: not on one).
    key: Option<u64>,
    records: Vec<BoardRecord>,
    next_read: Nanos,
    /// The `busy_until` last written (0: none).
    published_busy: Nanos,
    /// GPU time of its guarantee left to others, and used above it, so far.
    lent_ns: f64,
    borrowed_ns: f64,
}

/// The usage bins: GPU time charged per publish period and the smoothed utilization.
#[derive(Debug, Default)]
pub(super) struct Usage {
    pub(super) bin_start: Nanos,
    pub(super) bin_busy: f64,
    pub(super) util: Option<f64>,
}

impl<C: Clock, T: GpuTimer, V: ContainerView, B: NodeBoard> Limiter<C, T, V, B> {
    /// The claim this container makes now (its file's limit and priority).
    pub(super) fn claim(&self, pct: u32) -> ShareClaim {
        let pct = if pct >= 100 { 100 } else { pct };
        let ceiling = match self.cfg.mode {
            SmMode::Cap => pct,
            SmMode::Share => self.cfg.ceiling_pct,
        };
        ShareClaim {
            share_pct: pct,
            ceiling_pct: ceiling,
            priority: self.view.task_priority().unwrap_or(self.cfg.priority),
        }
        .sanitized()
    }

    /// Once per publish period and once per board poll: publishes and reads what is
    /// due, and computes the plan from the board's records.
    pub(super) fn refresh_plan(&mut self, now: Nanos, pct: u32) -> Plan {
        let claim = self.claim(pct);
        if now >= self.next_publish {
            self.publish(now, claim);
        } else if self.board_due(now) {
            self.read_demand(now);
        }
        let a = match self.standing.key {
            Some(me) => allot(me, claim, &self.standing.records, now, self.cfg.rules),
            None => Allotment::alone(claim),
        };
        // A cap is a cap: share-mode parts never raise it.
        let a = match self.cfg.mode {
            SmMode::Cap => Allotment {
                fraction: a.fraction.min(f64::from(claim.ceiling_pct) / 100.0),
                ..a
            },
            SmMode::Share => a,
        };
        self.allotment = a;
        Plan::of(&a, now)
    }

    /// This container's demand: until when it has work queued or waits for its rate or its
    /// queue rule to launch more, plus the grace.
    fn busy_until(&self, now: Nanos) -> Nanos {
        let paced = now as f64 + self.pacer.time_to_clear(self.rate);
        let waits = self.waiting_until as f64;
        (self.horizon.max(paced).max(waits) as Nanos).saturating_add(self.cfg.idle_grace)
    }

    /// How often the launch path reads the board and checks our demand on it: as often as
    /// the priority rules need a demand (outranked, the urgent one's: a fifth of the demand
    /// poll; outranking someone, ours: the demand poll), otherwise the calm poll, since no
    /// plan then needs another's demand sooner than a share is lent. A read with its write
    /// costs a launching thread about 20 µs (docs/sm-limit.md).
    pub(super) fn board_poll(&self) -> Nanos {
        match (self.allotment.outranked, self.allotment.outranks) {
            (true, _) => self.cfg.demand_poll / 5,
            (false, true) => self.cfg.demand_poll,
            (false, false) => self.cfg.calm_poll,
        }
    }

    /// Whether the launch path reads the board now: its poll is due, or our demand on it ran
    /// out (the first launch after a pause says at once that we have work again).
    pub(super) fn board_due(&self, now: Nanos) -> bool {
        self.standing.key.is_some()
            && (now >= self.standing.next_read || now >= self.standing.published_busy)
    }

    /// The demand we write: our work's end plus the grace (`busy_until`), and what the poll
    /// adds beyond the demand poll, which the grace covers. So it never runs out before our
    /// next look while we have work; a container that stops is taken for busy at most a poll
    /// longer, which no rule at the calm poll notices (a share is lent 50 ms after).
    fn demand_ahead(&self, now: Nanos) -> Nanos {
        let lead = self.board_poll().saturating_sub(self.cfg.demand_poll);
        self.busy_until(now).saturating_add(lead)
    }

    /// The demand to write, if the one on the board runs out sooner than half a grace from
    /// the new one (at most once per half a grace).
    fn demand_due(&self, now: Nanos) -> Option<Nanos> {
        let busy = self.demand_ahead(now);
        let published = self.standing.published_busy;
        (busy > published.saturating_add(self.cfg.idle_grace / 2)).then_some(busy)
    }

    /// Before a wait: the demand on the board must not run out while this container waits
    /// to launch.
    pub(super) fn keep_demand(&mut self, now: Nanos) {
        if self.standing.key.is_some() && self.demand_due(now).is_some() {
            self.read_demand(now);
        }
    }

    /// Writes our demand if it is due ([`Self::demand_due`]), and reads every record (one
    /// read of the board).
    fn read_demand(&mut self, now: Nanos) {
        let write = self.demand_due(now);
        if let Some(b) = write {
            self.standing.published_busy = b;
        }
        if let Some(records) = self.board.demand(now, write) {
            self.standing.records = records;
        }
        self.standing.next_read = now + self.board_poll();
    }

    /// Once per publish period, from an admission: the achieved utilization, the peers'
    /// shares and the board's record.
    fn publish(&mut self, now: Nanos, claim: ShareClaim) {
        let (bin_busy, elapsed) = self.close_bin(now, true);
        if self.cfg.share_with_peers {
            self.peers = self.fresh_peers(now);
        }
        let busy_until = self.demand_ahead(now);
        self.publish_record(now, claim, busy_until, (bin_busy, elapsed));
        self.next_publish = now + self.cfg.publish_period;
        self.last_published = now;
    }

    /// Off the launch path (the hook's heartbeat thread, every 50 ms): while no launch
    /// comes, keeps this container's record fresh once per publish period, so that a
    /// container alive but idle (a service between requests) stays on the board: `vgpu
    /// status` lists it, and lower priorities keep their queues short for it. Its demand is
    /// left as last written, so once that ran out it is idle to the others. Does nothing
    /// before the container first announced itself, or while launches come.
    pub fn idle_heartbeat(&mut self) {
        if self.standing.key.is_none() {
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
        let claim = self.claim(self.view.sm_limit_pct());
        let bin = self.close_bin(now, false);
        let busy_until = self.standing.published_busy;
        self.publish_record(now, claim, busy_until, bin);
        self.last_published = now;
        // The first launch after the spell announces itself at once.
        self.next_publish = now;
    }

    /// Whether another process of this container (same key, so the same record) keeps the
    /// record: it has work (a demand not ours that has not run out), or it rewrote the record
    /// since this process last did, lately. An idle beat would overwrite its demand.
    fn sibling_keeps_the_record(&mut self, now: Nanos) -> bool {
        let (key, ours) = (self.standing.key, self.standing.published_busy);
        let fresh = self.cfg.publish_period + self.cfg.publish_period / 2;
        let last = self.last_published;
        self.board.demand(now, None).is_some_and(|records| {
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
        let elapsed = now.saturating_sub(self.usage.bin_start);
        let bin_busy = self.usage.bin_busy;
        if elapsed > 0 && self.stats.launches > 0 {
            let bin = (bin_busy / elapsed as f64).min(1.0);
            let util = self.usage.util.map_or(bin, |u| 0.5 * u + 0.5 * bin);
            self.usage.util = Some(util);
            if to_file {
                self.view.publish_util((util * 100.0).round() as u32, now);
            }
        }
        self.usage.bin_start = now;
        self.usage.bin_busy = 0.0;
        (bin_busy, elapsed)
    }

    /// Writes the full record and reads the board; `bin` is the utilization bin just ended
    /// (GPU time, length), which also accounts what was lent and borrowed.
    fn publish_record(
        &mut self,
        now: Nanos,
        claim: ShareClaim,
        busy_until: Nanos,
        bin: (f64, Nanos),
    ) {
        let (busy, elapsed) = bin;
        let fair = self.allotment.guarantee * elapsed as f64;
        let bin_start = now.saturating_sub(elapsed);
        let someone_busy = self.standing.records.iter().any(|t| {
            Some(t.key) != self.standing.key
                && t.busy_until >= bin_start
                && now.saturating_sub(t.heartbeat) <= self.cfg.rules.max_age
        });
        if busy > fair {
            self.standing.borrowed_ns += busy - fair;
        } else if someone_busy {
            self.standing.lent_ns += fair - busy;
        }
        let allot_pct = match busy_until > now {
            true => (self.allotment.fraction * 100.0).round() as u32,
            false => 0,
        };
        let report = BoardReport {
            claim,
            busy_until,
            allot_pct,
            launch_ns: self.costs.mean().unwrap_or(0.0) as u64,
            util_pct: self.usage.util.map_or(0, |u| (u * 100.0).round() as u32),
            lent_ns: self.standing.lent_ns as u64,
            borrowed_ns: self.standing.borrowed_ns as u64,
        };
        self.standing.published_busy = busy_until;
        match self.board.publish(now, &report) {
            Some((key, records)) => {
                self.standing.key = Some(key);
                self.standing.records = records;
            }
            None => {
                self.standing.key = None;
                self.standing.records.clear();
            }
        }
        self.standing.next_read = now + self.board_poll();
    }

    /// The peers' shares that are recent enough to count: a share published more than
    /// `peer_stale_after` ago belongs to a process that stopped launching.
    fn fresh_peers(&self, now: Nanos) -> PeerUsage {
        let mut usage = PeerUsage::default();
        for share in self.view.peers() {
            let stale = share
                .published_at
                .is_some_and(|t| now.saturating_sub(t) > self.cfg.peer_stale_after);
            if share.util_pct > 0 && !stale {
                usage.util_pct = usage.util_pct.saturating_add(share.util_pct.min(100));
                usage.active += 1;
            }
        }
        usage
    }

    /// When the board is to be read next (never without a board).
    pub(super) fn standing_read_at(&self) -> Nanos {
        match self.standing.key {
            Some(_) => self.standing.next_read,
            None => Nanos::MAX,
        }
    }

    /// GPU time (ns) of its guarantee lent to others, and used above it, so far.
    pub fn lent_and_borrowed(&self) -> (u64, u64) {
        (
            self.standing.lent_ns as u64,
            self.standing.borrowed_ns as u64,
        )
    }

    /// Takes this container's record off the board (the hook, at exit).
    pub fn leave_board(&mut self) {
        self.board.leave();
    }
}
