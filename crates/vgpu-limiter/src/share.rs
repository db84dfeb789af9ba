//! Share mode: guaranteed shares that lend idle time, and priority between containers.
//!
//! **Invariant.** A container that has work always gets its own guarantee (its
//! `CUDA_DEVICE_SM_LIMIT`, read from its own file, never from another container): what
//! others publish on the turn board can only lower what it *borrows* above that. Capacity
//! that busy containers' guarantees leave free is lent to the busy containers, the highest
//! priority first (lower `CUDA_TASK_PRIORITY` value = higher priority, as in HAMi: 0 high,
//! 1 low, the default), in proportion to their guarantees within one priority, up to each
//! one's ceiling. A container without work gets nothing and is not waited for: its record
//! says until when it has work (`busy_until`), and a record whose heartbeat is older than
//! [`ShareRules::max_age`] is not a tenant at all, so a dead tenant's claim expires.
//!
//! This module is the pure arithmetic ([`allot`]); the limiter polls the board through
//! [`crate::ContainerView::share_board`] and [`crate::ContainerView::share_demand`], and
//! lays the busy containers' allotments out as turns ([`crate::Turn::layout_shared`]).

use crate::traits::{ContainerView, Nanos, Turn, TurnTenant, WHOLE_BP};

/// How the SM limit is read (`VGPU_SM_MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmMode {
    /// HAMi's meaning (the default): `CUDA_DEVICE_SM_LIMIT` is a cap, held also when the
    /// container is alone; `CUDA_TASK_PRIORITY` is only written for HAMi's monitor.
    #[default]
    Cap,
    /// `CUDA_DEVICE_SM_LIMIT` is a guaranteed share while others want the GPU (unset: none,
    /// best effort); idle capacity is lent up to the ceiling (`VGPU_SM_CEILING`, default
    /// 100); `CUDA_TASK_PRIORITY` orders who borrows first.
    Share,
}

/// What this container claims on a GPU in share mode (from its own configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareClaim {
    /// Guaranteed share, percent (0 = best effort, 100 = the whole GPU).
    pub share_pct: u32,
    /// Most it may borrow up to, percent (1..=100, at least the share).
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
pub struct ShareTenant {
    /// Its key (the same for every process of the container; never 0).
    pub key: u64,
    /// Its claim.
    pub claim: ShareClaim,
    /// GPU time of its typical launch, ns (sets the turn cycle).
    pub launch_ns: u64,
    /// Until when it has work queued or wants to launch (`CLOCK_MONOTONIC` ns).
    pub busy_until: Nanos,
    /// When it last wrote its record.
    pub heartbeat: Nanos,
    /// Its achieved utilization as it last published it, percent (a record that cannot
    /// say: 100).
    pub util_pct: u32,
}

/// What a reader accepts from the board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareRules {
    /// A record whose heartbeat is older than this is ignored (its writer died or left).
    pub max_age: Nanos,
    /// A heartbeat or demand this far ahead of the reader's clock is not believed.
    pub max_ahead: Nanos,
    /// A busy container whose demand ends within this of now has little queued (its
    /// `busy_until` is its queue's end plus the idle grace): one held by priority may fill
    /// its gaps. A dense burst queues further ahead and is not filled.
    pub sparse_within: Nanos,
    /// How long a container stays outranked by a higher-priority one whose record went
    /// quiet but was not withdrawn. A service whose requests come further apart than
    /// `max_age` is no tenant when each one arrives; without this memory the best-effort
    /// container's queue would be as deep as its pacer allows (about 10 ms in the model) by
    /// then, and the request would wait behind it.
    pub rank_memory: Nanos,
}

impl Default for ShareRules {
    fn default() -> Self {
        Self {
            max_age: 300 * 1_000_000,
            max_ahead: 10 * 1_000_000,
            // Set when the idle grace was 2 ms (plus the outranked queue, 0.5 ms); with the
            // 0.5 ms grace it also counts a service with up to 2 ms queued as sparse. Kept:
            // the H200's table 4 passed with it (run 10, 2026-12-01).
            sparse_within: 2_500_000,
            rank_memory: 10_000_000_000,
        }
    }
}

/// This container's part of the GPU now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Allotment {
    /// Fraction of the GPU's time it may use now (its guarantee plus what it borrows).
    pub fraction: f64,
    /// Its guarantee as laid out (fraction).
    pub guarantee: f64,
    /// Its turn among the busy containers with a part, if there are at least two.
    pub turn: Option<Turn>,
    /// A live container of higher priority is on the board (busy or not): keep the queue
    /// short, so that its next work does not wait long behind ours.
    pub outranked: bool,
    /// Another container borrows (gets more than its guarantee) now.
    pub others_borrow: bool,
    /// Held by priority (no part), but the busy containers leave gaps: little queued
    /// ([`ShareRules::sparse_within`]) and their published utilization sums to at most
    /// [`GAP_FILL_BELOW`]. Launch with the outranked queue.
    pub gap_fill: bool,
    /// Without a part: when the first busy container with a part may have run out of work
    /// (just after its `busy_until`), so the layout may change; 0 with a part.
    pub hold_until: Nanos,
}

/// A container held by priority fills the gaps of busy containers whose published
/// utilization sums to at most this: a launch-bound service (batch-1 inference) leaves its
/// host time between kernels idle, far shorter than the board can show, while a dense one
/// (a kernel loop) leaves none. Utilization is measured over segments that span those host
/// gaps, so a sparse service reads high (48% for a true 21% in the model): the bound is
/// loose on purpose.
pub const GAP_FILL_BELOW: f64 = 0.8;

/// This container's allotment among `others` (every record on the GPU's board; its own, if
/// present, is skipped) at `now`; it has work, since it asks. Deterministic: containers
/// that read the same records compute the same layout.
pub fn allot(
    me: u64,
    mine: ShareClaim,
    my_launch_ns: u64,
    others: &[ShareTenant],
    now: Nanos,
    rules: ShareRules,
    min_cycle: Nanos,
) -> Allotment {
    let mine = mine.sanitized();
    let mut live: Vec<ShareTenant> = Vec::new();
    for t in others {
        let fresh = t.heartbeat <= now.saturating_add(rules.max_ahead)
            && now.saturating_sub(t.heartbeat) <= rules.max_age;
        if t.key == 0 || t.key == me || !fresh || live.iter().any(|l| l.key == t.key) {
            continue;
        }
        live.push(ShareTenant {
            claim: t.claim.sanitized(),
            ..*t
        });
    }
    let outranked = live.iter().any(|t| t.claim.priority < mine.priority);
    // A busy_until far ahead is believed only up to the heartbeat's expiry: the record
    // stops counting with its heartbeat anyway.
    let mut busy: Vec<ShareTenant> = live.into_iter().filter(|t| t.busy_until >= now).collect();
    busy.push(ShareTenant {
        key: me,
        claim: mine,
        launch_ns: my_launch_ns,
        busy_until: now,
        heartbeat: now,
        util_pct: 0,
    });
    busy.sort_unstable_by_key(|t| t.key);

    // Guarantees: mine whole; the others' scaled into what is left if they claim more.
    let my_share = f64::from(mine.share_pct) / 100.0;
    let others_claimed: f64 = busy
        .iter()
        .filter(|t| t.key != me)
        .map(|t| f64::from(t.claim.share_pct) / 100.0)
        .sum();
    let room = 1.0 - my_share;
    let scale = if others_claimed > room {
        room / others_claimed
    } else {
        1.0
    };
    let mut part: Vec<f64> = busy
        .iter()
        .map(|t| {
            let g = f64::from(t.claim.share_pct) / 100.0;
            if t.key == me { g } else { g * scale }
        })
        .collect();
    let guarantee: Vec<f64> = part.clone();

    // Lend what is left, priority by priority, water-filling up to the ceilings.
    let mut spare = (1.0 - part.iter().sum::<f64>()).max(0.0);
    let mut levels: Vec<i32> = busy.iter().map(|t| t.claim.priority).collect();
    levels.sort_unstable();
    levels.dedup();
    for level in levels {
        for _ in 0..busy.len() {
            if spare <= 1e-9 {
                break;
            }
            let open: Vec<usize> = (0..busy.len())
                .filter(|&i| busy[i].claim.priority == level)
                .filter(|&i| part[i] < f64::from(busy[i].claim.ceiling_pct) / 100.0 - 1e-9)
                .collect();
            if open.is_empty() {
                break;
            }
            let weight = |i: usize| f64::from(busy[i].claim.share_pct.max(1));
            let total: f64 = open.iter().map(|&i| weight(i)).sum();
            let mut given = 0.0;
            for &i in &open {
                let ceiling = f64::from(busy[i].claim.ceiling_pct) / 100.0;
                let add = (spare * weight(i) / total).min(ceiling - part[i]);
                part[i] += add;
                given += add;
            }
            spare -= given;
        }
    }

    let mine_at = busy
        .iter()
        .position(|t| t.key == me)
        .expect("me is in the list");
    let others_borrow = (0..busy.len()).any(|i| i != mine_at && part[i] > guarantee[i] + 1e-6);
    // Turns among the busy containers that have a part (rounded to a basis point, so that
    // everyone rounds alike; at least 1 for a part that rounds to nothing).
    let tenants: Vec<TurnTenant> = (0..busy.len())
        .filter(|&i| part[i] > 1e-6)
        .map(|i| TurnTenant {
            key: busy[i].key,
            part_bp: ((part[i] * WHOLE_BP as f64).round() as u32).max(1),
            launch_ns: busy[i].launch_ns,
        })
        .collect();
    let turn = if part[mine_at] > 1e-6 {
        Turn::layout_shared(me, &tenants, min_cycle)
    } else {
        None
    };
    let gap_fill = outranked && part[mine_at] <= 1e-6 && {
        let others = (0..busy.len()).filter(|&i| i != mine_at);
        let used: f64 = others
            .clone()
            .map(|i| f64::from(busy[i].util_pct.min(100)) / 100.0)
            .sum();
        let sparse = others
            .into_iter()
            .all(|i| busy[i].busy_until <= now.saturating_add(rules.sparse_within));
        used <= GAP_FILL_BELOW && sparse
    };
    let hold_until = if part[mine_at] <= 1e-6 {
        (0..busy.len())
            .filter(|&i| i != mine_at && part[i] > 1e-6)
            // The first instant its claim no longer counts.
            .map(|i| busy[i].busy_until.saturating_add(1))
            .min()
            .unwrap_or(now)
    } else {
        0
    };
    Allotment {
        fraction: part[mine_at],
        guarantee: guarantee[mine_at],
        turn,
        outranked,
        others_borrow,
        gap_fill,
        hold_until,
    }
}

/// Whether a container of higher priority than `mine` left a record within
/// [`ShareRules::rank_memory`] of `now` that is still on the board: it went quiet (a service
/// between sparse requests writes nothing), it did not leave (a leaving process withdraws its
/// record). Derived from the records each time, so a live priority change applies at once.
fn rank_remembered(
    me: u64,
    mine: ShareClaim,
    records: &[ShareTenant],
    now: Nanos,
    rules: ShareRules,
) -> bool {
    records.iter().any(|t| {
        t.key != 0
            && t.key != me
            && t.claim.priority < mine.priority
            && t.heartbeat <= now.saturating_add(rules.max_ahead)
            && now.saturating_sub(t.heartbeat) <= rules.rank_memory
    })
}

/// What this container writes in its record once per publish period (its claim, demand
/// and what `vgpu status` shows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareReport {
    /// Its claim (the share as its file says now, so `vgpu set-limit` applies).
    pub claim: ShareClaim,
    /// GPU time of its typical launch, ns.
    pub launch_ns: u64,
    /// Until when it has work.
    pub busy_until: Nanos,
    /// Its part now, percent (guarantee plus borrowed).
    pub allot_pct: u32,
    /// Achieved utilization, percent.
    pub util_pct: u32,
    /// GPU time of its guarantee it left to borrowers so far, ns.
    pub lent_ns: u64,
    /// GPU time it used above its guarantee so far, ns.
    pub borrowed_ns: u64,
}

/// The limiter's share-mode state: the board as last read and this container's part.
#[derive(Debug, Default)]
pub(crate) struct Sharing {
    key: Option<u64>,
    tenants: Vec<ShareTenant>,
    next_demand: Nanos,
    /// The `busy_until` last written (0: none).
    published_busy: Nanos,
    pub(crate) allot: Option<Allotment>,
    pub(crate) lent_ns: f64,
    pub(crate) borrowed_ns: f64,
}

/// Share-mode timing (from [`crate::LimiterConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShareTiming {
    pub demand_poll: Nanos,
    pub idle_grace: Nanos,
    pub idle_grace_in_turns: Nanos,
    pub min_cycle: Nanos,
    pub rules: ShareRules,
}

impl Sharing {
    /// Whether the container announced itself on a board (its last publish reached one).
    pub(crate) fn announced(&self) -> bool {
        self.key().is_some()
    }

    /// The key it announced itself with, if it did.
    pub(crate) fn key(&self) -> Option<u64> {
        self.key
    }

    /// The demand (`busy_until`) last written to the record.
    pub(crate) fn published_busy(&self) -> Nanos {
        self.published_busy
    }

    /// Once per publish period: accounts the bin just ended (`busy` ns of GPU time in
    /// `elapsed` ns), then writes the full record and reads every record (under the
    /// board's lock).
    pub(crate) fn publish<V: ContainerView>(
        &mut self,
        view: &mut V,
        now: Nanos,
        mut report: ShareReport,
        busy: f64,
        elapsed: Nanos,
        rules: ShareRules,
    ) {
        report.lent_ns = self.lent_ns as u64;
        report.borrowed_ns = self.borrowed_ns as u64;
        self.published_busy = report.busy_until;
        match view.share_board(now, &report) {
            Some((key, tenants)) => {
                self.key = Some(key);
                self.tenants = tenants;
            }
            None => {
                self.key = None;
                self.tenants.clear();
            }
        }
        // The bin just ended: GPU time above the guarantee was borrowed; guarantee left
        // unused while another container had work (and so could use it) was lent. After an
        // idle spell the bin spans the spell.
        let bin_start = now.saturating_sub(elapsed);
        let fair = f64::from(report.claim.share_pct) / 100.0 * elapsed as f64;
        let someone_busy = self.tenants.iter().any(|t| {
            Some(t.key) != self.key
                && t.busy_until >= bin_start
                && now.saturating_sub(t.heartbeat) <= rules.max_age
        });
        if busy > fair {
            self.borrowed_ns += busy - fair;
        } else if someone_busy {
            self.lent_ns += fair - busy;
        }
        // Recompute now, with the fresh records.
        self.next_demand = now;
    }

    /// At most every `demand_poll`: writes this container's demand if the last one runs
    /// out soon, reads the others' and recomputes its part. Returns the part.
    pub(crate) fn step<V: ContainerView>(
        &mut self,
        view: &mut V,
        now: Nanos,
        claim: ShareClaim,
        launch_ns: u64,
        horizon: f64,
        t: ShareTiming,
    ) -> Allotment {
        if let (Some(a), true) = (self.allot, now < self.next_demand) {
            return a;
        }
        // Outranked, look more often: the urgent container's work must not queue behind
        // ours for long.
        let outranked = self.allot.is_some_and(|a| a.outranked);
        self.next_demand = now
            + if outranked {
                t.demand_poll / 5
            } else {
                t.demand_poll
            };
        let me = self.key.unwrap_or(1);
        if self.key.is_some() {
            let grace = match self.allot {
                Some(a) if a.turn.is_some() => t.idle_grace_in_turns,
                _ => t.idle_grace,
            };
            let busy_until = (horizon.max(now as f64) as Nanos).saturating_add(grace);
            // Rewritten once it extends the published value by half a grace: the record
            // then never runs out while work is queued or launches come closer than that.
            let write =
                (busy_until > self.published_busy.saturating_add(grace / 2)).then_some(busy_until);
            if let Some(b) = write {
                self.published_busy = b;
            }
            if let Some(records) = view.share_demand(now, write) {
                self.tenants = records;
            }
        }
        // The launch length others read in our record, not our latest estimate: the turn
        // cycle depends on it, and all must compute the same cycle.
        let launch_ns = self
            .tenants
            .iter()
            .find(|r| Some(r.key) == self.key)
            .map_or(launch_ns, |r| r.launch_ns);
        let mut a = allot(
            me,
            claim,
            launch_ns,
            &self.tenants,
            now,
            t.rules,
            t.min_cycle,
        );
        if !a.outranked && rank_remembered(me, claim, &self.tenants, now, t.rules) {
            // A higher one was here lately and did not leave: it may be between requests.
            a.outranked = true;
        }
        if a.hold_until > now {
            // Held: look again as soon as the holder's claim may have run out.
            self.next_demand = self.next_demand.min(a.hold_until);
        }
        self.allot = Some(a);
        a
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

    fn tenant(key: u64, c: ShareClaim, busy: bool) -> ShareTenant {
        ShareTenant {
            key,
            claim: c,
            launch_ns: 50_000,
            busy_until: if busy { NOW + MS } else { NOW - MS },
            heartbeat: NOW - MS,
            util_pct: 100,
        }
    }

    fn of(me: u64, mine: ShareClaim, others: &[ShareTenant]) -> Allotment {
        allot(
            me,
            mine,
            50_000,
            others,
            NOW,
            ShareRules::default(),
            20 * MS,
        )
    }

    fn near(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn busy_containers_get_their_guarantees_and_idle_ones_lend_theirs() {
        let a = claim(30, 100, 1);
        let b = claim(70, 100, 1);
        let both = of(1, a, &[tenant(2, b, true)]);
        assert!(near(both.fraction, 0.30) && both.turn.is_some() && !both.others_borrow);
        let alone = of(1, a, &[tenant(2, b, false)]);
        assert!(near(alone.fraction, 1.0) && alone.turn.is_none());
        // Four at 10/20/30/40, the 10 idle: its 10 goes to the others by their shares.
        let four = [
            tenant(1, claim(10, 100, 1), false),
            tenant(2, claim(20, 100, 1), true),
            tenant(3, claim(30, 100, 1), true),
        ];
        let got = of(4, claim(40, 100, 1), &four);
        assert!(near(got.fraction, 0.40 + 0.10 * 40.0 / 90.0), "{got:?}");
        assert!(got.others_borrow);
    }

    #[test]
    fn ceilings_bound_borrowing_and_the_rest_goes_to_others() {
        let got = of(1, claim(30, 50, 1), &[tenant(2, claim(20, 100, 1), true)]);
        assert!(near(got.fraction, 0.50), "{got:?}");
        let other = of(2, claim(20, 100, 1), &[tenant(1, claim(30, 50, 1), true)]);
        assert!(near(other.fraction, 0.50), "{other:?}");
    }

    #[test]
    fn higher_priority_borrows_first_and_lower_keeps_only_its_guarantee() {
        // HAMi: 0 is high. A best-effort (no guarantee) low-priority container is held
        // while the high one has work, and gets everything while it has none.
        let high = claim(0, 100, 0);
        let low = claim(0, 100, 1);
        let held = of(2, low, &[tenant(1, high, true)]);
        assert!(near(held.fraction, 0.0) && held.outranked && held.turn.is_none());
        assert_eq!(
            held.hold_until,
            NOW + MS + 1,
            "held until the service's claim runs out"
        );
        let gap = of(2, low, &[tenant(1, high, false)]);
        assert!(near(gap.fraction, 1.0) && gap.outranked && gap.hold_until == 0);
        assert!(near(of(1, high, &[tenant(2, low, true)]).fraction, 1.0));
        // A low-priority guarantee stays: 10% for the trainer, 90% for the service.
        let guaranteed = of(2, claim(10, 100, 1), &[tenant(1, high, true)]);
        assert!(near(guaranteed.fraction, 0.10) && guaranteed.turn.is_some());
        // The high one's ceiling leaves the rest to the lower one.
        let capped = of(2, low, &[tenant(1, claim(0, 60, 0), true)]);
        assert!(near(capped.fraction, 0.40), "{capped:?}");
    }

    #[test]
    fn hostile_records_only_shrink_borrowing_never_the_guarantee() {
        let mine = claim(30, 100, 1);
        let greedy = |key| tenant(key, claim(100, 100, i32::MIN), true);
        // Claims of the whole GPU at the highest priority, many of them, duplicated keys,
        // our own key, key 0: our 30% holds.
        let hostile = [greedy(2), greedy(3), greedy(2), greedy(1), greedy(0)];
        let got = of(1, mine, &hostile);
        assert!(near(got.fraction, 0.30), "{got:?}");
        // Out-of-range values are clamped, not trusted further.
        let odd = tenant(
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
    }

    #[test]
    fn every_busy_container_computes_the_same_layout() {
        let claims = [claim(10, 100, 1), claim(20, 100, 1), claim(30, 80, 1)];
        let all: Vec<ShareTenant> = claims
            .iter()
            .enumerate()
            .map(|(i, &c)| tenant(i as u64 + 1, c, true))
            .collect();
        let turns: Vec<Turn> = all
            .iter()
            .map(|t| of(t.key, t.claim, &all).turn.expect("three busy: turns"))
            .collect();
        let mut covered = 0;
        for (i, t) in turns.iter().enumerate() {
            assert_eq!(t.cycle, turns[0].cycle);
            assert_eq!(t.offset, covered, "window {i} follows the previous one");
            covered += t.width;
        }
        assert!(covered <= turns[0].cycle);
        assert!(
            covered * 100 >= turns[0].cycle * 98,
            "the spare is lent out"
        );
    }
}
