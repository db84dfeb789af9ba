//! Ctrl-C for `vgpu watch`: a flag set by SIGINT/SIGTERM, checked between refreshes, so the
//! command ends after a complete frame with exit code 0.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_signal: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::Relaxed);
}

/// Route SIGINT and SIGTERM to the stop flag.
pub fn install_stop_handler() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic; sigaction is given a zeroed, then
        // filled, struct; no SA_RESTART so sleeps end early.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction =
                on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// Put SIGPIPE back to its default action. Rust programs start with SIGPIPE ignored, and
/// an ignored signal stays ignored across `exec`: without this, a program started by
/// `vgpu run` would get EPIPE errors where it expects to die quietly (`yes | head`).
pub fn restore_default_sigpipe() {
    // SAFETY: setting a signal to its default action has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Whether a stop signal arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Sleep for `duration` unless a stop signal arrives; returns false if one did.
pub fn sleep_unless_stopped(duration: Duration) -> bool {
    let end = Instant::now() + duration;
    while !stop_requested() {
        let now = Instant::now();
        if now >= end {
            return true;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(50)));
    }
    false
}
