//! The turn board against the real file: 24 forked processes (8 containers of 3 processes
//! each) create or open a fresh board at the same moment and announce themselves over and
//! over under the board's lock; every container ends up listed, with its own limit, and
//! none is lost to another one taking its entry.

mod common;

use std::sync::atomic::Ordering;

use common::*;
use vgpu_shm::TurnBoard;

const CONTAINERS: u64 = 8;
const PER_CONTAINER: u64 = 3;
const ROUNDS: u64 = 200;
const GO: usize = 0;

#[test]
fn containers_announcing_at_once_are_all_listed() {
    let path = TempPath::new("turns");
    let ctl = Control::new(1);
    let mut pids = Vec::new();
    for c in 0..CONTAINERS {
        for _ in 0..PER_CONTAINER {
            let path = path.0.clone();
            let ctl = &ctl;
            pids.push(fork_child(move || {
                while ctl.word(GO).load(Ordering::SeqCst) == 0 {
                    std::hint::spin_loop();
                }
                // Everyone creates/opens the fresh file at the same moment.
                let Ok(mut board) = TurnBoard::open_or_create(&path) else {
                    return 3;
                };
                for r in 0..ROUNDS {
                    // Keys 100.., limits 10 + container; time moves 1 ms per round. A busy
                    // board (the lock held past 5 ms by a descheduled peer) is tried again,
                    // as the limiter does at its next period.
                    loop {
                        match board.announce(
                            100 + c,
                            (10 + c) as u32,
                            50_000,
                            1_000_000 * (r + 1),
                            500_000_000,
                            1_000_000_000,
                        ) {
                            Ok(_) => break,
                            Err(vgpu_shm::TurnBoardError::Busy) => {
                                std::thread::sleep(std::time::Duration::from_millis(1))
                            }
                            Err(_) => return 4,
                        }
                    }
                }
                0
            }));
        }
    }
    ctl.word(GO).store(1, Ordering::SeqCst);
    for pid in pids {
        assert_eq!(wait(pid), 0, "a process failed to open or announce");
    }
    let board = TurnBoard::open_or_create(&path.0).unwrap();
    let listed: Vec<(u64, u32)> = board
        .tenants(ROUNDS * 1_000_000, 1_000_000_000)
        .iter()
        .map(|t| (t.key, t.limit_pct))
        .collect();
    let want: Vec<(u64, u32)> = (0..CONTAINERS)
        .map(|c| (100 + c, (10 + c) as u32))
        .collect();
    assert_eq!(listed, want);
}
