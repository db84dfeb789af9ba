//! The limiter: measured segments plus a virtual-time pacer.
//!
//! This file holds the admission (the pacer, turns, share mode's part); `segments.rs` the
//! measurement (the GPU timer's markers around launches, settled into measured GPU time).

use std::collections::VecDeque;
use std::fmt;

pub use crate::config::LimiterConfig;
use crate::policy::Policy;
use crate::power::{PowerShare, PowerState};
use crate::share::{Allotment, ShareClaim, ShareReport, ShareTiming, Sharing, SmMode};
use crate::traits::{Clock, ContainerView, GpuTimer, Nanos, PeerUsage, Turn};

mod segments;

/// How far (a fraction) the learned launch cost moves before it is published again.
const LAUNCH_REPUBLISH: f64 = 0.25;

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

    fn maybe_publish(&mut self, now: Nanos, pct: u32) {
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

    fn set_turn(&mut self, turn: Option<Turn>) {
        if turn != self.turn {
            self.stats.turn_changes += 1;
            if turn.map(|t| t.cycle) != self.turn.map(|t| t.cycle) {
                self.stats.cycle_changes += 1;
            }
            self.turn = turn;
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
