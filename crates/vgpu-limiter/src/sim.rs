//! Deterministic simulation for the tests: a clock, a GPU with streams and markers,
//! a shared table, and a discrete-event loop that drives applications.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;

use crate::{
    Admission, Clock, ContainerView, DeviceSample, GpuTimer, Limiter, LimiterConfig, Nanos,
    PeerShare, PowerSample, ShareReport, ShareTenant, TimerError, TurnTenant,
};

pub const US: Nanos = 1_000;
pub const MS: Nanos = 1_000_000;
pub const S: Nanos = 1_000_000_000;

#[derive(Clone, Default)]
pub struct SimClock(Rc<Cell<Nanos>>);

impl SimClock {
    pub fn set(&self, t: Nanos) {
        assert!(t >= self.0.get(), "time runs forward");
        self.0.set(t);
    }
}

impl Clock for SimClock {
    fn now(&self) -> Nanos {
        self.0.get()
    }
}

/// How streams share the simulated device.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GpuMode {
    /// Every stream has its own engine (what vgpu-sim does; MPS-like).
    Concurrent,
    /// One engine runs all streams' work in submission order.
    Serial,
    /// One engine; work arriving from one process runs at once, and every other process's
    /// queued work is pushed back by its length (a time slice handed to the newcomer), as
    /// two contexts time-slicing the H200 behaved: the short bursts of one tenant ran at
    /// once, while the other's queued work waited (and its events counted the wait).
    Preempting,
}

/// A GPU whose power controller lowers the clock while its recent power would exceed
/// the limit, as the H200 does for tensor-core work (docs/sm-limit.md).
#[derive(Clone, Copy, Debug)]
pub struct PowerModel {
    /// Power with nothing running, watts.
    pub idle_w: f64,
    /// Power above idle per busy second at full clock, watts.
    pub busy_w: f64,
    /// The enforced power limit, watts.
    pub limit_w: f64,
    /// Power above idle grows as clock^alpha.
    pub alpha: f64,
    /// Throughput grows as clock^beta (kernels take `nominal / clock^beta`).
    pub beta: f64,
}

/// Controller step and the span of power it averages.
const POWER_TICK: Nanos = 10 * MS;
const POWER_TICKS_AVERAGED: usize = 10;
/// The energy counter advances in steps of this (as on the H200).
const ENERGY_STEP: Nanos = 100 * MS;

struct PowerState {
    model: PowerModel,
    /// Clock as a fraction of the full clock.
    clock: f64,
    energy_j: f64,
    /// Energy at the last counter step.
    reported_j: f64,
    tick: Nanos,
    recent_busy: VecDeque<f64>,
}

#[derive(Default)]
struct GpuState {
    serial: bool,
    preempting: bool,
    /// Stream of each marker (pushed back with its stream's work).
    marker_stream: Vec<u32>,
    busy_until: Vec<Nanos>,
    device_busy_until: Nanos,
    markers: Vec<Option<Nanos>>,
    free: Vec<usize>,
    /// (owner, start, end) of every kernel.
    kernels: Vec<(usize, Nanos, Nanos)>,
    timer_ops: u64,
    fail_records: bool,
    power: Option<PowerState>,
}

impl GpuState {
    /// Device busy fraction (any owner) over `[t0, t1)`; kernels overlap only in the
    /// concurrent mode, where the fraction is capped at 1.
    fn device_busy(&self, t0: Nanos, t1: Nanos) -> f64 {
        let mut busy = 0;
        for k in self.kernels.iter().rev() {
            if k.2 + 200 * MS < t0 {
                break;
            }
            busy += k.2.min(t1).saturating_sub(k.1.max(t0));
        }
        (busy as f64 / (t1 - t0) as f64).min(1.0)
    }

    /// Runs the power controller up to `now`, one tick at a time.
    fn advance_power(&mut self, now: Nanos) {
        let Some(mut p) = self.power.take() else {
            return;
        };
        while p.tick + POWER_TICK <= now {
            let busy = self.device_busy(p.tick, p.tick + POWER_TICK);
            let m = p.model;
            let watts = m.idle_w + busy * m.busy_w * p.clock.powf(m.alpha);
            p.energy_j += watts * POWER_TICK as f64 / 1e9;
            p.tick += POWER_TICK;
            if p.tick % ENERGY_STEP == 0 {
                p.reported_j = p.energy_j;
            }
            p.recent_busy.push_back(busy);
            if p.recent_busy.len() > POWER_TICKS_AVERAGED {
                p.recent_busy.pop_front();
            }
            let avg = p.recent_busy.iter().sum::<f64>() / p.recent_busy.len() as f64;
            let demand = avg * m.busy_w;
            p.clock = if demand > m.limit_w - m.idle_w {
                ((m.limit_w - m.idle_w) / demand)
                    .powf(1.0 / m.alpha)
                    .max(0.3)
            } else {
                1.0
            };
        }
        self.power = Some(p);
    }

    /// [`GpuMode::Preempting`]: the kernel starts behind its own stream only; whatever
    /// other streams have not run by then moves back by `dur`.
    fn enqueue_preempting(&mut self, stream: u32, now: Nanos, dur: Nanos, owner: usize) -> Nanos {
        let start = now.max(*self.tail(stream));
        let end = start + dur;
        *self.tail(stream) = end;
        for (s, tail) in self.busy_until.iter_mut().enumerate() {
            if s != stream as usize && *tail > start {
                *tail += dur;
            }
        }
        for (m, t) in self.markers.iter_mut().enumerate() {
            if let Some(t) = t {
                if *t > start && self.marker_stream.get(m).is_some_and(|&s| s != stream) {
                    *t += dur;
                }
            }
        }
        // Pending kernels are among the last ones queued (queues are milliseconds deep).
        let mut split = Vec::new();
        for k in self.kernels.iter_mut().rev() {
            if k.2 + 100 * MS < start {
                break;
            }
            if k.0 == owner || k.2 <= start {
                continue;
            }
            if k.1 >= start {
                k.1 += dur;
                k.2 += dur;
            } else {
                split.push((k.0, start + dur, k.2 + dur));
                k.2 = start;
            }
        }
        self.kernels.extend(split);
        self.kernels.push((owner, start, end));
        end
    }

    fn tail(&mut self, stream: u32) -> &mut Nanos {
        let s = stream as usize;
        if self.busy_until.len() <= s {
            self.busy_until.resize(s + 1, 0);
        }
        &mut self.busy_until[s]
    }
}

#[derive(Clone)]
pub struct SimGpu(Rc<RefCell<GpuState>>);

impl SimGpu {
    pub fn new(mode: GpuMode) -> Self {
        Self(Rc::new(RefCell::new(GpuState {
            serial: mode == GpuMode::Serial,
            preempting: mode == GpuMode::Preempting,
            ..GpuState::default()
        })))
    }

    /// A GPU with a power controller.
    pub fn with_power(mode: GpuMode, model: PowerModel) -> Self {
        let gpu = Self::new(mode);
        gpu.0.borrow_mut().power = Some(PowerState {
            model,
            clock: 1.0,
            energy_j: 0.0,
            reported_j: 0.0,
            tick: 0,
            recent_busy: VecDeque::new(),
        });
        gpu
    }

    /// What NVML would report at `now`: the energy counter (mJ, in 100 ms steps), the
    /// limit and the device's busy fraction over the last 100 ms. `None` without a model.
    pub fn power_sample(&self, now: Nanos) -> Option<PowerSample> {
        let mut g = self.0.borrow_mut();
        g.advance_power(now);
        let p = g.power.as_ref()?;
        let (energy_mj, limit_mw) = (
            (p.reported_j * 1000.0) as u64,
            (p.model.limit_w * 1000.0) as u64,
        );
        let device_busy = (now >= 100 * MS).then(|| g.device_busy(now - 100 * MS, now));
        Some(PowerSample {
            at: now,
            energy_mj,
            limit_mw,
            device_busy,
            idle_mw: None,
        })
    }

    /// Queues a kernel of `dur` on `stream` at time `now`; returns its end.
    pub fn enqueue(&self, stream: u32, now: Nanos, dur: Nanos, owner: usize) -> Nanos {
        let mut g = self.0.borrow_mut();
        g.advance_power(now);
        // A lowered clock stretches the kernel.
        let dur = match &g.power {
            Some(p) if p.clock < 1.0 => (dur as f64 / p.clock.powf(p.model.beta)) as Nanos,
            _ => dur,
        };
        if g.preempting {
            return g.enqueue_preempting(stream, now, dur, owner);
        }
        let serial = g.serial;
        let dev = g.device_busy_until;
        let tail = g.tail(stream);
        let mut start = now.max(*tail);
        if serial {
            start = start.max(dev);
        }
        let end = start + dur;
        *tail = end;
        if serial {
            g.device_busy_until = end;
        }
        g.kernels.push((owner, start, end));
        end
    }

    /// When `stream` runs dry.
    pub fn stream_idle_at(&self, stream: u32) -> Nanos {
        *self.0.borrow_mut().tail(stream)
    }

    /// Fraction of `[t0, t1)` during which `owner`'s kernels ran.
    pub fn busy_fraction(&self, owner: usize, t0: Nanos, t1: Nanos) -> f64 {
        let g = self.0.borrow();
        let busy: Nanos = g
            .kernels
            .iter()
            .filter(|k| k.0 == owner)
            .map(|&(_, s, e)| e.min(t1).saturating_sub(s.max(t0)))
            .sum();
        busy as f64 / (t1 - t0) as f64
    }

    /// Kernels of `owner` that started in `[t0, t1)`.
    pub fn kernels_started(&self, owner: usize, t0: Nanos, t1: Nanos) -> usize {
        let g = self.0.borrow();
        g.kernels
            .iter()
            .filter(|k| k.0 == owner && k.1 >= t0 && k.1 < t1)
            .count()
    }

    pub fn timer_ops(&self) -> u64 {
        self.0.borrow().timer_ops
    }

    pub fn live_markers(&self) -> usize {
        let g = self.0.borrow();
        g.markers.len() - g.free.len()
    }

    pub fn set_fail_records(&self, fail: bool) {
        self.0.borrow_mut().fail_records = fail;
    }
}

/// How long after its record a marker on an idle stream completes.
pub const MARKER_LATENCY: Nanos = 5 * US;

pub struct SimTimer {
    pub gpu: SimGpu,
    pub clock: SimClock,
}

impl GpuTimer for SimTimer {
    type Stream = u32;
    type Marker = usize;

    fn record(&mut self, stream: u32) -> Result<usize, TimerError> {
        let now = self.clock.now();
        let mut g = self.gpu.0.borrow_mut();
        g.timer_ops += 1;
        if g.fail_records {
            return Err(TimerError { code: 999 });
        }
        let serial = g.serial;
        let dev = g.device_busy_until;
        // A marker recorded on an idle stream is not complete at once (on the H200 the limiter
        // took the span of a 3 s pause for GPU time, so its query right after the record did
        // not answer "complete"; 2026-12-01): asking then cannot tell an idle GPU from a busy
        // one.
        let mut done = (now + MARKER_LATENCY).max(*g.tail(stream));
        if serial {
            done = done.max(dev);
        }
        let id = match g.free.pop() {
            Some(id) => id,
            None => {
                g.markers.push(None);
                g.markers.len() - 1
            }
        };
        g.markers[id] = Some(done);
        // Stream order: work queued after the marker starts once it is reached.
        *g.tail(stream) = done;
        if g.marker_stream.len() <= id {
            g.marker_stream.resize(id + 1, 0);
        }
        g.marker_stream[id] = stream;
        Ok(id)
    }

    fn is_complete(&mut self, marker: usize) -> Result<bool, TimerError> {
        let now = self.clock.now();
        let mut g = self.gpu.0.borrow_mut();
        g.timer_ops += 1;
        let done = g.markers[marker].expect("query of a released marker");
        Ok(done <= now)
    }

    fn elapsed(&mut self, start: usize, end: usize) -> Result<Nanos, TimerError> {
        let now = self.clock.now();
        let mut g = self.gpu.0.borrow_mut();
        g.timer_ops += 1;
        let s = g.markers[start].expect("elapsed of a released marker");
        let e = g.markers[end].expect("elapsed of a released marker");
        assert!(s <= now && e <= now, "elapsed of an incomplete marker");
        Ok(e.saturating_sub(s))
    }

    fn release(&mut self, marker: usize) {
        let mut g = self.gpu.0.borrow_mut();
        assert!(g.markers[marker].take().is_some(), "double release");
        g.free.push(marker);
    }
}

/// One shared file: a device's limit, the monitor's fields and the process slots.
#[derive(Default)]
pub struct TableState {
    pub sm_limit: u32,
    pub recent_kernel: i32,
    pub utilization_switch: i32,
    pub slots: Vec<u32>,
    /// When each slot last published (`None`: a publisher that leaves no time).
    pub published_at: Vec<Option<Nanos>>,
    /// Slots whose process publishes without a time (an older library).
    pub untimed: Vec<bool>,
    pub writes: u64,
    pub activity: u64,
    /// `CUDA_TASK_PRIORITY` as the file holds it (a live change), if set.
    pub priority: Option<i32>,
}

#[derive(Clone)]
pub struct SimTable(pub Rc<RefCell<TableState>>);

impl SimTable {
    pub fn new(limit: u32) -> Self {
        Self(Rc::new(RefCell::new(TableState {
            sm_limit: limit,
            utilization_switch: 1,
            ..TableState::default()
        })))
    }

    /// A process's view, with its own slot.
    pub fn view(&self) -> SimView {
        let mut t = self.0.borrow_mut();
        t.slots.push(0);
        t.published_at.push(None);
        t.untimed.push(false);
        SimView {
            table: self.clone(),
            slot: t.slots.len() - 1,
            device: None,
            node: None,
            power: None,
            shares: None,
        }
    }

    /// A process's view whose container keeps a share-mode record as `key` on `board`.
    pub fn view_sharing(&self, board: &SimShares, key: u64) -> SimView {
        let mut v = self.view();
        v.shares = Some((board.clone(), key));
        v
    }

    /// A process's view that reads the world GPU's power (its baseline: now).
    pub fn view_with_power(&self, world: &World) -> SimView {
        self.view().powered(world)
    }

    /// A process's view whose container announces itself as `key` on `node`.
    pub fn view_on_node(&self, node: &SimNode, key: u64) -> SimView {
        let mut v = self.view();
        v.node = Some((node.clone(), key));
        v
    }

    /// A view whose device accounting ("NVML") reports `scale` × the process's true busy
    /// share, with other processes active or not.
    pub fn view_with_device(&self, world: &World, scale: f64, others_active: bool) -> SimView {
        let mut v = self.view();
        v.device = Some(DeviceAccounting {
            gpu: world.gpu.clone(),
            clock: world.clock.clone(),
            owner: world.apps.len(),
            scale,
            others_active,
            last: world.clock.now(),
        });
        v
    }
}

/// A simulated NVML per-process utilization source.
pub struct DeviceAccounting {
    gpu: SimGpu,
    clock: SimClock,
    owner: usize,
    scale: f64,
    others_active: bool,
    last: Nanos,
}

pub struct SimView {
    table: SimTable,
    slot: usize,
    device: Option<DeviceAccounting>,
    /// The node's turn board and this container's key on it.
    node: Option<(SimNode, u64)>,
    /// The GPU whose power this view reads, and the sample taken when it was attached.
    power: Option<(SimGpu, Option<PowerSample>)>,
    /// The node's share-mode records and this container's key there.
    shares: Option<(SimShares, u64)>,
}

/// A node-wide board of share-mode records (what vgpu-shm's share region holds), with the
/// last report of each container for the tests to read.
#[derive(Clone, Default)]
pub struct SimShares(pub Rc<RefCell<Vec<SimShareEntry>>>);

/// A record on the simulated board with its writer's last report.
pub type SimShareEntry = (ShareTenant, Option<ShareReport>);

impl SimShares {
    /// Puts a record on the board as another container (or a hostile one) would.
    pub fn put(&self, t: ShareTenant) {
        let mut b = self.0.borrow_mut();
        match b.iter_mut().find(|e| e.0.key == t.key) {
            Some(e) => e.0 = t,
            None => b.push((t, None)),
        }
    }

    /// The last report of `key`.
    pub fn report(&self, key: u64) -> Option<ShareReport> {
        self.0.borrow().iter().find(|e| e.0.key == key)?.1
    }
}

impl SimView {
    /// This view, reading the world GPU's power (its baseline: now).
    pub fn powered(mut self, world: &World) -> SimView {
        let base = world.gpu.power_sample(world.clock.now());
        self.power = Some((world.gpu.clone(), base));
        self
    }
}

/// A node-wide turn board: (key, limit %, last announcement) per container.
#[derive(Clone, Default)]
pub struct SimNode(pub Rc<RefCell<Vec<(TurnTenant, Nanos)>>>);

impl ContainerView for SimView {
    fn sm_limit_pct(&self) -> u32 {
        self.table.0.borrow().sm_limit
    }
    fn recent_kernel(&self) -> i32 {
        self.table.0.borrow().recent_kernel
    }
    fn utilization_switch(&self) -> i32 {
        self.table.0.borrow().utilization_switch
    }
    fn peers(&self) -> Vec<PeerShare> {
        let t = self.table.0.borrow();
        (0..t.slots.len())
            .filter(|&i| i != self.slot)
            .map(|i| PeerShare {
                util_pct: t.slots[i],
                published_at: t.published_at[i],
            })
            .collect()
    }
    fn publish_util(&mut self, util_pct: u32, now: Nanos) {
        let mut t = self.table.0.borrow_mut();
        t.writes += 1;
        t.slots[self.slot] = util_pct;
        if !t.untimed[self.slot] {
            t.published_at[self.slot] = Some(now);
        }
    }
    fn device_sample(&mut self) -> Option<DeviceSample> {
        let d = self.device.as_mut()?;
        let now = d.clock.now();
        if now <= d.last {
            return None;
        }
        let own = d.gpu.busy_fraction(d.owner, d.last, now) * d.scale;
        d.last = now;
        Some(DeviceSample {
            own,
            others_active: d.others_active,
        })
    }

    fn turn_tenants(&mut self, now: Nanos, launch_ns: u64) -> Option<(u64, Vec<TurnTenant>)> {
        let (node, key) = self.node.as_ref()?;
        let pct = self.table.0.borrow().sm_limit;
        let mut board = node.0.borrow_mut();
        let me = TurnTenant {
            key: *key,
            part_bp: pct * 100,
            launch_ns,
        };
        match board.iter_mut().find(|e| e.0.key == *key) {
            Some(e) => *e = (me, now),
            None => board.push((me, now)),
        }
        let live = board
            .iter()
            .filter(|e| now.saturating_sub(e.1) <= 300 * MS)
            .map(|e| e.0)
            .collect();
        Some((*key, live))
    }

    fn power_sample(&mut self, now: Nanos) -> Option<PowerSample> {
        let (gpu, _) = self.power.as_ref()?;
        gpu.power_sample(now)
    }

    fn power_baseline(&mut self) -> Option<PowerSample> {
        self.power.as_mut()?.1.take()
    }

    fn share_board(&mut self, now: Nanos, report: &ShareReport) -> Option<(u64, Vec<ShareTenant>)> {
        let (board, key) = self.shares.as_ref()?;
        let me = ShareTenant {
            key: *key,
            claim: report.claim,
            launch_ns: report.launch_ns,
            busy_until: report.busy_until,
            heartbeat: now,
            util_pct: report.util_pct,
        };
        board.put(me);
        let mut b = board.0.borrow_mut();
        if let Some(e) = b.iter_mut().find(|e| e.0.key == *key) {
            e.1 = Some(*report);
        }
        Some((*key, b.iter().map(|e| e.0).collect()))
    }

    fn share_demand(&mut self, _now: Nanos, busy_until: Option<Nanos>) -> Option<Vec<ShareTenant>> {
        let (board, key) = self.shares.as_ref()?;
        let mut b = board.0.borrow_mut();
        if let (Some(until), Some(e)) = (busy_until, b.iter_mut().find(|e| e.0.key == *key)) {
            e.0.busy_until = until;
        }
        Some(b.iter().map(|e| e.0).collect())
    }

    fn task_priority(&self) -> Option<i32> {
        self.table.0.borrow().priority
    }

    fn note_activity(&mut self, _now: Nanos) {
        let mut t = self.table.0.borrow_mut();
        t.writes += 1;
        t.activity += 1;
        if t.recent_kernel >= 0 {
            t.recent_kernel = 2;
        }
    }
}

/// What an application does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Launch a kernel of this GPU duration.
    Launch(Nanos),
    /// Wait until its stream is idle (`cuStreamSynchronize`).
    Sync,
    /// Host work of this length.
    Pause(Nanos),
}

pub type Workload = Box<dyn FnMut(Nanos) -> Step>;

pub struct App {
    pub id: usize,
    pub stream: u32,
    pub limiter: Limiter<SimClock, SimTimer, SimView>,
    pub work: Workload,
    pending: Option<Step>,
    next: Nanos,
    /// Host cost of one launch.
    pub launch_cost: Nanos,
    rng: u64,
    /// Largest extra delay added to every wait (timer slack of a real sleep).
    pub max_oversleep: Nanos,
    /// Cycles of `Sync` completed (throughput of bursty workloads).
    pub syncs: u64,
    /// Every n-th launch is refused by the driver (nothing runs), if set.
    pub fail_every: Option<u64>,
    launches: u64,
}

pub struct World {
    pub clock: SimClock,
    pub gpu: SimGpu,
    pub apps: Vec<App>,
}

impl World {
    pub fn new(mode: GpuMode) -> Self {
        Self::on(SimGpu::new(mode))
    }

    /// A world whose GPU has a power controller modelled by `model`.
    pub fn with_power(mode: GpuMode, model: PowerModel) -> Self {
        Self::on(SimGpu::with_power(mode, model))
    }

    fn on(gpu: SimGpu) -> Self {
        Self {
            clock: SimClock::default(),
            gpu,
            apps: Vec::new(),
        }
    }

    /// A timer on this world's GPU and clock.
    pub fn timer(&self) -> SimTimer {
        SimTimer {
            gpu: self.gpu.clone(),
            clock: self.clock.clone(),
        }
    }

    /// Adds an application on its own stream; returns its id.
    pub fn add(&mut self, cfg: LimiterConfig, view: SimView, work: Workload) -> usize {
        let id = self.apps.len();
        let limiter = Limiter::new(cfg, self.clock.clone(), self.timer(), view);
        self.apps.push(App {
            id,
            stream: id as u32 + 1,
            limiter,
            work,
            pending: None,
            next: self.clock.now(),
            launch_cost: 3 * US,
            rng: 0x9E37_79B9_7F4A_7C15 ^ (id as u64 + 1),
            max_oversleep: 80 * US,
            syncs: 0,
            fail_every: None,
            launches: 0,
        });
        id
    }

    /// Runs every application until `until`.
    pub fn run_until(&mut self, until: Nanos) {
        loop {
            let Some(i) = (0..self.apps.len()).min_by_key(|&i| (self.apps[i].next, i)) else {
                return;
            };
            let t = self.apps[i].next;
            if t >= until {
                self.clock.set(until);
                return;
            }
            self.clock.set(t);
            let gpu = self.gpu.clone();
            let app = &mut self.apps[i];
            let step = match app.pending.take() {
                Some(s) => s,
                None => (app.work)(t),
            };
            match step {
                Step::Pause(p) => app.next = t + p.max(1),
                Step::Sync => {
                    app.syncs += 1;
                    app.next = gpu.stream_idle_at(app.stream).max(t) + US;
                }
                Step::Launch(d) => match app.limiter.admit(app.stream) {
                    Admission::Go(ticket) => {
                        app.launches += 1;
                        let fail = app.fail_every.is_some_and(|n| app.launches % n == 0);
                        if !fail {
                            gpu.enqueue(app.stream, t, d, app.id);
                        }
                        app.limiter.launched(ticket, app.stream, !fail);
                        app.next = t + app.launch_cost;
                    }
                    Admission::Wait(w) => {
                        app.pending = Some(step);
                        // xorshift: deterministic timer slack.
                        app.rng ^= app.rng << 13;
                        app.rng ^= app.rng >> 7;
                        app.rng ^= app.rng << 17;
                        let slack = if app.max_oversleep > 0 {
                            app.rng % app.max_oversleep
                        } else {
                            0
                        };
                        app.next = t + w + slack;
                    }
                },
            }
        }
    }
}

/// A loop of kernels of one duration.
pub fn kernel_loop(dur: Nanos) -> Workload {
    Box::new(move |_| Step::Launch(dur))
}

/// `kernels` launches of `dur`, a sync, then `pause` of host work, forever.
pub fn bursty(dur: Nanos, kernels: u32, pause: Nanos) -> Workload {
    let mut i = 0u32;
    Box::new(move |_| {
        i += 1;
        match i {
            n if n <= kernels => Step::Launch(dur),
            n if n == kernels + 1 => Step::Sync,
            _ => {
                i = 0;
                Step::Pause(pause)
            }
        }
    })
}
