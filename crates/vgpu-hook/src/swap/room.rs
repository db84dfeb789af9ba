//! Swapping out for a more urgent container (docs/swap.md, "For a more urgent container"):
//! each GPU's room board in `VGPU_TURN_DIR` (`vgpu_shm::RoomBoard`).
//!
//! - A process with swapping on whose `CUDA_TASK_PRIORITY` is above 0 (not the most urgent)
//!   offers its movable device bytes on the board of each GPU they are on, every second
//!   ([`offer`], from the `vgpu-swap` thread), and swaps out when a more urgent container's
//!   want names one of those GPUs while it has made no gated call for a tick ([`wanted`]).
//! - A process of priority 0 whose allocation found no room on a GPU (the driver's out of
//!   memory) asks when a less urgent container offers there ([`made`]): it posts a want and
//!   waits, up to `VGPU_SWAP_IN_WAIT`, for the GPU to have room, and the allocation is tried
//!   once more. With no offer it does not wait: the allocation fails (or is host-backed) as
//!   before.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use vgpu_cuda_abi::CUdevice;
use vgpu_shm::{RoomBoard, RoomKind, RoomRecord, monotonic_ns, room_file_name};

use crate::driver;
use crate::log::{INFO, MSG, WARN, vlog};
use crate::real::Cuda;
use crate::state::Ready;

/// How often a want is written again while its process waits (a record counts for 3 s).
const WANT_REFRESH: Duration = Duration::from_millis(500);
/// How often a waiting allocation looks for room.
const ROOM_POLL: Duration = Duration::from_millis(20);

/// Each GPU's board, opened on first use (`None`: no turn directory, or it cannot be used).
type Boards = Vec<(CUdevice, Option<RoomBoard>)>;
static BOARDS: Mutex<Boards> = Mutex::new(Vec::new());

/// Runs `f` on `dev`'s room board with this container's key; `None` without a board.
fn with_board<R>(st: &Ready, dev: CUdevice, f: impl FnOnce(&mut RoomBoard, u64) -> R) -> Option<R> {
    let mut boards = lock_boards()?;
    let i = match boards.iter().position(|(d, _)| *d == dev) {
        Some(i) => i,
        None => {
            boards.push((dev, open(st, dev)));
            boards.len() - 1
        }
    };
    let key = key(st);
    boards[i].1.as_mut().map(|b| f(b, key))
}

/// The boards, waiting at most [`BOARDS_WAIT`] for them: a child forked while another thread
/// held the lock sees it held forever, and must then go without (`None`), not hang.
fn lock_boards() -> Option<std::sync::MutexGuard<'static, Boards>> {
    let start = Instant::now();
    loop {
        match BOARDS.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < BOARDS_WAIT => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

/// The longest a board operation waits for another thread's (a file read or write: well
/// under a millisecond).
const BOARDS_WAIT: Duration = Duration::from_millis(50);

#[cold]
fn open(st: &Ready, dev: CUdevice) -> Option<RoomBoard> {
    let dir = st.config.sm_tuning.turn_dir.as_deref()?;
    if !std::path::Path::new(dir).is_dir() {
        return None;
    }
    let cuda = crate::real::cuda().ok()?;
    let uuid = driver::device_uuid(cuda, dev).ok()?;
    let path = std::path::Path::new(dir).join(room_file_name(&uuid));
    match RoomBoard::open_or_create(&path) {
        Ok(b) => Some(b),
        Err(e) => {
            vlog!(
                WARN,
                "device {}: {e}: no swapping for more urgent containers on this GPU",
                dev.0
            );
            None
        }
    }
}

/// This container's key: its shared file's, as on the turn board.
fn key(st: &Ready) -> u64 {
    vgpu_shm::container_key(st.slot().table().path())
        .unwrap_or_else(|_| u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
}

/// Whether this process yields to more urgent ones: it is not of the most urgent priority.
fn yields(st: &Ready) -> bool {
    st.config.task_priority > 0
}

/// Offers this process's movable device bytes on the boards of their GPUs (the `vgpu-swap`
/// thread, every second). Nothing movable on a GPU: no offer there (an old one ages out).
pub(crate) fn offer(st: &Ready) {
    if !yields(st) {
        return;
    }
    let moving = st.host_backed.swappable();
    let now = monotonic_ns();
    for dev in devices_of(&moving.contexts) {
        with_board(st, dev, |b, key| {
            let _ = b.post(RoomRecord {
                key,
                kind: RoomKind::Offer,
                priority: st.config.task_priority.clamp(0, 99) as u32,
                bytes: moving.bytes,
                stamp_ns: now,
            });
        });
    }
}

/// A swap-out under way, said on the boards of the GPUs it frees memory on: a more urgent
/// container's allocations wait only while a less urgent one offers, and an offer counts 3 s
/// after it was posted, while a swap-out that pins its host memory afresh takes as long as
/// pinning does (24 GiB in 6.6 s on the H200, 4.6 GB/s: `swap_torch.py --priority`). So the
/// giver posts its offer again while it moves, and at the end says it has nothing left.
pub(crate) struct Giving<'a> {
    st: &'a Ready,
    devices: Vec<CUdevice>,
    bytes: u64,
    posted: Instant,
}

/// How often a giver posts its offer again while it moves (an offer counts for 3 s).
const OFFER_REFRESH: Duration = Duration::from_millis(500);

impl<'a> Giving<'a> {
    /// Before the move (the allocations' lock not held): what it gives, where.
    pub(crate) fn start(st: &'a Ready) -> Self {
        let (devices, bytes) = match yields(st) {
            true => {
                let moving = st.host_backed.swappable();
                (devices_of(&moving.contexts), moving.bytes)
            }
            false => (Vec::new(), 0),
        };
        let giving = Self {
            st,
            devices,
            bytes,
            posted: Instant::now(),
        };
        giving.post(bytes);
        giving
    }

    /// After each allocation moved: the offer again, at most every [`OFFER_REFRESH`].
    pub(crate) fn progress(&mut self) {
        if self.posted.elapsed() >= OFFER_REFRESH {
            self.posted = Instant::now();
            self.post(self.bytes);
        }
    }

    /// The move is over: nothing more is given here (a more urgent allocation that still
    /// finds no room fails at once instead of waiting for it).
    pub(crate) fn finish(self) {
        self.post(0);
    }

    fn post(&self, bytes: u64) {
        let now = monotonic_ns();
        for &dev in &self.devices {
            with_board(self.st, dev, |b, key| {
                let _ = b.post(RoomRecord {
                    key,
                    kind: RoomKind::Offer,
                    priority: self.st.config.task_priority.clamp(0, 99) as u32,
                    bytes,
                    stamp_ns: now,
                });
            });
        }
    }
}

/// The GPUs of `contexts`, each once.
fn devices_of(contexts: &[(vgpu_cuda_abi::CUcontext, CUdevice)]) -> Vec<CUdevice> {
    let mut devices: Vec<CUdevice> = contexts.iter().map(|&(_, d)| d).collect();
    devices.sort_by_key(|d| d.0);
    devices.dedup();
    devices
}

/// A want of a more urgent container on a GPU this process's movable memory is on: the GPU
/// and the want's priority.
pub(crate) fn wanted(st: &Ready) -> Option<(CUdevice, u32)> {
    if !yields(st) {
        return None;
    }
    let own = st.config.task_priority;
    let now = monotonic_ns();
    let moving = st.host_backed.swappable();
    moving.contexts.iter().find_map(|&(_, dev)| {
        with_board(st, dev, |b, key| {
            b.records(now)
                .into_iter()
                .find(|r| r.kind == RoomKind::Want && r.key != key && (r.priority as i32) < own)
                .map(|r| (dev, r.priority))
        })
        .flatten()
    })
}

/// An allocation of `bytes` found no room on `dev`: if this process is of the most urgent
/// priority and a less urgent container offers there, asks them to swap out and waits up to
/// `VGPU_SWAP_IN_WAIT` for the room. Whether the GPU has the room now (the caller tries
/// once more).
#[cold]
#[inline(never)]
pub(crate) fn made(st: &Ready, cuda: &Cuda, dev: CUdevice, bytes: u64) -> bool {
    if yields(st) {
        return false;
    }
    let want = |key| RoomRecord {
        key,
        kind: RoomKind::Want,
        priority: 0,
        bytes,
        stamp_ns: monotonic_ns(),
    };
    let offers = with_board(st, dev, |b, key| {
        let n = b
            .records(monotonic_ns())
            .iter()
            .filter(|r| r.kind == RoomKind::Offer && r.key != key && r.priority > 0 && r.bytes > 0)
            .count();
        if n > 0 {
            let _ = b.post(want(key));
        }
        n
    })
    .unwrap_or(0);
    if offers == 0 {
        return false;
    }
    let wait = Duration::from_millis(st.config.swap.in_wait_ms);
    vlog!(
        MSG,
        "device {}: no room for {bytes} bytes; {offers} less urgent container(s) offer to swap \
         out: waiting up to {} ms",
        dev.0,
        wait.as_millis()
    );
    let reserve = st.config.host_backing.device_reserve;
    let start = Instant::now();
    let mut posted = start;
    let room = loop {
        if crate::host_backing::breaks_reserve(cuda, dev, reserve, bytes).is_none() {
            break true;
        }
        if start.elapsed() >= wait {
            break false;
        }
        std::thread::sleep(ROOM_POLL);
        if posted.elapsed() >= WANT_REFRESH {
            posted = Instant::now();
            with_board(st, dev, |b, key| b.post(want(key)));
        }
    };
    with_board(st, dev, |b, key| b.withdraw(key));
    vlog!(
        if room { INFO } else { MSG },
        "device {}: {} for {bytes} bytes after {} ms",
        dev.0,
        if room { "room made" } else { "no room made" },
        start.elapsed().as_millis()
    );
    room
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_nobody_will_release_makes_the_boards_go_without_instead_of_hanging() {
        // A child forked while another thread held the lock: it stays held. (With a plain
        // `lock()` this test never ends.)
        let held = BOARDS.lock().unwrap();
        let start = Instant::now();
        assert!(lock_boards().is_none());
        assert!(start.elapsed() < Duration::from_secs(1));
        drop(held);
        assert!(lock_boards().is_some());
    }
}
