//! The limiter: measured segments plus a virtual-time pacer.
//!
//! This file holds the admission (the pacer, turns, share mode's part); `segments.rs` the
//! measurement (the GPU timer's markers around launches, settled into measured GPU time);
//! `publish.rs` what goes to the usage file and the board once per publish period, and the
//! idle heartbeat.

use std::collections::VecDeque;
use std::fmt;

pub use crate::config::LimiterConfig;
use crate::policy::Policy;
use crate::power::{PowerShare, PowerState};
use crate::share::{Allotment, ShareClaim, ShareTiming, Sharing, SmMode};
use crate::traits::{Clock, ContainerView, GpuTimer, Nanos, PeerUsage, Turn};

mod publish;
mod segments;

/// The answer to [`Limiter::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Launch now, then hand the ticket to [`Limiter::launched`].
    Go(Ticket),
    /// Sleep this many nanoseconds, then ask again.
    Wait(Nanos),
}

/// Proof of admission, handed back with the launch's outcome.
///
/// It says whether the launch is to be accounted (it is not when no limit is enforced),
/// so that accounting does not depend on state another thread may change in between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    counted: bool,
}

impl Ticket {
    /// A ticket for a launch that is not accounted.
    pub const UNCOUNTED: Ticket = Ticket { counted: false };

    /// Whether the launch is accounted.
    pub fn counted(self) -> bool {
        self.counted
    }
}

/// Counters for tests, logs and the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LimiterStats {
    /// Launches admitted and reported successful while enforcing.
    pub launches: u64,
    /// Segments measured.
    pub segments: u64,
    /// Markers recorded.
    pub markers: u64,
    /// Times a marker was asked whether the GPU has reached it (each a driver call on the
    /// GPU: the launch path's main cost besides the markers).
    pub queries: u64,
    /// GPU time charged from measurements, nanoseconds.
    pub busy_ns: f64,
    /// `Wait` answers given.
    pub waits: u64,
    /// Timer operations that failed.
    pub timer_errors: u64,
    /// Times the pacer started throttling (the virtual clock ran a period ahead).
    pub throttles: u64,
    /// Waits for this container's turn window.
    pub window_waits: u64,
    /// Share mode: waits held with no part (a higher priority had work, nothing to borrow).
    pub held_waits: u64,
    /// Share mode: waits for the queue to shrink while outranked.
    pub queue_waits: u64,
    /// Share mode: launches admitted while held by priority and filling the gaps of a
    /// sparse higher-priority container ([`crate::Allotment::gap_fill`]).
    pub gap_fill_launches: u64,
    /// Share mode: times gap filling started or stopped (how often the judgement of the
    /// higher container's work as sparse flipped).
    pub gap_fill_changes: u64,
    /// Times this container's turn (cycle, offset or width) changed.
    pub turn_changes: u64,
    /// Of those, the times its cycle changed (or turns started or ended).
    pub cycle_changes: u64,
    /// Times the launch length it publishes on the board changed.
    pub launch_publishes: u64,
    /// The launch length it publishes now, ns (the turns' cycle follows it).
    pub published_launch_ns: u64,
    /// What one launch is taken to cost when fitting work into a window now, ns.
    pub fit_ns: f64,
}

struct Segment<S, M> {
    stream: S,
    start: M,
    /// False when `start` is the previous segment's end, still owned by that segment.
    start_owned: bool,
    /// `start` is the end marker of the previous segment on the stream.
    chained: bool,
    end: Option<M>,
    /// False once ownership of `end` passed to the following segment (chaining).
    end_owned: bool,
    launches: u32,
    /// Estimates charged for the launches, nanoseconds of GPU time.
    est: f64,
    last_launch: Nanos,
    /// Closed after the host was idle for `idle_gap`: its span includes the idle spell, so
    /// it is bounded by the learned cost when settled.
    ended_idle: bool,
}

/// The per-device SM limiter of one process.
pub struct Limiter<C: Clock, T: GpuTimer, V: ContainerView> {
    cfg: LimiterConfig,
    clock: C,
    timer: T,
    view: V,
    open: Option<Segment<T::Stream, T::Marker>>,
    closed: VecDeque<Segment<T::Stream, T::Marker>>,
    /// Virtual time (ns): real time at which the GPU time charged so far is paid for.
    vt: f64,
    throttled: bool,
    /// Whether the last admission was filling a higher container's gaps.
    gap_filling: bool,
    /// Estimated GPU time of one launch, learned from measured segments.
    cost: Option<f64>,
    /// Effective limit as a fraction, after the peers' share.
    limit: f64,
    peers: PeerUsage,
    last_poll: Nanos,
    next_publish: Nanos,
    /// When the board was last written (by a launch's publish or an idle heartbeat).
    last_published: Nanos,
    /// When a launch last asked for admission (the idle heartbeat waits for a quiet spell).
    last_admit: Nanos,
    next_activity: Nanos,
    bin_start: Nanos,
    bin_busy: f64,
    util: Option<f64>,
    /// Factor applied to measured GPU time (1 = none): the device's share of our work over
    /// the events' measurement, when other processes' time slices inflate the latter.
    correction: f64,
    next_contention: Nanos,
    /// Raw (uncorrected) measured GPU time since the last contention check.
    raw_busy: f64,
    raw_start: Nanos,
    /// Smoothed raw utilization and device-reported utilization.
    raw_util: Option<f64>,
    device_util: Option<f64>,
    /// This container's turn among limited containers on the GPU, if they coordinate.
    turn: Option<Turn>,
    /// When the work queued so far is estimated to end (ns; only used with a turn).
    horizon: f64,
    /// The typical launch length for turns (the layout, what fits a window, when queued
    /// work ends): the cost, learned without single outliers ([`Limiter::learn_launch`]).
    turn_cost: Option<f64>,
    /// The last measured segment was over twice `turn_cost` (the next one decides).
    turn_jump: bool,
    /// The launch length last published for the turn layout (0: none yet).
    published_launch: u64,
    /// The share of the GPU's power budget (`None`: time only).
    power: Option<PowerShare>,
    /// Whether the view's power baseline was asked for.
    power_seeded: bool,
    /// The latest conclusion of the power share.
    power_state: Option<PowerState>,
    /// Measured GPU time since the start, uncorrected, ns (for the power share).
    own_busy: f64,
    /// Share mode's state (`None` in cap mode).
    sharing: Option<Sharing>,
    stats: LimiterStats,
}

impl<C: Clock, T: GpuTimer, V: ContainerView> fmt::Debug for Limiter<C, T, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter")
            .field("limit", &self.limit)
            .field("vt", &self.vt)
            .field("throttled", &self.throttled)
            .field("cost", &self.cost)
            .field("outstanding", &self.closed.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<C: Clock, T: GpuTimer, V: ContainerView> Limiter<C, T, V> {
    /// A limiter for one device.
    pub fn new(cfg: LimiterConfig, clock: C, timer: T, view: V) -> Self {
        let now = clock.now();
        Self {
            cfg,
            clock,
            timer,
            view,
            open: None,
            closed: VecDeque::new(),
            vt: now as f64 - cfg.burst as f64,
            throttled: false,
            gap_filling: false,
            cost: None,
            limit: 1.0,
            peers: PeerUsage::default(),
            last_poll: now,
            next_publish: now,
            last_published: now,
            last_admit: now,
            next_activity: now,
            bin_start: now,
            bin_busy: 0.0,
            util: None,
            correction: 1.0,
            next_contention: now + cfg.contention_period,
            raw_busy: 0.0,
            raw_start: now,
            raw_util: None,
            device_util: None,
            turn: None,
            horizon: 0.0,
            published_launch: 0,
            turn_cost: None,
            turn_jump: false,
            power: (cfg.power_exponent > 0.0).then(|| {
                PowerShare::new(cfg.power_exponent, cfg.power_window, cfg.power_idle_span)
            }),
            power_seeded: false,
            power_state: None,
            own_busy: 0.0,
            sharing: (cfg.mode == SmMode::Share).then(Sharing::default),
            stats: LimiterStats::default(),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> LimiterStats {
        LimiterStats {
            published_launch_ns: self.published_launch,
            fit_ns: self.turn_estimate(),
            ..self.stats
        }
    }

    /// Achieved utilization (fraction of wall time) as last published, if any.
    pub fn utilization(&self) -> Option<f64> {
        self.util
    }

    /// The factor applied to measured GPU time for contention (1 = none).
    pub fn contention_correction(&self) -> f64 {
        self.correction
    }

    /// The effective limit (fraction) used for the last admission.
    pub fn effective_limit(&self) -> f64 {
        self.limit
    }

    /// What the power share last concluded, if it has samples.
    pub fn power_state(&self) -> Option<PowerState> {
        self.power_state
    }

    /// This container's turn on the GPU, if limited containers take turns.
    pub fn turn(&self) -> Option<Turn> {
        self.turn
    }

    /// Share mode: this container's part of the GPU as last computed.
    pub fn allotment(&self) -> Option<Allotment> {
        self.sharing.as_ref().and_then(|s| s.allot)
    }

    /// Share mode: GPU time (ns) of its guarantee lent to others, and used above it.
    pub fn lent_and_borrowed(&self) -> Option<(u64, u64)> {
        let s = self.sharing.as_ref()?;
        Some((s.lent_ns as u64, s.borrowed_ns as u64))
    }

    /// The container view, e.g. for the hook to publish a final zero at exit.
    pub fn view_mut(&mut self) -> &mut V {
        &mut self.view
    }

    /// Asks whether a launch on `stream` may go now.
    ///
    /// With no limit, or policy `disable`, this reads the limit and answers `Go` without
    /// touching the timer or writing the shared view.
    pub fn admit(&mut self, stream: T::Stream) -> Admission {
        let pct = self.view.sm_limit_pct();
        let unlimited = pct == 0 || pct >= 100;
        // In share mode 0 is "no guarantee" and 100 "the whole GPU": both are enforced.
        if self.cfg.policy == Policy::Disable || (unlimited && self.sharing.is_none()) {
            return Admission::Go(Ticket::UNCOUNTED);
        }
        let now = self.clock.now();
        self.last_admit = now;
        if self.view.recent_kernel() < 0 {
            // The monitor gives the device to a higher-priority task: submit nothing, and
            // let what was submitted be measured.
            self.close_open(now);
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
        if self.throttled
            || now.saturating_sub(self.last_poll) >= self.cfg.poll_interval
            || self.closed.len() >= self.cfg.max_outstanding
        {
            self.poll(now);
        }
        self.maybe_publish(now, pct);
        self.maybe_correct(now);
        let share = self.share_step(now, pct);
        // Held by priority, filling gaps: paced only by the outranked queue below.
        let gap_fill = share.is_some_and(|a| a.gap_fill) && self.cfg.gap_fill_queue > 0;
        if gap_fill != self.gap_filling {
            self.gap_filling = gap_fill;
            self.stats.gap_fill_changes += 1;
        }
        self.limit = match share {
            Some(_) if gap_fill => self.effective(1.0),
            Some(a) => self.effective(a.fraction),
            None => {
                let scale = self.power.as_ref().map_or(1.0, PowerShare::scale);
                self.effective(f64::from(pct) / 100.0 * scale)
            }
        };
        if share.is_some_and(|a| a.fraction <= 0.0) && !gap_fill {
            // Share mode, nothing to borrow and no guarantee: hold new launches while
            // others' work runs; ask the board again when the first of them may have run
            // out of work (their `busy_until`), at the latest after a demand poll.
            self.close_open(now);
            self.poll(now);
            self.stats.held_waits += 1;
            let until = share.map_or(0, |a| a.hold_until).saturating_sub(now);
            return self.wait(until.clamp(self.cfg.poll_interval, self.cfg.demand_poll));
        }
        let floor = now as f64 - self.cfg.burst as f64;
        if self.vt < floor {
            self.vt = floor;
        }
        if self.closed.len() >= self.cfg.max_outstanding {
            self.close_open(now);
            return self.wait(self.cfg.poll_interval);
        }
        if self.cost.is_none() && (self.open.is_some() || !self.closed.is_empty()) {
            // Calibration: nothing is known about the cost of a launch yet, so measure
            // the first one alone before queueing more.
            self.close_open(now);
            return self.wait(self.cfg.poll_interval);
        }
        let now_f = now as f64;
        if let Some(a) = share {
            // Share mode promises a part of the GPU from now on, not an average over the
            // past: no debt beyond a cycle and a period (above the throttle's threshold, so
            // it still throttles; time-slicing by others inflates measurements).
            let lead = self
                .turn
                .map_or(self.cfg.period, |t| t.cycle.max(self.cfg.period));
            self.vt = self.vt.min(now_f + (lead + self.cfg.period) as f64);
            if a.fraction >= 0.999 && a.turn.is_none() {
                // The whole GPU is ours for now: keep the queue one period deep, without
                // the hysteresis (a latency-critical container must not wait for its own
                // queue to drain).
                self.throttled = false;
                if self.vt > now_f + self.cfg.period as f64 {
                    self.close_open(now);
                    return self.wait_until_vt(now_f + self.cfg.period as f64);
                }
            }
        }
        // Share mode in turns: the window is the part (it follows the guarantee and what is
        // lent), so the pacer does not hold launches inside it. Measurements that span a
        // window's edges would otherwise throttle a tenant below its guarantee.
        let paced = !(share.is_some() && self.turn.is_some());
        if !paced {
            self.throttled = false;
        } else if self.throttled {
            if self.vt <= now_f {
                self.throttled = false;
            } else {
                return self.wait_until_vt(now_f);
            }
        }
        // With turns, a window's worth of work may be queued at once.
        let lead = match self.turn {
            Some(t) => self.cfg.period.max(t.cycle),
            None => self.cfg.period,
        };
        if paced && self.vt > now_f + lead as f64 {
            self.throttled = true;
            self.stats.throttles += 1;
            self.close_open(now);
            return self.wait_until_vt(now_f);
        }
        if share.is_some_and(|a| a.outranked) {
            // A more urgent container may start any moment: keep our queue short. Counted
            // from our segments not yet complete (not from when we expect them to end: our
            // work may wait behind the urgent one's, and still be ahead of its next).
            // Filling the gaps of an urgent container's work, keep less: what we queue
            // lands in its bursts.
            let cap = if gap_fill {
                self.cfg.gap_fill_queue
            } else {
                self.cfg.outranked_queue
            } as f64;
            // The estimate only shrinks as segments settle: settle them (one event query
            // each) only when it is over the cap.
            let mut queued = self.queued_estimate();
            if queued > cap {
                self.poll(now);
                queued = self.queued_estimate();
            }
            if queued > cap {
                self.stats.queue_waits += 1;
                self.close_open(now);
                return self.wait(
                    ((queued - cap) as Nanos).clamp(self.cfg.poll_interval, self.cfg.max_wait),
                );
            }
        }
        if let Some(turn) = self.turn {
            let est = self.turn_estimate();
            let lead_in = self.cfg.turn_lead_in;
            let mut fits = turn.admits(now, self.horizon.max(now_f), est, lead_in);
            if fits.is_err() && turn.is_open(now, lead_in) {
                // In the window, but the queue seems to reach its end: the horizon only
                // grows by the fit, which can be twice the real work (H200: one of four
                // tenants fitted 423 us launches of 203 us: its window held half the work).
                // What is still queued, at the outlier-free cost, before giving it up.
                self.poll(now);
                let queued = self.queued_fit(self.turn_cost.unwrap_or(est));
                self.horizon = self.horizon.min(now_f + queued);
                fits = turn.admits(now, self.horizon.max(now_f), est, lead_in);
            }
            if let Err(ns) = fits {
                // Outside our window, or the rest of it is queued: let what is queued be
                // measured, wait for the next.
                self.stats.window_waits += 1;
                self.close_open(now);
                return self.wait(ns.min(self.cfg.max_wait));
            }
        }
        if gap_fill {
            self.stats.gap_fill_launches += 1;
        }
        self.prepare(now, stream);
        Admission::Go(Ticket { counted: true })
    }

    /// Reports the launch that [`Limiter::admit`] let go with `ticket`; `ok` is whether
    /// the driver accepted it.
    pub fn launched(&mut self, ticket: Ticket, stream: T::Stream, ok: bool) {
        if !ticket.counted || !ok {
            return;
        }
        let now = self.clock.now();
        self.stats.launches += 1;
        let est = self.cost.unwrap_or(0.0);
        self.vt += est / self.limit;
        let ahead = match self.turn {
            Some(_) => self.turn_estimate(),
            None => est,
        };
        self.horizon = self.horizon.max(now as f64) + ahead;
        let Some(open) = self.open.as_mut().filter(|o| o.stream == stream) else {
            return;
        };
        open.launches += 1;
        open.est += est;
        open.last_launch = now;
        if self.cost.is_none()
            || open.est >= self.cfg.segment_work as f64
            || open.launches >= self.cfg.segment_launches
        {
            self.close_open(now);
        }
    }

    /// What one launch is taken to cost when fitting work into a turn window: the pacer's
    /// cost, which includes what the events count of waits behind other contexts (so the
    /// window keeps room for them: fitted with the outlier-free cost, work overran into the
    /// next window on the H200 and each tenant's events then counted the other's time),
    /// but at most twice the outlier-free cost, so one inflated segment does not empty a
    /// window.
    fn turn_estimate(&self) -> f64 {
        let cost = self.cost.unwrap_or(0.0);
        match self.turn_cost {
            Some(t) => cost.min(2.0 * t),
            None => cost,
        }
    }

    fn wait(&mut self, ns: Nanos) -> Admission {
        self.stats.waits += 1;
        Admission::Wait(ns.max(1))
    }

    fn wait_until_vt(&mut self, now: f64) -> Admission {
        let ns = (self.vt - now).ceil().max(1.0) as Nanos;
        self.wait(ns.min(self.cfg.max_wait))
    }

    /// The process's part of the container's `base` (fraction), after its peers' share.
    fn effective(&self, base: f64) -> f64 {
        // Never 0: the pacer divides by it.
        let base = base.max(1e-3);
        if !self.cfg.share_with_peers || self.peers.active == 0 {
            return base;
        }
        let others = f64::from(self.peers.util_pct) / 100.0;
        let fair = base / f64::from(self.peers.active + 1);
        (base - others).max(fair).max(0.005)
    }

    /// The peers' shares that are recent enough to count: a share published more than
    /// `peer_stale_after` ago belongs to a process that stopped launching, and budgeting
    /// against it would hold this process below the container's limit for nothing.
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

    /// Share mode: reads the board's demand (at most every `demand_poll`) and returns this
    /// container's part; `None` in cap mode. Sets the turn.
    fn share_step(&mut self, now: Nanos, pct: u32) -> Option<Allotment> {
        // Cap mode first: the claim reads the file's priority, which only share mode needs.
        self.sharing.as_ref()?;
        let claim = self.claim(pct);
        let launch_ns = self.cost.unwrap_or(0.0).max(0.0) as u64;
        let timing = ShareTiming {
            demand_poll: self.cfg.demand_poll,
            idle_grace: self.cfg.idle_grace,
            idle_grace_in_turns: self.cfg.idle_grace_in_turns,
            min_cycle: self.cfg.turn_cycle,
            rules: self.cfg.share_rules,
        };
        let horizon = self.horizon;
        let a = self
            .sharing
            .as_mut()?
            .step(&mut self.view, now, claim, launch_ns, horizon, timing);
        self.set_turn(a.turn);
        Some(a)
    }

    fn claim(&self, pct: u32) -> ShareClaim {
        ShareClaim {
            share_pct: if pct >= 100 { 100 } else { pct },
            ceiling_pct: self.cfg.ceiling_pct,
            priority: self.view.task_priority().unwrap_or(self.cfg.priority),
        }
        .sanitized()
    }

    fn set_turn(&mut self, turn: Option<Turn>) {
        if turn != self.turn {
            self.stats.turn_changes += 1;
            if turn.map(|t| t.cycle) != self.turn.map(|t| t.cycle) {
                self.stats.cycle_changes += 1;
            }
            self.turn = turn;
        }
    }

    /// Feeds the power share a sample of the device's power (once per publish period).
    fn sample_power(&mut self, now: Nanos) {
        let Some(power) = self.power.as_mut() else {
            return;
        };
        if !self.power_seeded {
            self.power_seeded = true;
            if let Some(base) = self.view.power_baseline() {
                power.seed(base);
            }
        }
        let Some(sample) = self.view.power_sample(now) else {
            return;
        };
        // The container's other processes' share, as they published it (fresh only).
        let peers = if self.cfg.share_with_peers {
            f64::from(self.peers.util_pct.min(100)) / 100.0
        } else {
            0.0
        };
        if let Some(state) = power.update(sample, self.own_busy, peers) {
            self.power_state = Some(state);
            self.view.note_power(&state);
        }
    }

    /// Compares the events' measurements with the device's own accounting of our work.
    ///
    /// Events measure wall time on the GPU: while our queued work waits behind another
    /// process's time slice, that wait is measured as ours. The device's per-process
    /// utilization does not count it. When other processes are active and the device
    /// sees clearly less of our work than the events do, measurements are scaled down by
    /// the ratio (smoothed, floored); otherwise the factor returns to 1. Alone on the
    /// device, nothing changes.
    fn maybe_correct(&mut self, now: Nanos) {
        if self.cfg.contention_period == 0 || now < self.next_contention {
            return;
        }
        self.next_contention = now + self.cfg.contention_period;
        let elapsed = now.saturating_sub(self.raw_start);
        let raw = if elapsed > 0 {
            (self.raw_busy / elapsed as f64).min(1.0)
        } else {
            0.0
        };
        self.raw_busy = 0.0;
        self.raw_start = now;
        let smooth = |old: Option<f64>, new: f64| old.map_or(new, |o| 0.5 * o + 0.5 * new);
        let target = match self.view.device_sample() {
            Some(s) if s.others_active => {
                let raw_u = smooth(self.raw_util, raw);
                let dev_u = smooth(self.device_util, s.own.clamp(0.0, 1.0));
                self.raw_util = Some(raw_u);
                self.device_util = Some(dev_u);
                let ratio = if raw_u > 0.02 { dev_u / raw_u } else { 1.0 };
                if ratio < self.cfg.contention_threshold {
                    ratio.max(self.cfg.contention_floor)
                } else {
                    1.0
                }
            }
            _ => {
                self.raw_util = None;
                self.device_util = None;
                1.0
            }
        };
        self.correction = 0.5 * self.correction + 0.5 * target;
        if (self.correction - 1.0).abs() < 0.01 {
            self.correction = 1.0;
        }
    }
}
