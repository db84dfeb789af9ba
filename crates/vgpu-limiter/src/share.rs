//! The board's records and the arithmetic of parts: what each busy container may use.
//!
//! **Invariant.** A container that has work always gets its own guarantee (its
//! `CUDA_DEVICE_SM_LIMIT` in share mode, read from its own file, never from another
//! container): what others publish on the board can only lower what it *borrows* above
//! that. Capacity the busy containers' guarantees leave free, an idle container's included,
//! is lent to the busy containers, the highest priority first (lower `CUDA_TASK_PRIORITY`
//! value = higher priority, as in HAMi: 0 high, 1 low, the default), in proportion to their
//! guarantees within one priority, up to each one's ceiling. A container's record says until
//! when it has work (`busy_until`). Its guarantee stays reserved for [`BoardRules::lend_after`]
//! beyond that (a training loop's host work between steps, a service's between requests, are
//! part of its work: lending every pause would hand its part to whoever has a deeper queue,
//! which is plain time slicing); only what others *borrow* follows `busy_until` at once. A
//! record whose heartbeat is older than [`BoardRules::max_age`] is not a tenant at all, so a
//! dead tenant's claim expires. In cap mode guarantee and ceiling are both the cap.

use crate::traits::Nanos;

/// How the SM limit is read (`VGPU_SM_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmMode {
    /// HAMi's meaning (the default): `CUDA_DEVICE_SM_LIMIT` caps the container's share of
    /// the GPU's time, also when it is alone.
    #[default]
    Cap,
    /// `CUDA_DEVICE_SM_LIMIT` is a guaranteed share while others want the GPU (unset: none,
    /// best effort); idle capacity is lent up to the ceiling (`VGPU_SM_CEILING`, default
    /// 100).
    Share,
}

/// What a container claims on a GPU (from its own configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareClaim {
    /// Guaranteed share, percent (0 = best effort, 100 = the whole GPU).
    pub share_pct: u32,
    /// Most it may use, percent (1..=100, at least the share).
    pub ceiling_pct: u32,
    /// `CUDA_TASK_PRIORITY`: lower is more urgent.
    pub priority: i32,
}

impl ShareClaim {
    /// The claim with its values forced into range: share 0..=100, ceiling share..=100
    /// (and at least 1).
    pub fn sanitized(self) -> Self {
        let share_pct = self.share_pct.min(100);
        Self {
            share_pct,
            ceiling_pct: self.ceiling_pct.clamp(share_pct.max(1), 100),
            priority: self.priority,
        }
    }
}

/// One container's record on the board, as read (hostile input: [`allot`] checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoardRecord {
    /// Its key (the same for every process of the container; never 0).
    pub key: u64,
    /// Its claim.
    pub claim: ShareClaim,
    /// Until when it has work queued or wants to launch (`CLOCK_MONOTONIC` ns).
    pub busy_until: Nanos,
    /// When it last wrote its record.
    pub heartbeat: Nanos,
    /// Its achieved utilization as it last published it, percent.
    pub util_pct: u32,
}

/// What a reader accepts from the board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoardRules {
    /// A record whose heartbeat is older than this is ignored (its writer died or left).
    pub max_age: Nanos,
    /// A heartbeat or demand this far ahead of the reader's clock is not believed.
    pub max_ahead: Nanos,
    /// How long a container's guarantee stays reserved after its demand ran out.
    pub lend_after: Nanos,
}

impl Default for BoardRules {
    fn default() -> Self {
        Self {
            // Three publish periods: one late publish does not drop a live tenant.
            max_age: 300 * 1_000_000,
            // A demand is the end of the queued work plus a grace: milliseconds.
            max_ahead: 10 * 1_000_000,
            // Longer than a training step's host work (ms), a fifth of the lending target
            // (an idle part is lent within 250 ms).
            lend_after: 50 * 1_000_000,
        }
    }
}

/// This container's part of the GPU now, and where it stands among the others.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allotment {
    /// Fraction of the GPU's time it may use now (its guarantee plus what it borrows), with
    /// the guarantees of containers pausing for less than [`BoardRules::lend_after`] kept.
    pub fraction: f64,
    /// Its guarantee (fraction).
    pub guarantee: f64,
    /// A container of higher priority has work: until when its claim runs (the earliest
    /// such `busy_until`, believed up to [`BoardRules::max_ahead`]).
    pub outranked_busy: Option<Nanos>,
    /// A live container of higher priority is on the board (busy or not).
    pub outranked: bool,
    /// A live container of lower priority is on the board (its queue rule reads our demand).
    pub outranks: bool,
    /// Another container is on the board (busy or not).
    pub others_live: bool,
    /// Another container has work.
    pub others_busy: bool,
}

impl Allotment {
    /// Alone: the whole of `claim`'s ceiling.
    pub fn alone(claim: ShareClaim) -> Self {
        let c = claim.sanitized();
        Self {
            fraction: f64::from(c.ceiling_pct) / 100.0,
            guarantee: f64::from(c.share_pct) / 100.0,
            outranked_busy: None,
            outranked: false,
            outranks: false,
            others_live: false,
            others_busy: false,
        }
    }
}

/// This container's allotment among `records` (every record on the GPU's board; its own, if
/// present, is skipped) at `now`; it has work, since it asks. Deterministic: containers
/// that read the same records compute the same parts.
pub fn allot(
    me: u64,
    mine: ShareClaim,
    records: &[BoardRecord],
    now: Nanos,
    rules: BoardRules,
) -> Allotment {
    let mine = mine.sanitized();
    let mut live: Vec<BoardRecord> = Vec::new();
    for t in records {
        let fresh = t.heartbeat <= now.saturating_add(rules.max_ahead)
            && now.saturating_sub(t.heartbeat) <= rules.max_age;
        if t.key == 0 || t.key == me || !fresh || live.iter().any(|l| l.key == t.key) {
            continue;
        }
        live.push(BoardRecord {
            claim: t.claim.sanitized(),
            ..*t
        });
    }
    let outranked = live.iter().any(|t| t.claim.priority < mine.priority);
    let outranks = live.iter().any(|t| t.claim.priority > mine.priority);
    let others_live = !live.is_empty();
    // Present: busy, or idle for less than `lend_after` (the guarantee is kept). Only the
    // busy ones take spare.
    let mut busy: Vec<BoardRecord> = live
        .into_iter()
        .filter(|t| t.busy_until.saturating_add(rules.lend_after) >= now)
        .collect();
    let is_busy = |t: &BoardRecord| t.key == me || t.busy_until >= now;
    let outranked_busy = busy
        .iter()
        .filter(|t| is_busy(t) && t.claim.priority < mine.priority)
        .map(|t| t.busy_until.min(now.saturating_add(rules.max_ahead)))
        .min();
    let others_busy = busy.iter().any(is_busy);
    busy.push(BoardRecord {
        key: me,
        claim: mine,
        busy_until: now,
        heartbeat: now,
        util_pct: 0,
    });
    busy.sort_unstable_by_key(|t| t.key);
    let mine_at = busy
        .iter()
        .position(|t| t.key == me)
        .expect("me is in the list");
    let reserved = water_fill(&busy, mine_at, is_busy);
    let my_guarantee = f64::from(mine.share_pct) / 100.0;
    // Beside a more urgent container that has work, what the urgent ones' guarantees leave
    // (their work comes first through the queue rule, not through our rate).
    let beside_urgent = water_fill(&busy, mine_at, |t| {
        is_busy(t) && t.claim.priority >= mine.priority
    });
    Allotment {
        // Beside a more urgent container with work, a guarantee runs at itself (with a short
        // queue); best effort at what the urgent ones' guarantees leave (one kernel at a time).
        fraction: match outranked_busy {
            Some(_) if my_guarantee <= 0.0 => beside_urgent,
            _ => reserved,
        },
        guarantee: f64::from(mine.share_pct) / 100.0,
        outranked_busy,
        outranked,
        outranks,
        others_live,
        others_busy,
    }
}

/// The part of `present[me]`: every present container's guarantee (its own whole, the others'
/// scaled into what is left if they claim more), then what is left lent to those for which
/// `takes_spare` holds, priority by priority, in proportion to their guarantees, water-filling
/// up to the ceilings.
fn water_fill(
    present: &[BoardRecord],
    me: usize,
    takes_spare: impl Fn(&BoardRecord) -> bool,
) -> f64 {
    let share = |t: &BoardRecord| f64::from(t.claim.share_pct) / 100.0;
    let mine = share(&present[me]);
    let others: f64 = (0..present.len())
        .filter(|&i| i != me)
        .map(|i| share(&present[i]))
        .sum();
    let scale = if others > 1.0 - mine {
        (1.0 - mine) / others
    } else {
        1.0
    };
    let mut part: Vec<f64> = (0..present.len())
        .map(|i| {
            if i == me {
                mine
            } else {
                share(&present[i]) * scale
            }
        })
        .collect();
    let mut spare = (1.0 - part.iter().sum::<f64>()).max(0.0);
    let mut levels: Vec<i32> = present.iter().map(|t| t.claim.priority).collect();
    levels.sort_unstable();
    levels.dedup();
    for level in levels {
        for _ in 0..present.len() {
            if spare <= 1e-9 {
                break;
            }
            let open: Vec<usize> = (0..present.len())
                .filter(|&i| takes_spare(&present[i]) && present[i].claim.priority == level)
                .filter(|&i| part[i] < f64::from(present[i].claim.ceiling_pct) / 100.0 - 1e-9)
                .collect();
            if open.is_empty() {
                break;
            }
            let weight = |i: usize| f64::from(present[i].claim.share_pct.max(1));
            let total: f64 = open.iter().map(|&i| weight(i)).sum();
            let mut given = 0.0;
            for &i in &open {
                let ceiling = f64::from(present[i].claim.ceiling_pct) / 100.0;
                let add = (spare * weight(i) / total).min(ceiling - part[i]);
                part[i] += add;
                given += add;
            }
            spare -= given;
        }
    }
    part[me]
}

/// What this container writes in its record once per publish period (its claim, demand
/// and what `vgpu status` shows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoardReport {
    /// Its claim (the share as its file says now, so `vgpu set-limit` applies).
    pub claim: ShareClaim,
    /// Until when it has work.
    pub busy_until: Nanos,
    /// Its part now, percent (guarantee plus borrowed).
    pub allot_pct: u32,
    /// The mean GPU time of its launches, ns (for `vgpu status`; 0 while unknown).
    pub launch_ns: u64,
    /// Achieved utilization, percent.
    pub util_pct: u32,
    /// GPU time of its guarantee it left to others so far, ns.
    pub lent_ns: u64,
    /// GPU time it used above its guarantee so far, ns.
    pub borrowed_ns: u64,
}

/// The node's board of one GPU: every limited container's record (hostile input: the
/// limiter checks every value, [`crate::share`]).
pub trait NodeBoard {
    /// Writes this container's whole record (once per publish period) and returns its key
    /// with every record on the board; `None` when containers do not coordinate.
    fn publish(&mut self, now: Nanos, report: &BoardReport) -> Option<(u64, Vec<BoardRecord>)>;
    /// Writes this container's `busy_until` if given (in the record [`NodeBoard::publish`]
    /// placed) and returns every record. Called at most every demand poll from the launch
    /// path, so a few system calls at most and no lock.
    fn demand(&mut self, now: Nanos, busy_until: Option<Nanos>) -> Option<Vec<BoardRecord>>;
    /// Takes this container's record off the board (a process leaving).
    fn leave(&mut self) {}
}

/// No board: the container coordinates with nobody.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoBoard;

impl NodeBoard for NoBoard {
    fn publish(&mut self, _: Nanos, _: &BoardReport) -> Option<(u64, Vec<BoardRecord>)> {
        None
    }
    fn demand(&mut self, _: Nanos, _: Option<Nanos>) -> Option<Vec<BoardRecord>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;
    const NOW: Nanos = 10_000 * MS;

    fn claim(share_pct: u32, ceiling_pct: u32, priority: i32) -> ShareClaim {
        ShareClaim {
            share_pct,
            ceiling_pct,
            priority,
        }
    }

    fn record(key: u64, c: ShareClaim, busy: bool) -> BoardRecord {
        BoardRecord {
            key,
            claim: c,
            busy_until: if busy { NOW + MS } else { NOW - MS },
            heartbeat: NOW - MS,
            util_pct: 100,
        }
    }

    fn of(me: u64, mine: ShareClaim, others: &[BoardRecord]) -> Allotment {
        allot(me, mine, others, NOW, BoardRules::default())
    }

    fn near(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn busy_containers_get_their_guarantees_and_idle_ones_lend_theirs() {
        let a = claim(30, 100, 1);
        let b = claim(70, 100, 1);
        let both = of(1, a, &[record(2, b, true)]);
        assert!(near(both.fraction, 0.30) && both.others_busy && !both.outranked);
        // Idle for a moment (its host work between steps): its guarantee stays reserved.
        let paused = of(1, a, &[record(2, b, false)]);
        assert!(near(paused.fraction, 0.30) && !paused.others_busy);
        // Idle for longer than lend_after: lent.
        let mut long_idle = record(2, b, false);
        long_idle.busy_until = NOW - 60 * MS;
        let alone = of(1, a, &[long_idle]);
        assert!(near(alone.fraction, 1.0) && !alone.others_busy);
        // Four at 10/20/30/40, the 10 idle: its 10 goes to the others by their shares.
        let mut idle_ten = record(1, claim(10, 100, 1), false);
        idle_ten.busy_until = NOW - 60 * MS;
        let four = [
            idle_ten,
            record(2, claim(20, 100, 1), true),
            record(3, claim(30, 100, 1), true),
        ];
        let got = of(4, claim(40, 100, 1), &four);
        assert!(near(got.fraction, 0.40 + 0.10 * 40.0 / 90.0), "{got:?}");
    }

    #[test]
    fn ceilings_bound_borrowing_and_the_rest_goes_to_others() {
        let got = of(1, claim(30, 50, 1), &[record(2, claim(20, 100, 1), true)]);
        assert!(near(got.fraction, 0.50), "{got:?}");
        let other = of(2, claim(20, 100, 1), &[record(1, claim(30, 50, 1), true)]);
        assert!(near(other.fraction, 0.50), "{other:?}");
    }

    #[test]
    fn higher_priority_borrows_first_and_lower_keeps_only_its_guarantee() {
        // HAMi: 0 is high. A best-effort (no guarantee) low-priority container's rate is the
        // rest of the GPU beside the high one (its queue rule keeps the high one's work
        // first), and everything while it has none.
        let high = claim(0, 100, 0);
        let low = claim(0, 100, 1);
        let beside = of(2, low, &[record(1, high, true)]);
        assert!(near(beside.fraction, 1.0) && beside.outranked);
        assert_eq!(
            beside.outranked_busy,
            Some(NOW + MS),
            "until the service's claim runs out"
        );
        // Between its requests the spare is ours at once (with a short queue: the plan).
        let gap = of(2, low, &[record(1, high, false)]);
        assert!(near(gap.fraction, 1.0) && gap.outranked && gap.outranked_busy.is_none());
        assert!(near(of(1, high, &[record(2, low, true)]).fraction, 1.0));
        // A low-priority guarantee stays: 10% for the trainer, 90% for the service.
        let guaranteed = of(2, claim(10, 100, 1), &[record(1, high, true)]);
        assert!(near(guaranteed.fraction, 0.10));
        // Beside it, whatever the high one's ceiling, the best-effort one's rate is what the
        // high one's guarantee leaves; what keeps the high one's work first is the queue rule.
        let capped = of(2, low, &[record(1, claim(0, 60, 0), true)]);
        assert!(near(capped.fraction, 1.0), "{capped:?}");
    }

    #[test]
    fn hostile_records_only_shrink_borrowing_never_the_guarantee() {
        let mine = claim(30, 100, 1);
        let greedy = |key| record(key, claim(100, 100, i32::MIN), true);
        // Claims of the whole GPU at the highest priority, many of them, duplicated keys,
        // our own key, key 0: our 30% holds.
        let mut hostile: Vec<BoardRecord> = (2..64).map(greedy).collect();
        hostile.extend([greedy(2), greedy(1), greedy(0)]);
        let got = of(1, mine, &hostile);
        assert!(near(got.fraction, 0.30), "{got:?}");
        // A demand an hour ahead is believed for max_ahead only.
        let mut forged = greedy(70);
        forged.busy_until = NOW + 3_600_000 * MS;
        let beside = of(1, claim(0, 100, 1), &[forged]);
        assert_eq!(beside.outranked_busy, Some(NOW + 10 * MS));
        // Out-of-range values are clamped, not trusted further.
        let odd = record(
            5,
            ShareClaim {
                share_pct: u32::MAX,
                ceiling_pct: 0,
                priority: 1,
            },
            true,
        );
        assert!(near(of(1, mine, &[odd]).fraction, 0.30));
        // Heartbeats from the future or too old are no tenants: we borrow everything.
        let mut future = greedy(6);
        future.heartbeat = NOW + 60 * MS;
        let mut dead = greedy(7);
        dead.heartbeat = NOW - 301 * MS;
        dead.busy_until = u64::MAX;
        assert!(near(of(1, mine, &[future, dead]).fraction, 1.0));
        // A reserved guarantee is a busy_until within lend_after: an hour ahead is no more.
        let mut far = greedy(8);
        far.busy_until = NOW + 3_600_000 * MS;
        assert!(near(of(1, mine, &[far]).fraction, 0.30));
    }

    #[test]
    fn every_busy_container_computes_parts_that_add_up_to_the_gpu() {
        let claims = [claim(10, 100, 1), claim(20, 100, 1), claim(30, 80, 1)];
        let all: Vec<BoardRecord> = claims
            .iter()
            .enumerate()
            .map(|(i, &c)| record(i as u64 + 1, c, true))
            .collect();
        let sum: f64 = all.iter().map(|t| of(t.key, t.claim, &all).fraction).sum();
        assert!(near(sum, 1.0), "{sum}");
    }
}
