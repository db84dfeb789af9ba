//! The log's rate limit, per kind of line (one `vlog!` call site).
//!
//! **Model.** A log line is for a person reading it, and the tenth identical refusal in a
//! second tells them nothing the first did; a program probing for the largest allocation it
//! can get makes thousands. The kernel's `printk_ratelimit` (10 lines per 5 s per call site)
//! is the precedent followed: a kind of line may write a burst of [`BURST`] lines, then one
//! per [`INTERVAL_NS`] sustained (the same 10 per 5 s). What it suppresses is counted, and
//! the next line of that kind written says how many (at exit, the lines never reported are
//! summed in one line: [`super::say_suppressed_at_exit`]).
//!
//! **Invariant.** At most `BURST` lines of one kind are written in any instant, at most
//! `BURST + t / INTERVAL_NS` in any span `t`, and every suppressed line is counted once:
//! either in the note of exactly one later line of its kind, or still in [`Kind`]'s count.
//! One word holds the state (GCRA, the generic cell rate algorithm: the time from which the
//! bucket is full again), so admission is one compare-and-swap; the count is one add.

use std::sync::atomic::AtomicU64;

use crate::sync::{Ordering, Word};

/// Lines of one kind written back to back before the rate applies.
pub(crate) const BURST: u64 = 10;
/// Sustained: one line of a kind per half second.
pub(crate) const INTERVAL_NS: u64 = 500_000_000;

/// One kind of line: a `static` at its `vlog!` call site.
#[derive(Debug)]
pub(crate) struct Kind<W = AtomicU64> {
    /// `CLOCK_MONOTONIC` ns from which a full burst may be written again (GCRA's theoretical
    /// arrival time); 0 at first.
    full_at: W,
    /// Lines suppressed since the last one written.
    suppressed: W,
}

impl Kind {
    pub(crate) const fn new() -> Self {
        Self {
            full_at: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }
}

/// What to do with one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Write it, noting the lines of its kind suppressed since the last one written.
    Write { suppressed: u64 },
    /// Suppressed (counted).
    Suppress,
}

impl<W: Word> Kind<W> {
    /// The decision for a line of this kind at `now` (`CLOCK_MONOTONIC` ns).
    pub(crate) fn admit(&self, now: u64) -> Admit {
        // The bucket holds BURST lines: a line may start while the backlog it joins is at
        // most BURST - 1 intervals long.
        const TOLERANCE: u64 = (BURST - 1) * INTERVAL_NS;
        let mut full_at = self.full_at.load(Ordering::Relaxed);
        loop {
            let start = full_at.max(now);
            if start - now > TOLERANCE {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return Admit::Suppress;
            }
            match self.full_at.compare_exchange_weak(
                full_at,
                start.saturating_add(INTERVAL_NS),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(seen) => full_at = seen,
            }
        }
        // Each count is taken by exactly one written line (a swap); one that lands after it
        // waits for the next.
        Admit::Write {
            suppressed: self.suppressed.swap(0, Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_000_000_000_000;

    fn writes(k: &Kind, at: u64, n: usize) -> Vec<Admit> {
        (0..n).map(|_| k.admit(at)).collect()
    }

    #[test]
    fn a_burst_then_one_line_per_interval_and_the_count_on_the_next_line() {
        let k = Kind::new();
        let first = writes(&k, T0, 15);
        assert!(
            first[..BURST as usize]
                .iter()
                .all(|a| *a == Admit::Write { suppressed: 0 }),
            "{first:?}"
        );
        assert!(
            first[BURST as usize..]
                .iter()
                .all(|a| *a == Admit::Suppress),
            "{first:?}"
        );
        // Less than an interval later: still suppressed.
        assert_eq!(k.admit(T0 + INTERVAL_NS - 1), Admit::Suppress);
        // One interval later, one line, carrying the 6 suppressed ones.
        assert_eq!(k.admit(T0 + INTERVAL_NS), Admit::Write { suppressed: 6 });
        assert_eq!(k.admit(T0 + INTERVAL_NS), Admit::Suppress);
        // After a quiet spell as long as the burst, a full burst again.
        let later = T0 + (BURST + 1) * INTERVAL_NS;
        let again = writes(&k, later, BURST as usize);
        assert_eq!(again[0], Admit::Write { suppressed: 1 });
        assert!(again[1..].iter().all(|a| matches!(a, Admit::Write { .. })));
        assert_eq!(k.admit(later), Admit::Suppress);
    }

    #[test]
    fn a_steady_flood_writes_burst_plus_elapsed_over_interval() {
        // 5000 lines over 10 s (one every 2 ms): BURST + 10 s / 0.5 s written, the rest
        // counted, and every suppressed line reported by exactly one written line or
        // still pending.
        let k = Kind::new();
        let (mut written, mut reported, mut suppressed) = (0u64, 0u64, 0u64);
        for i in 0..5000u64 {
            match k.admit(T0 + i * 2_000_000) {
                Admit::Write { suppressed: n } => {
                    written += 1;
                    reported += n;
                }
                Admit::Suppress => suppressed += 1,
            }
        }
        assert_eq!(written, BURST + 9_998_000_000 / INTERVAL_NS);
        assert_eq!(written + suppressed, 5000);
        assert_eq!(reported + k.suppressed.load(Ordering::Relaxed), suppressed);
    }

    #[test]
    fn kinds_are_independent_and_a_clock_before_the_last_line_is_harmless() {
        let (a, b) = (Kind::new(), Kind::new());
        writes(&a, T0, 20);
        assert_eq!(b.admit(T0), Admit::Write { suppressed: 0 });
        // A reading earlier than the state's (another thread's later clock read won):
        // judged against the backlog, never an underflow.
        assert_eq!(a.admit(T0 - 1), Admit::Suppress);
        assert_eq!(Kind::new().admit(0), Admit::Write { suppressed: 0 });
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64 as LoomU64;

    #[test]
    fn loom_concurrent_lines_keep_the_burst_and_count_each_suppressed_line_once() {
        loom::model(|| {
            // Two lines of room left in the burst, three threads with a line each (one
            // twice) at one instant: exactly two written, and every suppressed line either
            // reported by one written line or still counted.
            let now = 100 * INTERVAL_NS;
            let k = Arc::new(Kind {
                full_at: LoomU64::new(now + (BURST - 2) * INTERVAL_NS),
                suppressed: LoomU64::new(0),
            });
            let run = |k: Arc<Kind<LoomU64>>, lines: usize| {
                loom::thread::spawn(move || {
                    let (mut written, mut reported, mut suppressed) = (0u64, 0u64, 0u64);
                    for _ in 0..lines {
                        match k.admit(now) {
                            Admit::Write { suppressed: n } => {
                                written += 1;
                                reported += n;
                            }
                            Admit::Suppress => suppressed += 1,
                        }
                    }
                    (written, reported, suppressed)
                })
            };
            let threads = [run(k.clone(), 2), run(k.clone(), 1), run(k.clone(), 1)];
            let (mut written, mut reported, mut suppressed) = (0, 0, 0);
            for t in threads {
                let (w, r, s) = t.join().unwrap();
                written += w;
                reported += r;
                suppressed += s;
            }
            assert_eq!(written, 2, "the burst's room, never more");
            assert_eq!(suppressed, 2);
            assert_eq!(reported + k.suppressed.load(Ordering::Relaxed), suppressed);
        });
    }
}
