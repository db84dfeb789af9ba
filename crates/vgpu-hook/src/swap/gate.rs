//! The swap gate: which calls may run while memory moves (docs/swap.md, "The gate").
//!
//! Every listed entry that can touch device memory (`touches` in `vgpu-cuda-abi`'s
//! declaration list) and every one that ends a context (`ends_context`) passes through here.
//!
//! - Swapping off (the default): one relaxed load of [`GATE`], then the call.
//! - Swapping on, the gate open: the calling thread marks itself inside a call (its own
//!   counter made odd), checks the gate again, makes the call and marks itself out.
//! - The gate closed (a swap-out or swap-in in progress, or the memory swapped out): a
//!   `touches` call waits for the swap lock and brings the memory back first.
//! - An `ends_context` call, swapping on, waits while a swap-out synchronizes the context it
//!   ends ([`super::pins`]), then runs holding the swap lock whatever the gate says (no swap
//!   operation moves memory through a context that is ending), counted as a call, and brings
//!   nothing back.
//!
//! **Invariant (the handshake).** A swap operation, holding the swap lock, closes the gate
//! and then reads every thread's counter; a thread marks itself inside a call and then reads
//! the gate. All four accesses are sequentially consistent, so one side sees the other:
//! either the swapper sees the thread inside a call (and gives up, the gate reopened), or the
//! thread sees the gate closed (and waits for the lock, marked outside). So once the swapper
//! has closed the gate and found every counter even, no gated call runs until it reopens.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::pins::{self, Ends};

/// Swapping is off: calls pass with one relaxed load.
pub(crate) const OFF: u32 = 0;
/// Swapping is on and the memory is where the program left it: calls pass, tracked.
pub(crate) const OPEN: u32 = 1;
/// A swap operation is in progress, or the memory is swapped out: calls wait for the lock.
pub(crate) const CLOSED: u32 = 2;

/// The gate's state ([`OFF`], [`OPEN`], [`CLOSED`]).
pub(crate) static GATE: AtomicU32 = AtomicU32::new(OFF);

/// What the swap lock protects: whether memory is swapped out now.
#[derive(Debug, Default)]
pub(crate) struct Swapped {
    /// Memory was moved out and not all of it has come back.
    pub(crate) out: bool,
}

static LOCK: Mutex<Swapped> = Mutex::new(Swapped { out: false });

/// The swap lock: held by a swap-out from the gate's close to the end of its move, by a
/// swap-in, by a gated call that found the gate closed, and by a context's end. Never held
/// across a wait for the program's work (a swap-out synchronizes without it).
pub(crate) fn lock() -> MutexGuard<'static, Swapped> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every thread that ever made a gated call while swapping was on: its counter, odd while it
/// is inside one.
static THREADS: Mutex<Vec<Arc<AtomicU64>>> = Mutex::new(Vec::new());

thread_local! {
    static MINE: Arc<AtomicU64> = {
        let c = Arc::new(AtomicU64::new(0));
        THREADS.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(&c));
        c
    };
}

/// Marks the thread outside a call when dropped (also when the call panics).
struct Inside(Arc<AtomicU64>);

impl Inside {
    fn enter() -> Option<Inside> {
        // A thread being torn down has no counter any more: it makes no calls that matter.
        let c = MINE.try_with(Arc::clone).ok()?;
        c.fetch_add(1, Ordering::SeqCst);
        Some(Inside(c))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// What a closed gate asks of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The call can touch device memory: bring everything back first.
    Touches,
    /// The call ends a context: wait for a swap operation in progress, bring nothing back.
    Ends(Ends),
}

/// Runs `call` through the gate. `swap_in` brings the memory back (holding the lock); its
/// error is the call's answer (then the call does not run).
#[inline(always)]
pub(crate) fn pass<E>(
    kind: Kind,
    call: impl FnOnce() -> Result<(), E>,
    swap_in: impl FnMut(&mut Swapped) -> Result<(), E>,
) -> Result<(), E> {
    if GATE.load(Ordering::Relaxed) == OFF {
        return call();
    }
    if let Kind::Ends(end) = kind {
        return ending(end, call);
    }
    tracked(call, swap_in)
}

/// A context ends only while the swapper is not synchronizing it ([`pins`]) and no swap
/// operation holds the lock: under the swap lock, whatever the gate says. Nothing comes back
/// for it. It counts as a call, so a swap-out that synchronized before it gives up.
#[cold]
#[inline(never)]
fn ending<E>(end: Ends, call: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
    // Dropped in reverse: the lock, then the end's mark (the census forgot the context
    // inside the call), then the count.
    let _inside = Inside::enter();
    let _ending = pins::ending(end);
    let _held = lock();
    call()
}

#[cold]
#[inline(never)]
fn tracked<E>(
    call: impl FnOnce() -> Result<(), E>,
    mut swap_in: impl FnMut(&mut Swapped) -> Result<(), E>,
) -> Result<(), E> {
    loop {
        let Some(inside) = Inside::enter() else {
            return untracked(call, swap_in);
        };
        if GATE.load(Ordering::SeqCst) != CLOSED {
            let answer = call();
            drop(inside);
            return answer;
        }
        drop(inside);
        let mut st = lock();
        if GATE.load(Ordering::SeqCst) != CLOSED {
            continue; // reopened while we waited: pass as usual
        }
        // No swap operation runs while the lock is held, and no gated call passed the gate
        // since it closed: nothing queued can be using the memory.
        if st.out {
            swap_in(&mut st)?;
        }
        if !st.out {
            GATE.store(OPEN, Ordering::SeqCst);
        }
    }
}

/// A call on a thread whose counter is gone (a thread-local destructor calling the driver
/// while its thread ends): it runs under the swap lock, so no swap operation overlaps it, and
/// after a swap-in if the memory is out.
#[cold]
fn untracked<E>(
    call: impl FnOnce() -> Result<(), E>,
    mut swap_in: impl FnMut(&mut Swapped) -> Result<(), E>,
) -> Result<(), E> {
    let mut st = lock();
    if GATE.load(Ordering::SeqCst) == CLOSED {
        if st.out {
            swap_in(&mut st)?;
        }
        if !st.out {
            GATE.store(OPEN, Ordering::SeqCst);
        }
    }
    call()
}

/// The threads' calls as one number, or `None` while some thread is inside a gated call.
/// Two equal answers mean no gated call started in between.
pub(crate) fn calls() -> Option<u64> {
    let threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
    let mut sum = 0u64;
    for c in threads.iter() {
        let n = c.load(Ordering::SeqCst);
        if n % 2 == 1 {
            return None;
        }
        sum = sum.wrapping_add(n);
    }
    Some(sum)
}

/// Turns tracking on (idempotent; never off again in this process).
pub(crate) fn enable() {
    let _ = GATE.compare_exchange(OFF, OPEN, Ordering::SeqCst, Ordering::SeqCst);
}

/// Closes the gate for a swap operation (the caller holds the lock): true if no gated call
/// is running now, none will pass until [`reopen`], and none started since [`calls`]
/// answered `since`; false (the gate left open) otherwise.
pub(crate) fn close(_held: &mut Swapped, since: u64) -> bool {
    if GATE
        .compare_exchange(OPEN, CLOSED, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return false;
    }
    if calls() != Some(since) {
        GATE.store(OPEN, Ordering::SeqCst);
        return false;
    }
    true
}

/// Opens the gate again (the caller holds the lock and brought everything back, or moved
/// nothing).
pub(crate) fn reopen(held: &mut Swapped) {
    held.out = false;
    GATE.store(OPEN, Ordering::SeqCst);
}

/// In a forked child: no thread of the parent is inside a call here, and the child's state
/// is built afresh.
pub(crate) fn reset_in_child() {
    GATE.store(OFF, Ordering::Relaxed);
    pins::reset_in_child();
    if let Ok(mut t) = THREADS.try_lock() {
        t.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    static SERIAL: Mutex<()> = Mutex::new(());

    fn fresh() -> MutexGuard<'static, ()> {
        let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        GATE.store(OFF, Ordering::SeqCst);
        lock().out = false;
        g
    }

    #[test]
    fn off_the_call_just_runs_and_is_not_counted() {
        let _g = fresh();
        let before = calls();
        let r: Result<(), ()> = pass(Kind::Touches, || Ok(()), |_| panic!("no swap-in"));
        assert_eq!(r, Ok(()));
        assert_eq!(calls(), before);
    }

    #[test]
    fn a_call_in_flight_stops_a_swap_operation_and_a_closed_gate_stops_a_call() {
        let _g = fresh();
        enable();
        // Inside a call: the gate cannot close.
        let r: Result<(), ()> = pass(
            Kind::Touches,
            || {
                let mut st = lock();
                assert_eq!(calls(), None, "a running call is seen");
                assert!(!close(&mut st, 0), "closed under a running call");
                assert_eq!(GATE.load(Ordering::SeqCst), OPEN);
                Ok(())
            },
            |_| unreachable!(),
        );
        assert_eq!(r, Ok(()));
        // Closed and swapped out: the next touching call brings memory back first.
        {
            let mut st = lock();
            let since = calls().unwrap();
            assert!(close(&mut st, since));
            st.out = true;
        }
        let swapped_in = AtomicBool::new(false);
        let r: Result<(), ()> = pass(
            Kind::Touches,
            || {
                assert!(swapped_in.load(Ordering::SeqCst), "ran before the swap-in");
                Ok(())
            },
            |st| {
                swapped_in.store(true, Ordering::SeqCst);
                st.out = false;
                Ok(())
            },
        );
        assert_eq!(r, Ok(()));
        assert_eq!(GATE.load(Ordering::SeqCst), OPEN);
    }

    #[test]
    fn a_failed_swap_in_is_the_answer_and_the_gate_stays_closed() {
        let _g = fresh();
        enable();
        {
            let mut st = lock();
            let since = calls().unwrap();
            assert!(close(&mut st, since));
            st.out = true;
        }
        let r: Result<(), &str> = pass(Kind::Touches, || panic!("ran"), |_| Err("no room"));
        assert_eq!(r, Err("no room"));
        assert_eq!(GATE.load(Ordering::SeqCst), CLOSED);
        // A context may still end (the lock is free between operations), and nothing comes
        // back for it.
        let r: Result<(), &str> = pass(
            Kind::Ends(Ends::Context(0x1)),
            || Ok(()),
            |_| unreachable!(),
        );
        assert_eq!(r, Ok(()));
        assert!(lock().out);
        reopen(&mut lock());
    }

    #[test]
    fn a_call_since_the_count_stops_the_close() {
        let _g = fresh();
        enable();
        let since = calls().unwrap();
        let _: Result<(), ()> = pass(Kind::Touches, || Ok(()), |_| Ok(()));
        let mut st = lock();
        assert!(
            !close(&mut st, since),
            "closed though a call came in between"
        );
        assert_eq!(GATE.load(Ordering::SeqCst), OPEN);
        let since = calls().unwrap();
        assert!(close(&mut st, since));
        reopen(&mut st);
    }

    #[test]
    fn a_context_ends_under_the_lock_and_never_swaps_in() {
        let _g = fresh();
        enable();
        let held = lock();
        let ended = Arc::new(AtomicBool::new(false));
        let e = Arc::clone(&ended);
        let t = std::thread::spawn(move || {
            let _: Result<(), ()> = pass(
                Kind::Ends(Ends::Context(0x1)),
                || {
                    e.store(true, Ordering::SeqCst);
                    Ok(())
                },
                |_| unreachable!(),
            );
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !ended.load(Ordering::SeqCst),
            "ended during a swap operation"
        );
        drop(held);
        t.join().unwrap();
        assert!(ended.load(Ordering::SeqCst));
    }

    #[test]
    fn calls_change_with_every_call_and_threads_are_all_counted() {
        let _g = fresh();
        enable();
        let before = calls().unwrap();
        std::thread::spawn(|| {
            let _: Result<(), ()> = pass(Kind::Touches, || Ok(()), |_| Ok(()));
        })
        .join()
        .unwrap();
        let after = calls().unwrap();
        assert_ne!(before, after, "another thread's call went unseen");
    }

    #[test]
    fn many_threads_never_run_a_call_while_the_gate_is_closed() {
        let _g = fresh();
        enable();
        static CLOSED_NOW: AtomicBool = AtomicBool::new(false);
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _: Result<(), ()> = pass(
                            Kind::Touches,
                            || {
                                assert!(!CLOSED_NOW.load(Ordering::SeqCst), "ran while closed");
                                Ok(())
                            },
                            |st| {
                                st.out = false;
                                Ok(())
                            },
                        );
                    }
                })
            })
            .collect();
        let mut closed = 0;
        for _ in 0..2000 {
            let mut st = lock();
            if let Some(since) = calls()
                && close(&mut st, since)
            {
                closed += 1;
                CLOSED_NOW.store(true, Ordering::SeqCst);
                std::thread::yield_now();
                CLOSED_NOW.store(false, Ordering::SeqCst);
                st.out = true; // the next call swaps in and reopens
            }
        }
        stop.store(true, Ordering::Relaxed);
        for w in workers {
            w.join().unwrap();
        }
        // Not asserted: how often the gate closed (timing); the calls' assertion is the test.
        let _ = closed;
        reopen(&mut lock());
    }
}
