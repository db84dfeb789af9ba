//! The limiter: a plan from the board, then a short pipeline of gates.
//!
//! This file holds the admission (the gates) and the pacer; `segments.rs` the completion
//! markers and samples; `publish.rs` what goes to the usage file and the board.

use std::fmt;

pub use crate::config::LimiterConfig;
use crate::costs::{Charge, CostTable, LaunchId, Quote};
use crate::plan::{Plan, QueueRule};
use crate::policy::Policy;
use crate::share::{Allotment, NodeBoard, ShareClaim, SmMode};
use crate::traits::{Clock, ContainerView, GpuTimer, Nanos, PeerUsage};

mod publish;
mod segments;

use publish::{Standing, Usage};
use segments::Segments;

/// The answer to [`Limiter::admit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// Launch now, then hand the ticket to [`Limiter::launched`].
    Go(Ticket),
    /// Sleep this many nanoseconds, then ask again.
    Wait(Nanos),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TicketKind {
    /// Not accounted (no limit enforced).
    Uncounted,
    /// Nothing limits the container now: only its demand is noted.
    Free,
    /// Charged and tracked in a segment.
    Measured,
    /// Charged and measured alone: its identity's cost is learned.
    Sample,
}

/// Proof of admission, handed back with the launch's outcome.
///
/// It says how the launch is to be accounted and what it is charged (looked up once, at
/// admission), so that accounting does not depend on state another thread may change in
/// between.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ticket {
    kind: TicketKind,
    charge: Charge,
    known: bool,
}

impl Ticket {
    /// A ticket for a launch that is not accounted.
    pub const UNCOUNTED: Ticket = Ticket {
        kind: TicketKind::Uncounted,
        charge: Charge {
            cost: 0.0,
            sampled: 0.0,
        },
        known: false,
    };

    /// Whether the launch is accounted.
    pub fn counted(self) -> bool {
        self.kind != TicketKind::Uncounted
    }
}

/// Counters for tests, logs and the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LimiterStats {
    /// Launches admitted and reported successful while enforcing.
    pub launches: u64,
    /// Of those, launches of an identity whose cost was not known yet.
    pub unknown_launches: u64,
    /// Samples settled (launches measured alone).
    pub samples: u64,
    /// Of the samples taken, those opened behind a gate ([`crate::GpuTimer::gate`]).
    pub gated_samples: u64,
    /// Of those, gates the timer had opened before the launch's report (not used as samples).
    pub forced_gates: u64,
    /// Segments settled.
    pub segments: u64,
    /// Markers recorded.
    pub markers: u64,
    /// Of those, timed markers (the others are completion-only).
    pub timed_markers: u64,
    /// Times a marker was asked whether the GPU has reached it.
    pub queries: u64,
    /// GPU time charged, nanoseconds.
    pub busy_ns: f64,
    /// `Wait` answers given.
    pub waits: u64,
    /// Waits of the pacer (the charged work ran a burst ahead of the rate).
    pub pace_waits: u64,
    /// Waits for the queue to shrink (the short queue while outranked).
    pub queue_waits: u64,
    /// Waits held by a claim (a higher priority has work, or nothing is left to borrow).
    pub hold_waits: u64,
    /// Launches that went after the longest hold, whatever the board said.
    pub hold_expiries: u64,
    /// Timer operations that failed.
    pub timer_errors: u64,
}

/// The pacer: a bucket of GPU time that fills at the rate and that each launch empties by
/// its cost. A launch may go while the bucket is above minus one burst (so at most a burst
/// of work is queued ahead of the rate); once below, launches wait until it is back at zero
/// (hysteresis: a throttled loop runs in bursts and sleeps about once per burst, not once
/// per launch). The bucket holds at most the idle credit. Kept in GPU time, so a
/// rate change applies at once to what is owed.
#[derive(Debug)]
struct Pacer {
    tokens: f64,
    at: Nanos,
    throttled: bool,
}

impl Pacer {
    fn refill(&mut self, now: Nanos, rate: f64, credit: Nanos) {
        let dt = now.saturating_sub(self.at) as f64;
        self.tokens = (self.tokens + dt * rate).min(credit as f64);
        self.at = now;
    }

    /// How long until the bucket is back at zero while throttled, ns.
    fn time_to_clear(&self, rate: f64) -> f64 {
        match self.throttled {
            true => (-self.tokens / rate).max(0.0),
            false => 0.0,
        }
    }

    /// `Err(ns to wait)` when a launch costing `cost` would take the burst past `burst`
    /// (the first launch of a burst always goes, however long).
    fn gate(&mut self, rate: f64, burst: Nanos, cost: f64) -> Result<(), Nanos> {
        if self.throttled && self.tokens >= 0.0 {
            self.throttled = false;
        }
        if !self.throttled && self.tokens < 0.0 && self.tokens - cost < -(burst as f64) {
            self.throttled = true;
        }
        match self.throttled {
            true => Err((-self.tokens / rate).ceil().max(1.0) as Nanos),
            false => Ok(()),
        }
    }
}

/// The per-device SM limiter of one process.
pub struct Limiter<C: Clock, T: GpuTimer, V: ContainerView, B: NodeBoard> {
    cfg: LimiterConfig,
    clock: C,
    timer: T,
    view: V,
    board: B,
    seg: Segments<T::Stream, T::Marker>,
    costs: CostTable,
    pacer: Pacer,
    /// The process's rate at the last admission (its container's, after its peers' share).
    rate: f64,
    /// The container's allotment and plan from the last look at the board, and the claim
    /// they were computed for.
    allotment: Allotment,
    plan: Option<(ShareClaim, Plan)>,
    standing: Standing,
    peers: PeerUsage,
    /// When the first of the current run of held waits began.
    held_since: Option<Nanos>,
    /// When the work queued so far is estimated to end (ns).
    horizon: f64,
    /// When the last wait of the queue rule ends: a container waiting to launch more is
    /// busy (its queue runs slower than the horizon assumes while others share the GPU).
    waiting_until: Nanos,
    next_publish: Nanos,
    next_activity: Nanos,
    last_poll: Nanos,
    last_admit: Nanos,
    last_published: Nanos,
    usage: Usage,
    stats: LimiterStats,
}

impl<C: Clock, T: GpuTimer, V: ContainerView, B: NodeBoard> fmt::Debug for Limiter<C, T, V, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("rate", &self.rate)
            .field("plan", &self.plan)
            .field("pacer", &self.pacer)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<C: Clock, T: GpuTimer, V: ContainerView, B: NodeBoard> Limiter<C, T, V, B> {
    /// A limiter for one device.
    pub fn new(cfg: LimiterConfig, clock: C, timer: T, view: V, board: B) -> Self {
        let now = clock.now();
        Self {
            cfg,
            clock,
            timer,
            view,
            board,
            seg: Segments::default(),
            costs: CostTable::default(),
            pacer: Pacer {
                tokens: 0.0,
                at: now,
                throttled: false,
            },
            rate: 1.0,
            allotment: Allotment::alone(ShareClaim {
                share_pct: 100,
                ceiling_pct: 100,
                priority: cfg.priority,
            }),
            plan: None,
            standing: Standing::default(),
            peers: PeerUsage::default(),
            held_since: None,
            horizon: 0.0,
            waiting_until: 0,
            next_publish: now,
            next_activity: now,
            last_poll: now,
            last_admit: now,
            last_published: now,
            usage: Usage {
                bin_start: now,
                ..Usage::default()
            },
            stats: LimiterStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> LimiterStats {
        self.stats
    }

    /// Achieved utilization (fraction of wall time) as last published, if any.
    pub fn utilization(&self) -> Option<f64> {
        self.usage.util
    }

    /// The process's rate (fraction of the GPU's time) at the last admission.
    pub fn effective_limit(&self) -> f64 {
        self.rate
    }

    /// The container's allotment as last computed.
    pub fn allotment(&self) -> Allotment {
        self.allotment
    }

    /// What the cost table holds (for the report at exit).
    pub fn cost_profile(&self) -> crate::CostProfile {
        self.costs.profile()
    }

    /// The `n` identities charged the most time, with their samples (for the report at exit).
    pub fn heaviest_identities(&self, n: usize) -> Vec<crate::costs::IdentityReport> {
        self.costs.heaviest(n)
    }

    /// The learned cost of launches of `id`, ns.
    pub fn launch_cost(&self, id: LaunchId) -> Option<f64> {
        self.costs.cost(id)
    }

    /// The container view, e.g. for the hook to publish a final zero at exit.
    pub fn view_mut(&mut self) -> &mut V {
        &mut self.view
    }

    /// Asks whether a launch of identity `id` on `stream` may go now.
    ///
    /// With no limit, or policy `disable`, this reads the limit and answers `Go` without
    /// touching the timer or writing the shared view.
    pub fn admit(&mut self, stream: T::Stream, id: LaunchId) -> Admission {
        let pct = self.view.sm_limit_pct();
        let unlimited = pct == 0 || pct >= 100;
        // In share mode 0 is "no guarantee" and 100 "the whole GPU": both are enforced.
        if self.cfg.policy == Policy::Disable || (unlimited && self.cfg.mode == SmMode::Cap) {
            return Admission::Go(Ticket::UNCOUNTED);
        }
        let now = self.clock.now();
        self.last_admit = now;
        if self.view.recent_kernel() < 0 {
            // The monitor gives the device to a higher-priority task: submit nothing, and
            // let what was submitted be measured.
            self.close_open();
            self.poll(now);
            return self.wait(self.cfg.blocked_poll);
        }
        if now >= self.next_activity {
            self.view.note_activity(now);
            self.next_activity = now + self.cfg.activity_period;
        }
        if !self.cfg.policy.enforces(self.view.utilization_switch()) {
            return Admission::Go(Ticket::UNCOUNTED);
        }
        // The identity's cost, looked up once for every gate and the accounting after.
        let quote = self.costs.quote(id, now);
        match self.gates(now, pct, &quote) {
            Ok(kind) => {
                self.held_since = None;
                if kind != TicketKind::Free {
                    self.costs.count(id, &quote);
                    self.prepare(stream, kind, id, quote.known, now);
                }
                Admission::Go(Ticket {
                    kind,
                    charge: quote.charge.unwrap_or_default(),
                    known: quote.known,
                })
            }
            Err(ns) => {
                self.close_open();
                self.keep_demand(now);
                self.wait(ns.clamp(1, self.cfg.max_wait))
            }
        }
    }

    /// The gates, in order; `Err` is how long to wait.
    fn gates(&mut self, now: Nanos, pct: u32, quote: &Quote) -> Result<TicketKind, Nanos> {
        let plan = self.current_plan(now, pct);
        self.rate = self.split_with_peers(plan.rate);
        // A look once per demand grace: the demand on the board covers the queued work plus
        // a grace, so a queue that ran empty is seen before its demand outlives it by two.
        // The rules that need to know what ran look themselves.
        let due = now.saturating_sub(self.last_poll) >= self.cfg.idle_grace;
        if plan.is_free() && self.peers.active == 0 {
            // The whole GPU and our own queue: nothing to pace or measure (what was
            // measured before still settles).
            if due && !self.seg.is_idle() {
                self.poll(now);
            }
            return Ok(TicketKind::Free);
        }
        if due || self.pacer.throttled {
            self.poll(now);
        }
        let cost = quote.charge.map_or(0.0, |c| c.cost);
        self.gate_calibration()?;
        self.gate_queue(now, plan.queue, cost)?;
        self.pacer.refill(now, self.rate, self.cfg.credit);
        if self.rate < 1.0 {
            // At the whole GPU there is nothing to pace (the queue rule still applies).
            self.gate_pacer(self.cfg.burst, cost)?;
        }
        // A sample needs a segment of its own: none while the segments in flight are at their
        // bound (the open one grows instead; see `segments`).
        let sample = quote.sample_due
            && self.seg.samples() < self.cfg.max_samples
            && !self.seg_bound_reached();
        Ok(if sample {
            TicketKind::Sample
        } else {
            TicketKind::Measured
        })
    }

    /// The plan, recomputed when the board was read or the claim changed.
    fn current_plan(&mut self, now: Nanos, pct: u32) -> Plan {
        let claim = self.claim(pct);
        let due = now >= self.next_publish || self.board_due(now);
        match self.plan {
            Some((c, p)) if c == claim && !due => p,
            _ => {
                let p = self.refresh_plan(now, pct);
                self.plan = Some((claim, p));
                p
            }
        }
    }

    /// Nothing is known about any launch's cost yet: the first goes alone.
    fn gate_calibration(&mut self) -> Result<(), Nanos> {
        match self.costs.is_empty() && !self.seg.is_idle() {
            true => Err(self.cfg.poll_interval),
            false => Ok(()),
        }
    }

    /// The queue rule of the plan.
    fn gate_queue(&mut self, now: Nanos, rule: QueueRule, this: f64) -> Result<(), Nanos> {
        let cap = match rule {
            // Beyond what is probably running (the oldest segment not known complete): a
            // kernel longer than the deep queue still has the next one queued behind it, so
            // the GPU never waits for our host between them.
            QueueRule::Paced => self.cfg.deep_queue as f64 + self.seg.oldest_charged(),
            QueueRule::Short => self.cfg.short_queue as f64,
            QueueRule::Single => 0.0,
            QueueRule::Hold { until } => {
                let since = *self.held_since.get_or_insert(now);
                if now.saturating_sub(since) < self.cfg.max_hold {
                    self.stats.hold_waits += 1;
                    // Ask again when the claim may have run out, at the latest at the next
                    // read of the board.
                    let next = until.max(now + 1).min(self.standing_read_at().max(now + 1));
                    return Err(next - now);
                }
                // Held the longest a record may hold a launch: this one goes, short.
                self.stats.hold_expiries += 1;
                self.cfg.short_queue as f64
            }
        };
        let mut queued = self.seg.queued();
        if queued > 0.0 && queued + this > cap {
            // The queue only shrinks as segments settle: settle them (one query each) first.
            self.poll(now);
            queued = self.seg.queued();
        }
        if queued > 0.0 && queued + this > cap {
            self.stats.queue_waits += 1;
            // A full deep queue waits until half of it ran (the GPU runs it at most at full
            // speed): one wake-up per half a queue, and still two time slices queued. The
            // priority rules wait only for what exceeds their bound.
            let resume = match rule {
                QueueRule::Paced => cap / 2.0,
                _ => cap,
            };
            let wait = ((queued + this - resume) as Nanos)
                .clamp(self.cfg.poll_interval, self.cfg.max_wait);
            self.waiting_until = now.saturating_add(wait);
            return Err(wait);
        }
        Ok(())
    }

    fn gate_pacer(&mut self, burst: Nanos, cost: f64) -> Result<(), Nanos> {
        self.pacer.gate(self.rate, burst, cost).inspect_err(|_| {
            self.stats.pace_waits += 1;
        })
    }

    /// Reports the launch that [`Limiter::admit`] let go with `ticket` (which carries its
    /// charge); `ok` is whether the driver accepted it.
    pub fn launched(&mut self, ticket: Ticket, stream: T::Stream, ok: bool) {
        if !ticket.counted() || !ok {
            if ticket.kind == TicketKind::Sample && !ok {
                // The sample's segment holds nothing: drop it.
                self.close_open();
            }
            return;
        }
        let now = self.clock.now();
        self.stats.launches += 1;
        if ticket.kind == TicketKind::Free {
            // Done soon after its launch, as far as others need to know.
            self.horizon = self.horizon.max(now as f64);
            return;
        }
        let (charge, known) = (ticket.charge, ticket.known);
        if !known {
            self.stats.unknown_launches += 1;
        }
        self.pacer.tokens -= charge.cost;
        self.horizon = self.horizon.max(now as f64) + charge.cost;
        self.add_launch(stream, charge, known);
    }

    /// A settled segment's charge differed from what its launches were charged by `delta`.
    fn charge_correction(&mut self, delta: f64) {
        self.pacer.tokens -= delta;
        if self.cfg.mode == SmMode::Share {
            // Share mode promises a part from now on, not an average over the past: no debt
            // beyond a few bursts.
            let floor = -4.0 * self.cfg.burst as f64;
            self.pacer.tokens = self.pacer.tokens.max(floor);
        }
    }

    fn wait(&mut self, ns: Nanos) -> Admission {
        self.stats.waits += 1;
        Admission::Wait(ns.max(1))
    }

    /// The process's part of the container's `rate`, after its peers' share: what the
    /// others do not use, and at least an equal split (no process starves).
    fn split_with_peers(&self, rate: f64) -> f64 {
        // Never 0: the pacer divides by it.
        let rate = rate.max(1e-3);
        if !self.cfg.share_with_peers || self.peers.active == 0 {
            return rate;
        }
        let others = f64::from(self.peers.util_pct) / 100.0;
        let fair = rate / f64::from(self.peers.active + 1);
        (rate - others).max(fair).max(0.005)
    }
}
