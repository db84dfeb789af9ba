//! Execution of stream work: one worker thread per stream (started on first use), events with
//! real timestamps, and per-device busy time for NVML's utilization and energy counter.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::power::{EnergyMeter, PowerModel};

/// A unit of stream work.
pub type Job = Box<dyn FnOnce() + Send>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in a job must not wedge the simulated device.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    submitted: u64,
    completed: u64,
    worker: bool,
    closing: bool,
}

/// The in-order work queue of one stream.
#[derive(Default)]
pub struct StreamQueue {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl std::fmt::Debug for StreamQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = lock(&self.q);
        write!(f, "StreamQueue({}/{})", q.completed, q.submitted)
    }
}

impl StreamQueue {
    /// An empty queue; its worker starts with the first job.
    pub fn new() -> Arc<StreamQueue> {
        Arc::new(StreamQueue::default())
    }

    /// Appends `job`; returns its ticket (wait for it with [`StreamQueue::wait`]).
    pub fn submit(self: &Arc<Self>, job: Job) -> u64 {
        let mut q = lock(&self.q);
        q.jobs.push_back(job);
        q.submitted += 1;
        let ticket = q.submitted;
        if !q.worker {
            q.worker = true;
            q.closing = false;
            let me = Arc::clone(self);
            std::thread::Builder::new()
                .name("vgpu-sim-stream".into())
                .spawn(move || me.work())
                .expect("vgpu-sim: cannot start a stream worker thread");
        }
        drop(q);
        self.cv.notify_all();
        ticket
    }

    fn work(&self) {
        let mut q = lock(&self.q);
        loop {
            if let Some(job) = q.jobs.pop_front() {
                drop(q);
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                q = lock(&self.q);
                q.completed += 1;
                self.cv.notify_all();
            } else if q.closing {
                q.worker = false;
                self.cv.notify_all();
                return;
            } else {
                q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// Ticket of the last job submitted so far.
    pub fn last_ticket(&self) -> u64 {
        lock(&self.q).submitted
    }

    /// Blocks until every job up to `ticket` has run.
    pub fn wait(&self, ticket: u64) {
        let mut q = lock(&self.q);
        while q.completed < ticket {
            q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks until the queue is empty.
    pub fn drain(&self) {
        let t = self.last_ticket();
        self.wait(t);
    }

    /// Whether every job up to `ticket` has run.
    pub fn done(&self, ticket: u64) -> bool {
        lock(&self.q).completed >= ticket
    }

    /// Lets the worker thread exit once the queue is empty (the stream is destroyed).
    pub fn close(&self) {
        lock(&self.q).closing = true;
        self.cv.notify_all();
    }
}

/// Where an event stands.
#[derive(Debug, Default)]
pub struct EventState {
    /// Queue and ticket of the last record, if any.
    pub recorded: Option<(Arc<StreamQueue>, u64)>,
    /// When the recorded point was reached (set by the stream worker).
    pub at: Option<Instant>,
}

/// A CUDA event.
#[derive(Debug, Default)]
pub struct Event {
    /// Flags given at creation.
    pub flags: u32,
    /// Mutable part.
    pub state: Mutex<EventState>,
}

impl Event {
    /// Records the event on `queue`: it completes when the queue reaches this point.
    pub fn record(self: &Arc<Self>, queue: &Arc<StreamQueue>) {
        let me = Arc::clone(self);
        let mut st = lock(&self.state);
        st.at = None;
        let ticket = queue.submit(Box::new(move || {
            lock(&me.state).at = Some(Instant::now());
        }));
        st.recorded = Some((Arc::clone(queue), ticket));
    }

    /// Whether the recorded work has completed (an event never recorded is complete).
    pub fn done(&self) -> bool {
        let st = lock(&self.state);
        match &st.recorded {
            None => true,
            Some((q, t)) => q.done(*t),
        }
    }

    /// Blocks until the recorded work has completed.
    pub fn wait(&self) {
        let rec = lock(&self.state).recorded.clone();
        if let Some((q, t)) = rec {
            q.wait(t);
        }
    }

    /// When the event completed, if it has.
    pub fn time(&self) -> Option<Instant> {
        lock(&self.state).at
    }
}

#[derive(Debug)]
struct Busy {
    active: u32,
    since: Option<Instant>,
    intervals: VecDeque<(Instant, Instant)>,
    kernels: u64,
    energy: EnergyMeter,
}

/// Time a device spent running kernels, for utilization queries, and the energy it drew.
#[derive(Debug)]
pub struct BusyLog {
    b: Mutex<Busy>,
}

impl Default for BusyLog {
    fn default() -> Self {
        Self::new(PowerModel::default())
    }
}

impl BusyLog {
    /// An idle device drawing power as `power` says, from now on.
    pub fn new(power: PowerModel) -> Self {
        Self {
            b: Mutex::new(Busy {
                active: 0,
                since: None,
                intervals: VecDeque::new(),
                kernels: 0,
                energy: EnergyMeter::new(power, Instant::now()),
            }),
        }
    }

    /// A kernel starts.
    pub fn begin(&self) {
        let mut b = lock(&self.b);
        if b.active == 0 {
            // Read under the lock, so the meter sees transitions in order.
            let now = Instant::now();
            b.since = Some(now);
            b.energy.set_busy(now, true);
        }
        b.active += 1;
        b.kernels += 1;
    }

    /// A kernel ends.
    pub fn end(&self) {
        let mut b = lock(&self.b);
        b.active = b.active.saturating_sub(1);
        if b.active == 0
            && let Some(s) = b.since.take()
        {
            let now = Instant::now();
            b.energy.set_busy(now, false);
            b.intervals.push_back((s, now));
            if b.intervals.len() > 4096 {
                b.intervals.pop_front();
            }
        }
    }

    /// NVML's energy counter: millijoules since the simulated driver started, as of the
    /// last 100 ms step.
    pub fn energy_mj(&self) -> u64 {
        let mut b = lock(&self.b);
        let now = Instant::now();
        b.energy.reported_mj(now)
    }

    /// The draw now, milliwatts.
    pub fn power_draw_mw(&self) -> u32 {
        lock(&self.b).energy.draw_mw()
    }

    /// The enforced power limit, milliwatts.
    pub fn power_limit_mw(&self) -> u32 {
        lock(&self.b).energy.limit_mw()
    }

    /// Kernels started so far.
    pub fn kernels(&self) -> u64 {
        lock(&self.b).kernels
    }

    /// Percent of the last `window` during which at least one kernel ran.
    pub fn percent(&self, window: Duration) -> u32 {
        let now = Instant::now();
        let from = now.checked_sub(window).unwrap_or(now);
        let mut b = lock(&self.b);
        while b.intervals.front().is_some_and(|(_, e)| *e < from) {
            b.intervals.pop_front();
        }
        let mut busy = Duration::ZERO;
        for (s, e) in &b.intervals {
            busy += e.saturating_duration_since((*s).max(from));
        }
        if let Some(s) = b.since {
            busy += now.saturating_duration_since(s.max(from));
        }
        let pct = busy.as_secs_f64() / window.as_secs_f64() * 100.0;
        pct.round().clamp(0.0, 100.0) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn jobs_run_in_order_and_wait_blocks() {
        let q = StreamQueue::new();
        let n = Arc::new(AtomicU32::new(0));
        for i in 0..10 {
            let n = n.clone();
            q.submit(Box::new(move || {
                assert_eq!(n.load(Ordering::SeqCst), i);
                n.store(i + 1, Ordering::SeqCst);
            }));
        }
        q.drain();
        assert_eq!(n.load(Ordering::SeqCst), 10);
        q.close();
    }

    #[test]
    fn events_measure_elapsed_time() {
        let q = StreamQueue::new();
        let a = Arc::new(Event::default());
        let b = Arc::new(Event::default());
        a.record(&q);
        q.submit(Box::new(|| std::thread::sleep(Duration::from_millis(20))));
        b.record(&q);
        b.wait();
        assert!(a.done() && b.done());
        let ms = b
            .time()
            .unwrap()
            .duration_since(a.time().unwrap())
            .as_secs_f64()
            * 1e3;
        assert!(ms >= 19.0, "{ms}");
    }

    #[test]
    fn busy_percent_tracks_kernels() {
        let log = BusyLog::default();
        assert_eq!(log.percent(Duration::from_millis(100)), 0);
        log.begin();
        std::thread::sleep(Duration::from_millis(60));
        log.end();
        let p = log.percent(Duration::from_millis(100));
        assert!((40..=100).contains(&p), "{p}");
    }
}
