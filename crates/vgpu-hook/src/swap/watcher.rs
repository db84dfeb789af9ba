//! The `vgpu-swap` thread (only with `VGPU_IDLE_SWAP` set): every tick it reads the shared
//! file's count of swap-out requests (`vgpu swap-out` adds one) and, with a duration set, how
//! many gated calls this process made; it swaps out when the count changed, or when no gated
//! call came for that long, and from half that long it pins the host memory the swap-out
//! will need, about a tick's work a step. Every second it offers its movable memory to more
//! urgent containers, and it swaps out for one whose want names its GPU once it has been
//! quiet for a tick (`room`). It never calls the driver but through
//! [`super::swap_out`], [`super::pin_ahead`], [`super::settle`] (pinning what a swap-out
//! staged in pageable memory, while the process stays out) and the room boards.

use std::time::{Duration, Instant};

use vgpu_env::SwapTrigger;

use super::{NotSwapped, gate, said_not_swapped, swap_out};
use crate::state::Ready;
use crate::worker::{Stopped, Worker};

static WORKER: Worker = Worker::new();

/// The longest an exiting process waits for a swap-out in progress.
const STOP_WAIT: Duration = Duration::from_millis(200);

/// How often the thread looks: a tenth of the idle time, between 10 and 100 ms.
fn tick(trigger: SwapTrigger) -> Duration {
    match trigger {
        SwapTrigger::Idle(ms) => Duration::from_millis((ms / 10).clamp(10, 100)),
        _ => Duration::from_millis(100),
    }
}

/// Starts the thread (once per process).
pub(super) fn start(st: &'static Ready) -> std::io::Result<()> {
    if !WORKER.claim() {
        return Ok(());
    }
    WORKER.spawn("vgpu-swap", move |w| run(w, st))
}

/// At exit: no swap-out starts after this returns.
pub(crate) fn stop() {
    WORKER.stop(STOP_WAIT);
}

/// In a forked child: the thread was not copied.
pub(crate) fn reset_in_child() {
    WORKER.reset_in_child();
    gate::reset_in_child();
    super::reset_in_child();
}

/// What the thread remembers between ticks.
struct Watch {
    /// The request count last acted on.
    requests: u32,
    /// The gated calls last seen, and since when.
    calls: Option<u64>,
    since: Instant,
    /// An idle swap-out was tried for this quiet spell (not again until a call comes).
    tried: bool,
    /// Nothing more to pin ahead of a swap-out this quiet spell.
    pinned: bool,
    /// When this process last offered its memory on the room boards.
    offered: Option<Instant>,
}

/// How often a process offers its movable memory to more urgent containers (an offer
/// counts for 3 s).
const OFFER_PERIOD: Duration = Duration::from_secs(1);

fn run(worker: &Worker, st: &'static Ready) {
    let trigger = st.config.swap.trigger;
    let table = st.slot().table().clone();
    let mut w = Watch {
        requests: table.swap_requests(),
        calls: gate::calls(),
        since: Instant::now(),
        tried: false,
        pinned: false,
        offered: None,
    };
    loop {
        std::thread::sleep(tick(trigger));
        if worker.step(|| look(&mut w, st, &table)) == Err(Stopped) {
            return;
        }
    }
}

fn look(w: &mut Watch, st: &Ready, table: &vgpu_shm::UsageTable) {
    let requests = table.swap_requests();
    if requests != w.requests {
        w.requests = requests;
        attempt("asked by vgpu swap-out", true);
        return;
    }
    if w.offered.is_none_or(|t| t.elapsed() >= OFFER_PERIOD) {
        w.offered = Some(Instant::now());
        super::room::offer(st);
    }
    // Swapped out with bytes staged in pageable memory: pinned in the background, a step a
    // tick (nothing when there are none).
    super::settle(tick(st.config.swap.trigger));
    let calls = gate::calls();
    if calls.is_none() || calls != w.calls {
        w.calls = calls;
        w.since = Instant::now();
        w.tried = false;
        w.pinned = false;
        return;
    }
    if w.tried {
        return;
    }
    // Quiet for a tick at least: a more urgent container's want makes it yield now.
    if let Some((dev, priority)) = super::room::wanted(st) {
        w.tried = true;
        attempt(
            &format!(
                "a container of priority {priority} needs room on device {}",
                dev.0
            ),
            false,
        );
        return;
    }
    let SwapTrigger::Idle(ms) = st.config.swap.trigger else {
        return;
    };
    let quiet = w.since.elapsed();
    if quiet >= Duration::from_millis(ms) {
        w.tried = true;
        attempt(&format!("idle for {ms} ms"), false);
    } else if !w.pinned && quiet >= Duration::from_millis(ms / 2) {
        // About a tick's work a step (an exit waits for the step in progress).
        w.pinned = !super::pin_ahead(tick(st.config.swap.trigger));
    }
}

/// One swap-out; a request that finds a call running tries a few more times.
fn attempt(why: &str, asked: bool) {
    let mut tries = if asked { 20 } else { 1 };
    loop {
        match swap_out(why) {
            Ok(_) => return,
            Err(NotSwapped::Busy) if tries > 1 => {
                tries -= 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(n) => {
                // An idle process with nothing that can move says so only when asked.
                if asked || matches!(n, NotSwapped::Refused(_)) {
                    said_not_swapped(why, &n);
                }
                return;
            }
        }
    }
}
