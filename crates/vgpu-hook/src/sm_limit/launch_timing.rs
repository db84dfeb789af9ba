//! Where a limited launch's host time goes, for a diagnostic build only (`cargo build
//! --release -p vgpu-hook --features launch-timing`): each part of the limited launch path
//! adds its wall time to a counter, and the limiter's report at exit says them per launch.
//! `gpu-tests/compute/launch_cost.sh` prints the line. Product builds compile none of it: the
//! [`timed`] macro is then its expression.
//!
//! Parts: the stream's device (`device`), the capture query (`capture`), the limiter's
//! admission with its lock and any waits (`admit`), the driver's launch (`launch`), the
//! limiter's accounting after it (`after`), and, inside admission and accounting, the driver's
//! event calls (`events`: records, queries and elapsed times).

#[cfg(feature = "launch-timing")]
mod on {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Instant;

    /// The parts, in report order.
    pub(crate) const PARTS: [&str; 6] = ["device", "capture", "admit", "launch", "after", "events"];

    static NS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
    static LAUNCHES: AtomicU64 = AtomicU64::new(0);

    /// Adds the wall time of `f` to part `i`.
    #[inline(always)]
    pub(crate) fn time<T>(i: usize, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        NS[i].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// One limited launch went through the path.
    pub(crate) fn launched() {
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
    }

    /// The report line: each part's mean host time per limited launch, ns.
    pub(crate) fn report() -> Option<String> {
        let n = LAUNCHES.load(Ordering::Relaxed);
        if n == 0 {
            return None;
        }
        let parts: Vec<String> = PARTS
            .iter()
            .zip(NS.iter())
            .map(|(p, ns)| format!("{p} {:.0}", ns.load(Ordering::Relaxed) as f64 / n as f64))
            .collect();
        Some(format!(
            "launch timing over {n} limited launches, ns per launch: {}",
            parts.join(", ")
        ))
    }
}

#[cfg(feature = "launch-timing")]
pub(crate) use on::{launched, report, time};

/// The parts' indices (see the module's docs).
pub(crate) mod part {
    pub(crate) const DEVICE: usize = 0;
    pub(crate) const CAPTURE: usize = 1;
    pub(crate) const ADMIT: usize = 2;
    pub(crate) const LAUNCH: usize = 3;
    pub(crate) const AFTER: usize = 4;
    pub(crate) const EVENTS: usize = 5;
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
            .and_then(|v| v.parse().ok())
            .expect("a launch figure");
        assert!(launch >= 2e6, "{line}");
    }
}
