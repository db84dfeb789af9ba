//! The board from the launch path: read and written as often as some container's decisions
//! need it, and a busy container's demand never runs out on it while it has work.

use super::*;
use crate::LimiterConfig;

/// Launch-path reads of the board per second and per container while `tenants` run 2 s.
fn reads_per_second(tenants: Vec<(Tenant, Workload)>) -> f64 {
    let n = tenants.len() as f64;
    let (w, _) = run_together(tenants, 2);
    // The run's 2.5 s (its warm-up included).
    w.board.1.get().reads as f64 / 2.5 / n
}

#[test]
fn containers_of_one_priority_read_the_board_once_per_calm_poll() {
    // Nothing on such a board needs another's demand sooner than a share is lent (50 ms
    // after it ran out): every read costs a launching thread a write and a read of a file
    // (about 20 µs in all), so they are a calm poll (5 ms) apart, not a demand poll
    // (0.25 ms: about 4,000 reads a second each).
    let calm = LimiterConfig::default().calm_poll;
    let most = 1e9 / calm as f64 * 1.25 + 20.0;
    for (k, mode) in [Tenant::cap(30), Tenant::share(30)].into_iter().enumerate() {
        let other = Tenant { limit: 70, ..mode };
        let got = reads_per_second(vec![
            (mode, small_batch_trainer(1)),
            (other, large_batch_trainer(2)),
        ]);
        assert!(
            got <= most,
            "pair {k}: {got:.0} reads a second each, at most {most:.0}"
        );
    }
}

#[test]
fn beside_a_more_urgent_container_the_board_is_read_as_often_as_the_priority_rules_need() {
    // The urgent service's demand decides the best-effort one's queue rule: it is read every
    // fifth of a demand poll, and the service keeps its own demand exact (every demand poll).
    let got = reads_per_second(vec![
        (Tenant::share(50).priority(0), small_batch_trainer(1)),
        (Tenant::share(50).priority(1), large_batch_trainer(2)),
    ]);
    let poll = LimiterConfig::default().demand_poll as f64;
    assert!(got >= 1e9 / poll * 0.5, "{got:.0} reads a second each");
}

#[test]
fn a_busy_containers_demand_never_runs_out_on_the_board_while_it_has_work() {
    // Others decide on its record: a demand that ran out while its queue was full would lend
    // its share away (and shorten nobody's queue for it). Checked every 100 µs of a deep
    // loop's run, beside a neighbour of the same priority (the calm poll) and beside a less
    // urgent one (the demand poll).
    for (k, neighbour) in [Tenant::cap(50), Tenant::share(50).priority(2)]
        .into_iter()
        .enumerate()
    {
        let me = Tenant {
            priority: 1,
            ..neighbour
        };
        let mut w = World::new();
        let i = w.add(me, kernel_loop(300 * US));
        w.add(neighbour, large_batch_trainer(2));
        let key = i as u64 + 1;
        let mut t = S / 2;
        while t < 2 * S {
            w.run_until(t);
            let until = w
                .board
                .0
                .borrow()
                .iter()
                .find(|r| r.key == key)
                .map(|r| r.busy_until);
            assert!(
                until.is_some_and(|u| u >= t),
                "case {k}: at {t} ns its demand says {until:?}"
            );
            t += 100 * US;
        }
    }
}
