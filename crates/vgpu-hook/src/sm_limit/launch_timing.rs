//! Where a limited launch's host time goes, for a diagnostic build only (`cargo build
//! --release -p vgpu-hook --features launch-timing`): each part of the limited launch path
//! adds its wall time to a counter, and the limiter's report at exit says them per launch.
//! `gpu-tests/compute/launch_cost.sh` prints the line. Product builds compile none of it: the
//! [`timed`] macro is then its expression.
//!
//! Parts: the stream's device (`device`), the capture query (`capture`), the limiter's
//! admission with its lock (`admit`, less its sleeps), the sleeps of admissions that waited
//! (`wait`), the driver's launch (`launch`), the limiter's accounting after it (`after`), and,
//! inside admission and accounting, the driver's event calls (`record` with the context query
//! before it, `query`, `elapsed`). Each part also counts its calls, so a part's cost per call
//! and how often the path takes it are told apart.

#[cfg(feature = "launch-timing")]
mod on {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    /// The parts, in report order.
    pub(crate) const PARTS: [&str; 9] = [
        "device", "capture", "admit", "wait", "launch", "after", "record", "query", "elapsed",
    ];
    const N: usize = PARTS.len();

    static NS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
    static CALLS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
    static LAUNCHES: AtomicU64 = AtomicU64::new(0);

    /// Adds the wall time of `f` to part `i`.
    #[inline(always)]
    pub(crate) fn time<T>(i: usize, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        let ns = t.elapsed().as_nanos() as u64;
        NS[i].fetch_add(ns, Ordering::Relaxed);
        CALLS[i].fetch_add(1, Ordering::Relaxed);
        THREAD_NS.with(|t| t[i].set(t[i].get() + ns));
        out
    }

    thread_local! {
        /// Each part's time on this thread, ns (nested parts are taken out of their outer
        /// part by thread, never another thread's).
        static THREAD_NS: [std::cell::Cell<u64>; N] = const { [const { std::cell::Cell::new(0) }; N] };
    }

    /// Takes `ns` out of part `i` (time of a nested part counted on its own).
    pub(crate) fn untime(i: usize, ns: u64) {
        NS[i].fetch_sub(ns, Ordering::Relaxed);
    }

    /// Part `i`'s time so far on this thread, ns (to take a nested part's time out of its
    /// outer one).
    pub(crate) fn total(i: usize) -> u64 {
        THREAD_NS.with(|t| t[i].get())
    }

    /// One limited launch went through the path.
    pub(crate) fn launched() {
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
    }

    /// The report line: each part's mean host time per limited launch, ns, and its calls
    /// per launch (`admit` excludes `wait`, which the caller takes out).
    pub(crate) fn report() -> Option<String> {
        let n = LAUNCHES.load(Ordering::Relaxed);
        if n == 0 {
            return None;
        }
        let parts: Vec<String> = (0..N)
            .map(|i| {
                let ns = NS[i].load(Ordering::Relaxed) as f64 / n as f64;
                let calls = CALLS[i].load(Ordering::Relaxed) as f64 / n as f64;
                format!("{} {ns:.0} ({calls:.3})", PARTS[i])
            })
            .collect();
        Some(format!(
            "launch timing over {n} limited launches, ns per launch (calls per launch): {}",
            parts.join(", ")
        ))
    }
}

#[cfg(feature = "launch-timing")]
pub(crate) use on::{launched, report, time, total, untime};

/// Ablations for the diagnostic build only (never read by a product build): what part of a
/// limited launch's cost on a real workload is its markers, and what segment size costs.
/// `VGPU_DIAG_NO_EVENTS=1`: no marker is ever recorded (nothing is measured; launches are
/// charged nothing known); `VGPU_DIAG_SEGMENT_WORK=<ns>`: the segments' size;
/// `VGPU_DIAG_EVENT_FLAGS=<n>`: the flags the markers' events are created with (2 =
/// `CU_EVENT_DISABLE_TIMING`: every marker is recorded and asked about, none can be timed).
#[cfg(feature = "launch-timing")]
pub(crate) mod diag {
    pub(crate) fn no_events() -> bool {
        static NO: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *NO.get_or_init(|| std::env::var("VGPU_DIAG_NO_EVENTS").is_ok_and(|v| v == "1"))
    }

    pub(crate) fn event_flags() -> u32 {
        static FLAGS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        *FLAGS.get_or_init(|| {
            std::env::var("VGPU_DIAG_EVENT_FLAGS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        })
    }

    pub(crate) fn tune(cfg: &mut vgpu_limiter::LimiterConfig) {
        if let Some(ns) = std::env::var("VGPU_DIAG_SEGMENT_WORK")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            cfg.segment_work = ns;
        }
    }
}

/// The parts' indices (see the module's docs).
pub(crate) mod part {
    pub(crate) const DEVICE: usize = 0;
    pub(crate) const CAPTURE: usize = 1;
    pub(crate) const ADMIT: usize = 2;
    pub(crate) const WAIT: usize = 3;
    pub(crate) const LAUNCH: usize = 4;
    pub(crate) const AFTER: usize = 5;
    pub(crate) const RECORD: usize = 6;
    pub(crate) const QUERY: usize = 7;
    pub(crate) const ELAPSED: usize = 8;
}

/// `$e`, its wall time added to part `$part` in a `launch-timing` build.
macro_rules! timed {
    ($part:expr, $e:expr) => {{
        #[cfg(feature = "launch-timing")]
        {
            $crate::sm_limit::launch_timing::time($part, || $e)
        }
        #[cfg(not(feature = "launch-timing"))]
        {
            let _: usize = $part;
            $e
        }
    }};
}
pub(crate) use timed;

#[cfg(all(test, feature = "launch-timing"))]
mod tests {
    use super::*;

    #[test]
    fn the_report_divides_each_part_by_the_launches() {
        time(part::LAUNCH, || {
            std::thread::sleep(std::time::Duration::from_millis(2))
        });
        launched();
        let line = report().expect("one launch");
        let launch: f64 = line
            .split_once(": ")
            .and_then(|(_, parts)| parts.split(", ").find_map(|p| p.strip_prefix("launch ")))
            .and_then(|v| v.split_once(' '))
            .and_then(|(ns, _)| ns.parse().ok())
            .expect("a launch figure");
        assert!(launch >= 2e6, "{line}");
    }
}
