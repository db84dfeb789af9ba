//! Swapping an idle process's movable device memory out to host memory, and back in on its
//! next call that can touch device memory (docs/swap.md).
//!
//! - [`gate`]: which calls may run while memory moves (the declaration list's `touches` and
//!   `ends_context` entries pass through it).
//! - [`swap_out`]: the move rule for the whole process (every context of the devices
//!   concerned synchronized without the swap lock, each pinned against its end while it is,
//!   then the gate closed with no gated call or end since), then `host_backing::swap` moves
//!   every device-resident movable allocation to host memory.
//! - [`pins`]: which context the swapper is synchronizing; only an end of that one waits.
//! - The swap-in runs in the gate, on the calling thread, before the call; it waits for
//!   device room up to `VGPU_SWAP_IN_WAIT`, then the call fails with out-of-memory, its
//!   memory still whole in host memory.
//! - [`unlisted`]: the gate of driver functions the declaration list does not name.
//! - [`watcher`]: the `vgpu-swap` thread (only with `VGPU_IDLE_SWAP` set): idleness, the
//!   shared file's swap-out requests, and more urgent containers' wants.
//! - [`room`]: the room boards where less urgent containers offer and more urgent ones want.

pub(crate) mod gate;
pub(crate) mod pins;
pub(crate) mod room;
#[allow(unsafe_code)] // the slots' stubs and the call they make
pub(crate) mod unlisted;
pub(crate) mod watcher;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use vgpu_cuda_abi::*;

use crate::driver;
use crate::host_backing::swap::{SwapIn, in_context};
use crate::log::{INFO, MSG, WARN, vlog};
use crate::real::{self, Cuda};
use crate::state::{self, Enforcement, Ready};

/// Whether swapping is off in this process (one relaxed load): the generated exports then
/// make their call without the gate.
#[inline(always)]
pub(crate) fn off() -> bool {
    gate::GATE.load(std::sync::atomic::Ordering::Relaxed) == gate::OFF
}

/// The gate of a `touches` entry (the generated export calls it around the call once
/// swapping is on; out of line, so the export's own path keeps one copy of its call).
#[cold]
#[inline(never)]
pub(crate) fn touching(call: impl FnOnce() -> Result<(), CUresult>) -> Result<(), CUresult> {
    gate::pass(gate::Kind::Touches, call, swap_in)
}

/// The gate of an `ends_context` entry; `end`: its argument (the context, or the device whose
/// primary context it releases or resets).
#[cold]
#[inline(never)]
pub(crate) fn ending_context(
    end: impl Into<pins::Ends>,
    call: impl FnOnce() -> Result<(), CUresult>,
) -> Result<(), CUresult> {
    gate::pass(gate::Kind::Ends(end.into()), call, |_| Ok(()))
}

fn ready() -> Option<&'static Ready> {
    match state::get() {
        Enforcement::Ready(r) => Some(r),
        Enforcement::Broken(_) => None,
    }
}

/// Brings everything swapped out back (holding the swap lock), waiting for room up to
/// `VGPU_SWAP_IN_WAIT`: `Err(OUT_OF_MEMORY)` if it is still short then (what did come back
/// stays on the device; the rest stays whole in host memory, and the next call tries again).
fn swap_in(held: &mut gate::Swapped) -> Result<(), CUresult> {
    let (Some(st), Ok(cuda)) = (ready(), real::cuda()) else {
        return Err(CUresult::OUT_OF_MEMORY);
    };
    let wait = Duration::from_millis(st.config.swap.in_wait_ms);
    let reserve = st.config.host_backing.device_reserve;
    let start = Instant::now();
    loop {
        match st
            .host_backed
            .swap_in(cuda, st.ledger(), reserve, st.config.swap.keep_host)
        {
            SwapIn::Done => {
                held.out = false;
                st.slot().set_swapped_out(false);
                vlog!(
                    INFO,
                    "swapped back in after {} ms",
                    start.elapsed().as_millis()
                );
                return Ok(());
            }
            SwapIn::Short(bytes) if start.elapsed() >= wait => {
                vlog!(
                    MSG,
                    "cannot swap {bytes} bytes back in: the device has had no room for them for \
                     {} ms (VGPU_SWAP_IN_WAIT); the call fails with out of memory and they stay \
                     in host memory, intact",
                    wait.as_millis()
                );
                return Err(CUresult::OUT_OF_MEMORY);
            }
            SwapIn::Short(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Why a swap-out did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NotSwapped {
    /// Already swapped out.
    AlreadyOut,
    /// Nothing device-resident can move.
    Nothing,
    /// A gated call is running, one ran or a context ended meanwhile, or a context still had
    /// work after [`IDLE_WAIT`] (try again later).
    Busy,
    /// Refused, for the reason logged.
    Refused(String),
}

/// Swaps this process's movable memory out (from the `vgpu-swap` thread): the bytes moved.
pub(crate) fn swap_out(why: &str) -> Result<u64, NotSwapped> {
    let (Some(st), Ok(cuda)) = (ready(), real::cuda()) else {
        return Err(NotSwapped::Nothing);
    };
    let devices = {
        let held = gate::lock();
        if held.out {
            return Err(NotSwapped::AlreadyOut);
        }
        movable(st)?
    };
    // The move rule (docs/swap.md): every context that can reach the allocations must be
    // idle. Each is synchronized with the swap lock released and the gate open (the program
    // runs on: nothing of it waits for us but an end of the context being synchronized, see
    // `pins`); then the gate closes only if no gated call or end ran since before the first
    // synchronize, so no work was queued after the waits proved the contexts idle, and none
    // can be until it reopens.
    let Some(since) = gate::calls() else {
        return Err(NotSwapped::Busy);
    };
    prove_idle(st, cuda, devices, why)?;
    let mut held = gate::lock();
    if held.out {
        return Err(NotSwapped::AlreadyOut);
    }
    if !gate::close(&mut held, since) {
        return Err(NotSwapped::Busy);
    }
    let start = Instant::now();
    let mut giving = room::Giving::start(st);
    let moved = st
        .host_backed
        .swap_out(cuda, st.ledger(), &mut || giving.progress());
    giving.finish();
    if moved.bytes == 0 {
        gate::reopen(&mut held);
        return Err(NotSwapped::Nothing);
    }
    held.out = true;
    st.slot().set_swapped_out(true);
    vlog!(
        MSG,
        "swapped out {} bytes of device memory to host memory in {} ms, {} of them into host \
         memory pinned for it, {} staged in pageable memory ({why}); they come back on the \
         next call that can touch device memory",
        moved.bytes,
        start.elapsed().as_millis(),
        moved.pinned_afresh,
        moved.staged
    );
    Ok(moved.bytes)
}

/// Pins the host memory of one allocation ahead of an idle swap-out (the `vgpu-swap` thread,
/// once a quiet spell has lasted half of `VGPU_IDLE_SWAP`), if host memory is kept between
/// swaps at all and a swap-out would not be refused: `false` once there is nothing left to
/// pin this spell. The memory is what the swapped state needs anyway, and it is kept (as a
/// swap-in keeps it) whether or not the swap-out comes, so the first swap-out copies at link
/// speed too. Works for about `budget` (the watcher's tick: an exit waits for one step).
pub(crate) fn pin_ahead(budget: Duration) -> bool {
    let (Some(st), Ok(cuda)) = (ready(), real::cuda()) else {
        return false;
    };
    if !st.config.swap.keep_host {
        return false;
    }
    let start = Instant::now();
    let (mut bytes, mut count) = (0u64, 0u32);
    // Allocations one by one until the step's time is spent (at least one: a large one may
    // take longer), each after checking afresh that a swap-out would not be refused (the
    // cgroup's room shrinks with every pinning).
    let more = loop {
        if movable(st).is_err() {
            break false;
        }
        match st.host_backed.pin_ahead(cuda, st.ledger()) {
            Some(b) => {
                bytes += b;
                count += u32::from(b > 0);
            }
            None => break false,
        }
        if start.elapsed() >= budget {
            break true;
        }
    };
    if bytes > 0 {
        vlog!(
            INFO,
            "pinned {bytes} bytes of host memory ahead of a swap-out ({count} allocations, {} \
             ms)",
            start.elapsed().as_millis()
        );
    }
    more
}

/// Moves what a swap-out staged in pageable memory into pinned host memory while the process
/// stays out (the `vgpu-swap` thread, each tick; docs/swap.md, "Pageable staging"): host
/// memory pinned with no lock held (the slow part; a wake never waits for it), then, under the
/// swap lock, one allocation's bytes copied in and the memory mapped at its address. Not with
/// `VGPU_SWAP_KEEP_HOST=0` (nothing pinned is held then: staged bytes come back from pageable
/// memory). Works for about `budget` (an exit waits for one step).
pub(crate) fn settle(budget: Duration) {
    let (Some(st), Ok(cuda)) = (ready(), real::cuda()) else {
        return;
    };
    if !st.config.swap.keep_host || !st.host_backed.any_staged() {
        return;
    }
    let start = Instant::now();
    loop {
        let pinned = st.host_backed.pin_for_staged(cuda, st.ledger());
        let filled = {
            let _held = gate::lock();
            st.host_backed.fill_staged(cuda, st.ledger())
        };
        if (pinned.is_none() && filled == 0) || start.elapsed() >= budget {
            return;
        }
    }
}

/// The devices of the movable memory, or why nothing can move.
fn movable(st: &Ready) -> Result<Vec<CUdevice>, NotSwapped> {
    if let Some(name) = crate::interpose::uncovered_touching() {
        return Err(NotSwapped::Refused(format!(
            "the program resolved {name}, which can touch device memory and which the hook \
             does not gate: its calls could run while memory moves"
        )));
    }
    let moving = st.host_backed.swappable();
    if moving.bytes == 0 {
        return Err(NotSwapped::Nothing);
    }
    // Host memory kept from earlier swap-ins is pinned already: the cgroup counts it.
    if let Some(room) = crate::host_backing::host_headroom() {
        let need = moving
            .to_pin
            .saturating_add(crate::host_backing::HOST_RESERVE);
        if room < need {
            return Err(NotSwapped::Refused(format!(
                "{} bytes would not fit the container's memory cgroup ({room} bytes left, \
                 and pinned memory counts against it)",
                moving.to_pin
            )));
        }
    }
    let mut devices: Vec<CUdevice> = Vec::new();
    for &(_, d) in &moving.contexts {
        if !devices.contains(&d) {
            devices.push(d);
        }
    }
    Ok(devices)
}

/// How long a swap-out waits for the contexts' work to finish before it gives up for now.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// A `vgpu-swap-sync` thread is still synchronizing (it may wait on a context that never
/// goes idle): no other starts until it is done.
static SYNCING: AtomicBool = AtomicBool::new(false);

/// Clears [`SYNCING`] when the synchronizing thread ends, whatever way.
struct Syncing;

impl Drop for Syncing {
    fn drop(&mut self) {
        SYNCING.store(false, Ordering::SeqCst);
    }
}

/// Synchronizes every context of `devices` on a thread of its own, each pinned while it is,
/// and waits for that up to [`IDLE_WAIT`]: a context still busy then makes the swap-out
/// give up (`Busy`; the thread finishes its wait alone, holding only that context's pin).
fn prove_idle(
    st: &'static Ready,
    cuda: &'static Cuda,
    devices: Vec<CUdevice>,
    why: &str,
) -> Result<(), NotSwapped> {
    if SYNCING.swap(true, Ordering::SeqCst) {
        return Err(NotSwapped::Busy);
    }
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("vgpu-swap-sync".into())
        .stack_size(crate::worker::WORKER_STACK)
        .spawn(move || {
            // Cleared before the answer (the next swap-out may start at once), and on a panic.
            let r = {
                let _clear = Syncing;
                synchronize_all(st, cuda, &devices)
            };
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        SYNCING.store(false, Ordering::SeqCst);
        return Err(NotSwapped::Refused(format!(
            "cannot start a thread to synchronize the contexts ({e})"
        )));
    }
    match rx.recv_timeout(IDLE_WAIT) {
        Ok(r) => r,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            vlog!(
                INFO,
                "not swapping out ({why}) now: a context still has work after {} ms",
                IDLE_WAIT.as_millis()
            );
            Err(NotSwapped::Busy)
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(NotSwapped::Busy),
    }
}

/// In a forked child: the parent's synchronizing thread did not come along.
pub(crate) fn reset_in_child() {
    SYNCING.store(false, Ordering::SeqCst);
}

fn synchronize_all(st: &Ready, cuda: &Cuda, devices: &[CUdevice]) -> Result<(), NotSwapped> {
    for &dev in devices {
        for k in st.host_backed.contexts.known_on(dev) {
            // Ending now: it will be gone, and its end counted (the close would refuse).
            let Some(_pin) = pins::pin(k) else {
                return Err(NotSwapped::Busy);
            };
            // Ended before the pin: its handle must not be used.
            if !st.host_backed.contexts.lives(k) {
                continue;
            }
            if let Err(e) = in_context(cuda, k.ctx as CUcontext, || driver::ctx_synchronize(cuda)) {
                return Err(NotSwapped::Refused(format!(
                    "synchronizing a context of device {} failed (error {})",
                    dev.0, e.0
                )));
            }
        }
    }
    Ok(())
}

/// Logs a refusal (rate-limited per kind of line like every log line).
pub(crate) fn said_not_swapped(why: &str, n: &NotSwapped) {
    match n {
        NotSwapped::Refused(reason) => vlog!(MSG, "not swapping out ({why}): {reason}"),
        NotSwapped::Busy => vlog!(
            INFO,
            "not swapping out ({why}) now: a call is running or a context has work"
        ),
        NotSwapped::AlreadyOut => vlog!(INFO, "not swapping out ({why}): already out"),
        NotSwapped::Nothing => vlog!(
            INFO,
            "not swapping out ({why}): no device memory of this process can move"
        ),
    }
}

/// Starts swapping for this process if the configuration asks (at the state's build).
pub(crate) fn start(st: &'static Ready) {
    if !st.config.swap.enabled() {
        return;
    }
    gate::enable();
    if let Err(e) = watcher::start(st) {
        vlog!(WARN, "swapping stays off: cannot start its thread ({e})");
    }
}
