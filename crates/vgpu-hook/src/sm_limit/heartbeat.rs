//! Share mode's heartbeat off the launch path (docs/sm-limit.md, "Share mode").
//!
//! A share-mode container writes its record and turn entry from its launches. One that is
//! alive but idle (a service between requests) would otherwise age out of the board after
//! 300 ms: `vgpu status` would stop listing it, and lower priorities would stop being
//! outranked by it. So a background thread (`vgpu-heartbeat`, in share-mode processes only,
//! started when the container first announces itself on a board) asks each device's
//! limiter every [`PERIOD`] for its idle heartbeat (`vgpu_limiter::Limiter::idle_heartbeat`,
//! which writes only after a quiet spell, once per publish period).
//!
//! It never blocks the host program: it only `try_lock`s a limiter (a launch holds it, and a
//! throttled launch sleeps holding it: then that launch publishes itself, and the beat is
//! skipped), and what it does under the lock is the board's bounded I/O (a `flock` waited
//! for at most 1 ms). It stops at exit before the limiters leave the board (a beat after
//! the withdrawal would put the container back for 300 ms), waiting at most [`STOP_WAIT`]
//! for a beat in progress; a forked child, to which the thread was not copied, starts its
//! own when it first announces itself (the thread's controls: [`crate::worker`]).

use std::time::Duration;

use crate::log::{INFO, vlog};
use crate::worker::Worker;

/// How often the thread asks the limiters: twice per publish period, so that an idle
/// record is rewritten within 150 ms of being due (a reader drops it after 300 ms).
const PERIOD: Duration = Duration::from_millis(50);
/// The longest an exiting process waits for a beat in progress (a beat takes microseconds;
/// a board's lock is waited for at most 1 ms).
const STOP_WAIT: Duration = Duration::from_millis(100);

/// The heartbeat thread's controls (one, in the SM limiter's state): a step is one
/// device's beat.
pub(crate) struct Heartbeat {
    worker: Worker,
}

impl Heartbeat {
    pub(crate) const fn new() -> Self {
        Self {
            worker: Worker::new(),
        }
    }

    /// Starts the thread unless it runs; every round it calls `beat(d)` for each device
    /// index `d` below `devices` (`beat` try-locks that device's limiter, if any).
    pub(crate) fn want(&'static self, devices: usize, beat: impl Fn(usize) + Send + 'static) {
        if !self.worker.claim() {
            return;
        }
        if let Err(e) = self
            .worker
            .spawn("vgpu-heartbeat", move |w| run(w, devices, beat))
        {
            // Its launches still publish; only an idle spell ages it out, as before.
            vlog!(
                INFO,
                "cannot start the share-mode heartbeat thread ({e}): an idle container leaves the turn board after 300 ms"
            );
        }
    }

    /// At exit: no beat after this returns, unless one in progress outlasted [`STOP_WAIT`]
    /// (exit never hangs on it).
    pub(crate) fn stop(&self) {
        self.worker.stop(STOP_WAIT);
    }

    /// In the child after `fork`: the thread was not copied; the child's first announcement
    /// in share mode starts it again.
    pub(crate) fn reset_in_child(&self) {
        self.worker.reset_in_child();
    }
}

fn run(worker: &Worker, devices: usize, beat: impl Fn(usize)) {
    loop {
        std::thread::sleep(PERIOD);
        for d in 0..devices {
            // A panicking beat: this device just misses it.
            if worker.step(|| beat(d)).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static BEATS: AtomicUsize = AtomicUsize::new(0);
    static PANICS: AtomicUsize = AtomicUsize::new(0);

    fn count(_: usize) {
        BEATS.fetch_add(1, Ordering::SeqCst);
    }

    fn panics(_: usize) {
        PANICS.fetch_add(1, Ordering::SeqCst);
        panic!("a beat that panics");
    }

    fn wait_for(what: &AtomicUsize, n: usize) {
        let t0 = std::time::Instant::now();
        while what.load(Ordering::SeqCst) < n {
            assert!(t0.elapsed() < Duration::from_secs(10), "no beats");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn beats_every_device_until_stopped_and_starts_once() {
        let hb: &'static Heartbeat = Box::leak(Box::new(Heartbeat::new()));
        hb.want(2, count);
        hb.want(2, count); // running: no second thread
        wait_for(&BEATS, 4);
        hb.stop();
        let after = BEATS.load(Ordering::SeqCst);
        std::thread::sleep(PERIOD * 3);
        assert_eq!(BEATS.load(Ordering::SeqCst), after, "no beat after stop");
    }

    #[test]
    fn a_panicking_beat_does_not_end_the_thread() {
        let hb: &'static Heartbeat = Box::leak(Box::new(Heartbeat::new()));
        hb.want(1, panics);
        wait_for(&PANICS, 3);
        hb.stop();
        assert!(!hb.worker.in_step());
    }
}
