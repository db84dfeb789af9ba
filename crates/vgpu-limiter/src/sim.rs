//! The model tests' world: a clock, a time-sliced GPU ([`crate::sim_sliced`]), containers'
//! usage files and the node's board, and a discrete-event loop that drives applications
//! (training loops, services, kernel loops) through their limiters.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

pub use crate::sim_sliced::SimClock;
use crate::sim_sliced::{CtxId, SliceParams, SlicedGpu, SlicedTimer};
use crate::{
    Admission, BoardRecord, BoardReport, Clock, ContainerView, LaunchId, Limiter, LimiterConfig,
    Nanos, NodeBoard, PeerShare, Policy, ShareClaim, SmMode,
};

pub const US: Nanos = 1_000;
pub const MS: Nanos = 1_000_000;
pub const S: Nanos = 1_000_000_000;

/// One container's usage file: its limit, the monitor's fields and its processes' slots.
#[derive(Default)]
pub struct FileState {
    pub sm_limit: u32,
    pub recent_kernel: i32,
    pub utilization_switch: i32,
    pub slots: Vec<(u32, Option<Nanos>)>,
    pub activity: u64,
    pub priority: Option<i32>,
}

#[derive(Clone)]
pub struct SimFile(pub Rc<RefCell<FileState>>);

impl SimFile {
    pub fn new(limit: u32) -> Self {
        Self(Rc::new(RefCell::new(FileState {
            sm_limit: limit,
            utilization_switch: 1,
            ..FileState::default()
        })))
    }

    pub fn set_limit(&self, pct: u32) {
        self.0.borrow_mut().sm_limit = pct;
    }

    pub fn set_priority(&self, p: i32) {
        self.0.borrow_mut().priority = Some(p);
    }

    fn view(&self) -> SimView {
        let mut f = self.0.borrow_mut();
        f.slots.push((0, None));
        SimView {
            file: self.clone(),
            slot: f.slots.len() - 1,
        }
    }
}

pub struct SimView {
    file: SimFile,
    slot: usize,
}

impl ContainerView for SimView {
    fn sm_limit_pct(&self) -> u32 {
        self.file.0.borrow().sm_limit
    }
    fn recent_kernel(&self) -> i32 {
        self.file.0.borrow().recent_kernel
    }
    fn utilization_switch(&self) -> i32 {
        self.file.0.borrow().utilization_switch
    }
    fn peers(&self) -> Vec<PeerShare> {
        let f = self.file.0.borrow();
        (f.slots.iter().enumerate())
            .filter(|(i, _)| *i != self.slot)
            .map(|(_, &(util_pct, published_at))| PeerShare {
                util_pct,
                published_at,
            })
            .collect()
    }
    fn publish_util(&mut self, util_pct: u32, now: Nanos) {
        self.file.0.borrow_mut().slots[self.slot] = (util_pct, Some(now));
    }
    fn note_activity(&mut self, _now: Nanos) {
        let mut f = self.file.0.borrow_mut();
        f.activity += 1;
        if f.recent_kernel >= 0 {
            f.recent_kernel = 2;
        }
    }
    fn task_priority(&self) -> Option<i32> {
        self.file.0.borrow().priority
    }
}

/// The node's board of the GPU: every container's record (and hostile ones a test writes),
/// and how often the containers' launch paths touched it.
#[derive(Clone, Default)]
pub struct SimBoard(
    pub Rc<RefCell<Vec<BoardRecord>>>,
    pub Rc<Cell<BoardTraffic>>,
);

/// Reads and writes of the board from the launch path ([`NodeBoard::demand`]); a real
/// board's are system calls (docs/sm-limit.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BoardTraffic {
    pub reads: u64,
    pub writes: u64,
}

impl SimBoard {
    /// Puts a record on the board as another container (or a hostile one) would.
    pub fn put(&self, r: BoardRecord) {
        let mut b = self.0.borrow_mut();
        match b.iter_mut().find(|e| e.key == r.key && r.key != 0) {
            Some(e) => *e = r,
            None => b.push(r),
        }
    }
}

/// A container's handle on the board.
pub struct SimBoardView {
    board: SimBoard,
    key: u64,
}

impl NodeBoard for SimBoardView {
    fn publish(&mut self, now: Nanos, report: &BoardReport) -> Option<(u64, Vec<BoardRecord>)> {
        self.board.put(BoardRecord {
            key: self.key,
            claim: report.claim,
            busy_until: report.busy_until,
            heartbeat: now,
            util_pct: report.util_pct,
        });
        Some((self.key, self.board.0.borrow().clone()))
    }
    fn demand(&mut self, _now: Nanos, busy_until: Option<Nanos>) -> Option<Vec<BoardRecord>> {
        let mut t = self.board.1.get();
        t.reads += 1;
        t.writes += u64::from(busy_until.is_some());
        self.board.1.set(t);
        let mut b = self.board.0.borrow_mut();
        if let (Some(until), Some(e)) = (busy_until, b.iter_mut().find(|e| e.key == self.key)) {
            e.busy_until = until;
        }
        Some(b.clone())
    }
    fn leave(&mut self) {
        self.board.0.borrow_mut().retain(|e| e.key != self.key);
    }
}

/// What an application does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Launch a kernel of this GPU duration and identity.
    Launch(Nanos, LaunchId),
    /// Wait until its stream is idle (`loss.item()`, `cuStreamSynchronize`).
    Sync,
    /// Host work of this length.
    Pause(Nanos),
    /// A unit of work (a step, a request) is done.
    Done,
}

pub type Workload = Box<dyn FnMut(Nanos) -> Step>;

/// Launches a stream holds pending before the next launch call blocks.
pub const LAUNCH_QUEUE: usize = 1024;

pub type SimLimiter = Limiter<SimClock, SlicedTimer, SimView, SimBoardView>;

pub struct App {
    pub ctx: CtxId,
    pub stream: u32,
    pub limiter: SimLimiter,
    work: Workload,
    pending: Option<Step>,
    /// A launch call under way: it returns (and the limiter hears of it) once the GPU can
    /// see the kernel.
    returning: Option<crate::Ticket>,
    next: Nanos,
    syncing: bool,
    /// Host cost of one launch call.
    pub launch_cost: Nanos,
    rng: u64,
    /// Largest extra delay added to every wait (timer slack of a real sleep).
    pub max_oversleep: Nanos,
    /// When each unit of work was done.
    pub done: Vec<Nanos>,
    pub launches: u64,
}

impl App {
    /// Units of work done in `[t0, t1)`.
    pub fn done_in(&self, t0: Nanos, t1: Nanos) -> usize {
        self.done.iter().filter(|&&t| t >= t0 && t < t1).count()
    }
}

/// How a container is limited.
#[derive(Clone, Copy, Debug)]
pub struct Tenant {
    pub mode: SmMode,
    pub limit: u32,
    pub ceiling: u32,
    pub priority: i32,
    /// No hook at all (plain time slicing).
    pub bare: bool,
}

impl Tenant {
    pub fn cap(limit: u32) -> Self {
        Self {
            mode: SmMode::Cap,
            limit,
            ceiling: 100,
            priority: 1,
            bare: false,
        }
    }
    pub fn share(limit: u32) -> Self {
        Self {
            mode: SmMode::Share,
            ..Self::cap(limit)
        }
    }
    pub fn bare() -> Self {
        Self {
            bare: true,
            ..Self::cap(0)
        }
    }
    pub fn priority(self, p: i32) -> Self {
        Self {
            priority: p,
            ..self
        }
    }
}

pub struct World {
    /// When the heartbeat thread of every process beats next (as the hook's, every 50 ms).
    next_beat: Nanos,
    pub clock: SimClock,
    pub gpu: SlicedGpu,
    pub board: SimBoard,
    pub apps: Vec<App>,
    pub files: Vec<SimFile>,
}

impl World {
    pub fn new() -> Self {
        let mut p = SliceParams::h200();
        if std::env::var("VGPU_EXHAUSTED").is_ok() {
            p.renewal = crate::sim_sliced::SliceRenewal::Exhausted;
        }
        Self::with(p)
    }

    pub fn with(params: SliceParams) -> Self {
        Self {
            next_beat: 50 * MS,
            clock: SimClock::default(),
            gpu: SlicedGpu::new(params),
            board: SimBoard::default(),
            apps: Vec::new(),
            files: Vec::new(),
        }
    }

    /// Adds a container of one process running `work`; returns the app's index.
    pub fn add(&mut self, t: Tenant, work: Workload) -> usize {
        let file = SimFile::new(t.limit);
        file.set_priority(t.priority);
        let cfg = LimiterConfig {
            mode: t.mode,
            ceiling_pct: t.ceiling,
            priority: t.priority,
            policy: if t.bare {
                Policy::Disable
            } else {
                Policy::Default
            },
            ..LimiterConfig::default()
        };
        let key = self.files.len() as u64 + 1;
        self.files.push(file.clone());
        self.add_process(cfg, &file, key, work)
    }

    /// Adds a process to the container of `file` (board key `key`) with `cfg`.
    pub fn add_process(
        &mut self,
        cfg: LimiterConfig,
        file: &SimFile,
        key: u64,
        work: Workload,
    ) -> usize {
        let ctx = self.gpu.add_context();
        let timer = SlicedTimer {
            gpu: self.gpu.clone(),
            clock: self.clock.clone(),
            ctx,
            gates: Vec::new(),
        };
        let board = SimBoardView {
            board: self.board.clone(),
            key,
        };
        let limiter = Limiter::new(cfg, self.clock.clone(), timer, file.view(), board);
        let id = self.apps.len();
        self.apps.push(App {
            ctx,
            stream: 1,
            limiter,
            work,
            pending: None,
            next: self.clock.now(),
            syncing: false,
            launch_cost: 4 * US,
            returning: None,
            rng: 0x9E37_79B9_7F4A_7C15 ^ (id as u64 + 1),
            max_oversleep: 60 * US,
            done: Vec::new(),
            launches: 0,
        });
        id
    }

    /// GPU time of app `i`'s kernels in `[t0, t1)`, as a fraction.
    pub fn share(&self, i: usize, t0: Nanos, t1: Nanos) -> f64 {
        self.gpu.busy_ns(self.apps[i].ctx, t0, t1) as f64 / (t1 - t0) as f64
    }

    /// Runs every application until `until`.
    pub fn run_until(&mut self, until: Nanos) {
        loop {
            let app_next = (0..self.apps.len())
                .filter(|&i| !self.apps[i].syncing)
                .map(|i| (self.apps[i].next, i))
                .min();
            let gpu_next = self.gpu.next_event();
            let t = match (app_next, gpu_next) {
                (Some((a, _)), Some(g)) => a.min(g),
                (Some((a, _)), None) => a,
                (None, Some(g)) => g,
                (None, None) => until,
            }
            .min(self.next_beat);
            if t >= until {
                self.gpu.advance_to(until.max(self.gpu.now()));
                self.clock.set(until.max(self.clock.now()));
                return;
            }
            self.clock.set(t.max(self.clock.now()));
            let now = self.clock.now();
            self.gpu.advance_to(now);
            for app in &mut self.apps {
                if app.syncing && self.gpu.stream_idle(app.ctx, app.stream) {
                    app.syncing = false;
                    app.next = now + 2 * US;
                }
            }
            if now >= self.next_beat {
                self.next_beat = now + 50 * MS;
                for app in &mut self.apps {
                    app.limiter.idle_heartbeat();
                }
            }
            if let Some((a, i)) = app_next
                && a <= now
            {
                self.step(i, now);
            }
        }
    }

    fn step(&mut self, i: usize, t: Nanos) {
        let gpu = self.gpu.clone();
        let app = &mut self.apps[i];
        if let Some(ticket) = app.returning.take() {
            app.limiter.launched(ticket, app.stream, true);
            let called = gpu.params().kernel_latency;
            app.next = t + app.launch_cost.saturating_sub(called).max(1);
            return;
        }
        let step = match app.pending.take() {
            Some(s) => s,
            None => (app.work)(t),
        };
        match step {
            Step::Pause(p) => app.next = t + p.max(1),
            Step::Done => {
                app.done.push(t);
                app.next = t + 1;
            }
            Step::Sync => {
                if gpu.stream_idle(app.ctx, app.stream) {
                    app.next = t + 2 * US;
                } else {
                    app.syncing = true;
                }
            }
            // CUDA blocks a launch while its stream's queue is full (about a thousand
            // launches pending).
            Step::Launch(..) if gpu.queued(app.ctx, app.stream) >= LAUNCH_QUEUE => {
                app.pending = Some(step);
                app.next = t + 20 * US;
            }
            Step::Launch(d, id) => match app.limiter.admit(app.stream, id) {
                Admission::Go(ticket) => {
                    app.launches += 1;
                    // The host's markers and gates before the launch delay its call.
                    let before = gpu.submit_kernel(app.ctx, app.stream, t, d, i as u64);
                    app.returning = Some(ticket);
                    app.next = t + before + gpu.params().kernel_latency.min(app.launch_cost);
                }
                Admission::Wait(w) => {
                    app.pending = Some(step);
                    // xorshift: deterministic timer slack.
                    app.rng ^= app.rng << 13;
                    app.rng ^= app.rng >> 7;
                    app.rng ^= app.rng << 17;
                    let slack = match app.max_oversleep {
                        0 => 0,
                        m => app.rng % m,
                    };
                    app.next = t + w + slack;
                }
            },
        }
    }
}

/// A loop of kernels of one duration, back to back (a matmul or spin loop).
pub fn kernel_loop(dur: Nanos) -> Workload {
    Box::new(move |_| Step::Launch(dur, dur))
}

/// A training loop: each step launches `kernels` (GPU time, identity) with `host` of host
/// time before each launch (the framework's per-op overhead), then synchronizes
/// (`loss.item()`) and does `pause` of host work; one unit of work per step.
pub fn training(kernels: Vec<(Nanos, LaunchId)>, host: Nanos, pause: Nanos) -> Workload {
    let kernels = kernels.into_iter().map(|(d, id)| (host, d, id)).collect();
    training_as(kernels, pause, |_| 1.0)
}

/// [`training`] with each kernel's own host time before it, `(host, GPU time, identity)`, and
/// every kernel's GPU time scaled by `clock(now)` when it is launched (the GPU's power
/// management moving its clock).
pub fn training_as(
    kernels: Vec<(Nanos, Nanos, LaunchId)>,
    pause: Nanos,
    clock: impl Fn(Nanos) -> f64 + 'static,
) -> Workload {
    let mut i = 0usize;
    let mut phase = 0u8;
    Box::new(move |now| {
        if i < kernels.len() {
            let (host, dur, id) = kernels[i];
            if phase == 0 && host > 0 {
                phase = 1;
                return Step::Pause(host);
            }
            phase = 0;
            i += 1;
            return Step::Launch((dur as f64 * clock(now)) as Nanos, id);
        }
        match phase {
            0 => {
                phase = 2;
                Step::Sync
            }
            2 => {
                phase = 3;
                Step::Done
            }
            _ => {
                phase = 0;
                i = 0;
                Step::Pause(pause.max(1))
            }
        }
    })
}

/// A step of `n` kernels whose lengths cycle through `lens` (µs), identities from `salt`.
pub fn model_step(n: usize, lens: &[Nanos], salt: u64) -> Vec<(Nanos, LaunchId)> {
    (0..n)
        .map(|k| (lens[k % lens.len()] * US, salt * 1_000_003 + k as u64))
        .collect()
}

/// A service: requests arrive every `every` (from `start`); each launches `kernels` with
/// `host` before each, then synchronizes; the latency of each request (from its arrival)
/// is pushed into `latencies`.
pub fn service(
    kernels: Vec<(Nanos, LaunchId)>,
    host: Nanos,
    every: Nanos,
    start: Nanos,
    latencies: Rc<RefCell<Vec<Nanos>>>,
) -> Workload {
    let mut next_arrival = start;
    let mut arrival = 0;
    let mut i = 0usize;
    let mut phase = 0u8;
    let work: Workload = Box::new(move |now| {
        if phase == 0 {
            if now < next_arrival {
                return Step::Pause(next_arrival - now);
            }
            arrival = next_arrival;
            next_arrival += every;
            phase = 1;
            i = 0;
        }
        if phase == 1 {
            if i < kernels.len() {
                i += 1;
                return Step::Launch(kernels[i - 1].0, kernels[i - 1].1);
            }
            phase = 2;
            return Step::Sync;
        }
        phase = 0;
        latencies.borrow_mut().push(now - arrival);
        Step::Done
    });
    work.with_host(host)
}

trait WithHost {
    fn with_host(self, host: Nanos) -> Workload;
}

impl WithHost for Workload {
    /// `host` of host time before each launch.
    fn with_host(mut self, host: Nanos) -> Workload {
        if host == 0 {
            return self;
        }
        let mut held: Option<Step> = None;
        Box::new(move |now| {
            if let Some(s) = held.take() {
                return s;
            }
            match self(now) {
                s @ Step::Launch(..) => {
                    held = Some(s);
                    Step::Pause(host)
                }
                s => s,
            }
        })
    }
}

/// The `p`-quantile of `v` (0..=1), nearest rank.
pub fn quantile(v: &[Nanos], p: f64) -> Nanos {
    let mut s = v.to_vec();
    s.sort_unstable();
    if s.is_empty() {
        return 0;
    }
    let k = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
    s[k]
}

/// A claim for a hand-written board record.
pub fn claim(share_pct: u32, ceiling_pct: u32, priority: i32) -> ShareClaim {
    ShareClaim {
        share_pct,
        ceiling_pct,
        priority,
    }
}
