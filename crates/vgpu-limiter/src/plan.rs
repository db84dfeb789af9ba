//! The admission plan: what a container may do now, computed once from its claim and one
//! snapshot of the board, then applied by the limiter's gates.
//!
//! **Model.** The GPU runs one context at a time and cannot be preempted by us: work that is
//! queued runs, and a newcomer's kernel waits behind it (or until the running context's time
//! slice ends). So a container can be given two things only: a *rate* (the share of the
//! GPU's time its kernels may take, enforced by pacing its launches on their measured cost)
//! and a *queue depth* (how much of its work may wait on the GPU at once, which is how long
//! a more urgent container's next kernel may have to wait behind it). Every rule of cap
//! mode, share mode and priority is one of these two:
//! - the rate is the cap (cap mode), or the container's part of the busy containers'
//!   guarantees and of what they leave (share mode, [`crate::share::allot`]);
//! - the queue is a burst deep ([`QueueRule::Paced`]: one time slice of work, so each turn
//!   it takes beside a deep neighbour costs one context switch, as time slicing's do), unless
//!   a container of higher priority is on the board: then at most a short queue
//!   ([`QueueRule::Short`]), so that its next work waits at most that plus the kernel
//!   running, and while it has work one kernel at a time ([`QueueRule::Single`]): each of
//!   its kernels waits at most the one of ours running. Nothing is held back for priority
//!   beyond that: a held container would leave the GPU idle in the service's host time,
//!   which is most of a launch-bound service's request; only a rate of zero (others'
//!   guarantees take the whole GPU) holds launches ([`QueueRule::Hold`]).

use crate::share::Allotment;
use crate::traits::Nanos;

/// How much of this container's work may be queued on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRule {
    /// As the pacer allows: about one control period of the rate.
    Paced,
    /// At most the short queue (a more urgent container is on the board).
    Short,
    /// One kernel at a time: launch only when nothing of ours is queued (a more urgent
    /// container has work: each of its kernels waits at most the one of ours running).
    Single,
    /// Nothing new until this instant (a more urgent container has work, or nothing is
    /// left to borrow), unless the wait has lasted the longest hold.
    Hold {
        /// When the claim that holds us runs out.
        until: Nanos,
    },
}

/// What a container may do now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Fraction of the GPU's time its kernels may take (before its processes split it).
    pub rate: f64,
    /// How deep its queue may be.
    pub queue: QueueRule,
    /// Nobody else is on the board.
    pub alone: bool,
}

impl Plan {
    /// The plan of a container whose allotment is `a` at `now`.
    pub fn of(a: &Allotment, now: Nanos) -> Plan {
        let rate = a.fraction;
        let queue = match a.outranked_busy {
            _ if rate <= 0.0 => QueueRule::Hold {
                until: a.outranked_busy.unwrap_or(now).max(now),
            },
            None if !a.outranked => QueueRule::Paced,
            // A more urgent container is on the board: its next work waits at most our short
            // queue plus the kernel running.
            None => QueueRule::Short,
            // ... and while it has work, at most the kernel running; a guarantee of ours keeps
            // the short queue (a guarantee is never taken by priority).
            Some(_) if a.guarantee > 0.0 => QueueRule::Short,
            Some(_) => QueueRule::Single,
        };
        Plan {
            rate,
            queue,
            alone: !a.others_live,
        }
    }

    /// Whether nothing limits this container now: the whole GPU and nobody else on the
    /// board, so its queue's depth costs no one. The launch path then measures nothing.
    /// Beside anyone, even an idle or less urgent neighbour, its queue is tracked, so that
    /// the demand it publishes covers its queued work.
    pub fn is_free(&self) -> bool {
        self.rate >= 1.0 && self.queue == QueueRule::Paced && self.alone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allotment(fraction: f64, guarantee: f64) -> Allotment {
        Allotment {
            fraction,
            guarantee,
            outranked_busy: None,
            outranked: false,
            outranks: false,
            others_live: false,
            others_busy: false,
        }
    }

    #[test]
    fn priority_sets_the_queue_and_a_guarantee_is_never_held() {
        let now = 1_000;
        let free = Plan::of(&allotment(1.0, 0.0), now);
        assert!(free.is_free());
        let mut outranked = allotment(1.0, 0.0);
        outranked.outranked = true;
        assert_eq!(Plan::of(&outranked, now).queue, QueueRule::Short);
        let mut beside_urgent = allotment(1.0, 0.0);
        beside_urgent.outranked = true;
        beside_urgent.outranked_busy = Some(5_000);
        assert_eq!(Plan::of(&beside_urgent, now).queue, QueueRule::Single);
        let mut nothing = allotment(0.0, 0.0);
        nothing.outranked = true;
        nothing.outranked_busy = Some(5_000);
        assert_eq!(
            Plan::of(&nothing, now).queue,
            QueueRule::Hold { until: 5_000 }
        );
        let nothing_left = Plan::of(&allotment(0.0, 0.0), now);
        assert_eq!(nothing_left.queue, QueueRule::Hold { until: now });
    }
}
