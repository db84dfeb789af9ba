//! Compute (SM) limit on the launch path.
//!
//! # Interface (stable; the launch hooks depend on it)
//!
//! Every launch export (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuLaunchCooperativeKernel`,
//! `cuGraphLaunch` and their `_ptsz` variants) does:
//!
//! ```text
//! let sm = state::sm_limiter();                       // the process root's one SmLimiter
//! let dev = if sm.enabled() { Some(device of the stream) } else { None };
//! if let Some(d) = dev { sm.before_launch(d, stream, id)?; }   // may wait; Err = return code
//! let r = real launch;
//! if let Some(d) = dev { sm.after_launch(d, stream, id, r); }
//! ```
//!
//! - [`SmLimiter::enabled`] is one relaxed atomic load. When no SM limit is configured it is
//!   false, and the launch path does no syscall, takes no lock and writes no shared memory.
//! - [`SmLimiter::before_launch`] runs before the real launch on the caller's thread;
//!   returning `Err(code)` makes the launch return `code` without launching.
//! - [`SmLimiter::after_launch`] runs after the real launch with its result.
//! - `id` is the launch's identity ([`launch_id`]): equal for launches that do the same work
//!   (the function with its geometry, or the graph); the limiter charges each launch its
//!   identity's learned cost.
//! - `stream` is the stream as the driver will see it: a `_ptsz` export passes
//!   `CU_STREAM_PER_THREAD` (0x2) when the application passed 0, so that the limiter's
//!   events go to the same (per-thread) stream as the launch.
//!
//! The one [`SmLimiter`] lives in the process root (`crate::state`), which the hooks ask for
//! it; this module never looks the root up. The root starts it when the process state is built ([`SmLimiter::start`],
//! with the parsed environment and this process's slot in the shared file with its ordinal →
//! file index map (the file's index is the GPU, `crate::ledger`): container-wide
//! limits, `sm_util` reporting and the monitor's fields), resets it in a forked child and
//! stops it at exit. The limiter never looks the process state up itself.
//!
//! # Body
//!
//! The control logic is the pure crate `vgpu-limiter` (docs/sm-limit.md says why it is
//! built this way). This module supplies its four inputs: a monotonic clock and CUDA events
//! as its GPU timer (`timer`: the real driver's functions from `real`'s table of used
//! symbols, never through our exports), the shared file as its container view (`view`) and
//! the node's turn board (`board`).
//! One limiter per device sits behind a mutex that a launch holds from
//! [`SmLimiter::before_launch`] to [`SmLimiter::after_launch`] (kept in a thread-local), so admission, the marker around the launch and
//! its accounting are one step; a throttled launch sleeps holding it, which throttles the
//! device's other launching threads too, as the limit is per device.

mod board;
mod gate;
mod heartbeat;
pub(crate) mod launch_timing;
mod timer;
mod view;

use std::cell::RefCell;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::Duration;

use vgpu_alloc_core::{DeviceIndex, MAX_DEVICES};
use vgpu_cuda_abi::{CUresult, CUstream};
use vgpu_env::Config;
use vgpu_limiter::{Admission, LaunchId, Limiter, LimiterConfig, Policy, SmMode, Ticket};
use vgpu_shm::ProcessSlot;

use crate::ledger::SharedLedger;
use crate::log::{DEBUG, INFO, vlog};
use crate::published::Published;
use board::BoardView;
use heartbeat::Heartbeat;
use timer::{EventFns, EventTimer, Events, MonoClock, StreamKey, WakeSlack};
use view::FileView;

/// The identity of a launch from its parts (function and geometry, or graph): a fast hash;
/// a collision only makes two kinds of launch share a cost estimate.
pub(crate) fn launch_id(parts: &[u64]) -> LaunchId {
    let mut h: u64 = 0x243f_6a88_85a3_08d3;
    for &p in parts {
        h = (h ^ p).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }
    h
}

/// The SM limiter's process state (one, in the process root).
///
/// Atomics and [`Published`] cells only, so a fork at any instant leaves nothing locked
/// that [`SmLimiter::reset_in_child`] must touch.
pub(crate) struct SmLimiter {
    /// Whether any SM limit is active in this process (the launch path's one relaxed load).
    enabled: AtomicBool,
    /// SM limit per device from the environment, percent (0 = none).
    env_limit: [AtomicU32; MAX_DEVICES],
    /// The policy, as `policy_code`.
    policy: AtomicU8,
    /// `VGPU_SM_MODE=share`: the limit is a guarantee that borrows idle time.
    share: AtomicBool,
    /// Share mode: `VGPU_SM_CEILING`, percent.
    ceiling: AtomicU32,
    /// `CUDA_TASK_PRIORITY` from the environment (the file's wins once there is one).
    priority: AtomicI32,
    /// The turn board's directory from the environment (the first value set wins; `None`
    /// inside: no board).
    turn_dir: Published<Option<String>>,
    /// This process's slot in the shared file with its ordinal → file index map, handed over
    /// by [`SmLimiter::start`]: it lives in the published process state, which is never freed.
    slot: AtomicPtr<SharedLedger>,
    /// One limiter per device, built on its first throttled launch.
    devices: [Published<DeviceLimiter>; MAX_DEVICES],
    /// The real driver's functions for the GPU timer (valid in a forked child too).
    events: Events,
    /// The thread that keeps an idle container on the turn board.
    heartbeat: Heartbeat,
    /// The exit line with each limiter's counters was written.
    said_stats: AtomicBool,
}

type DeviceLimiter = Mutex<Limiter<MonoClock, EventTimer, FileView, BoardView>>;

fn policy_code(p: Policy) -> u8 {
    match p {
        Policy::Default => 0,
        Policy::Force => 1,
        Policy::Disable => 2,
        Policy::Monitor => 3,
    }
}

impl SmLimiter {
    pub(crate) const fn new() -> Self {
        Self {
            enabled: AtomicBool::new(false),
            env_limit: [const { AtomicU32::new(0) }; MAX_DEVICES],
            policy: AtomicU8::new(0),
            share: AtomicBool::new(false),
            ceiling: AtomicU32::new(100),
            priority: AtomicI32::new(1),
            turn_dir: Published::new(),
            slot: AtomicPtr::new(ptr::null_mut()),
            devices: [const { Published::new() }; MAX_DEVICES],
            events: Events::new(),
            heartbeat: Heartbeat::new(),
            said_stats: AtomicBool::new(false),
        }
    }

    /// Configures the limiter from the parsed environment and hands it this process's slot
    /// in the shared file (when the ledger is the shared table). Run when the process state
    /// is built (again in a forked child that uses CUDA). Limits stored in the file win over
    /// the environment's, but only a limit in the environment arms the launch path
    /// (docs/sm-limit.md).
    pub(crate) fn start(&self, config: &Config, slot: Option<&'static SharedLedger>) {
        self.turn_dir.publish(config.sm_tuning.turn_dir.clone());
        let policy = config.core_policy;
        self.policy.store(policy_code(policy), Ordering::Relaxed);
        let pcts: Vec<u32> = config
            .sm_limit
            .iter()
            .map(|l| l.map_or(0, u32::from))
            .collect();
        for (d, &pct) in pcts.iter().enumerate() {
            self.env_limit[d].store(pct, Ordering::Relaxed);
        }
        let armed = pcts.iter().any(|&p| p > 0);
        // `CUDA_DEVICE_SM_LIMIT` without an index sets every device: one line, not one per
        // possible device on a machine that may have one.
        match pcts.first() {
            Some(&p) if p > 0 && pcts.iter().all(|&q| q == p) => {
                vlog!(INFO, "SM limit {p}% on every device (policy {policy:?})");
            }
            _ => {
                for (d, &pct) in pcts.iter().enumerate().filter(|(_, p)| **p > 0) {
                    vlog!(INFO, "device {d}: SM limit {pct}% (policy {policy:?})");
                }
            }
        }
        self.slot.store(
            slot.map_or(ptr::null_mut(), |s| ptr::from_ref(s).cast_mut()),
            Ordering::Relaxed,
        );
        // Share mode arms every device, with a limit or not: without one the container is
        // best effort (no guarantee; it borrows what others leave).
        let share = config.sm_mode == SmMode::Share;
        self.share.store(share, Ordering::Relaxed);
        self.ceiling
            .store(config.sm_ceiling.map_or(100, u32::from), Ordering::Relaxed);
        self.priority.store(config.task_priority, Ordering::Relaxed);
        if share {
            vlog!(
                INFO,
                "SM share mode: limits are guarantees, ceiling {}%, priority {} (0 = high)",
                config.sm_ceiling.map_or(100, u32::from),
                config.task_priority
            );
        }
        // By file index: the map needs CUDA initialized, which the program may not have yet.
        let any = share || (0..MAX_DEVICES).any(|i| self.limit_pct_of_index(i) > 0);
        // Release: a launch that sees the flag (and loads it again with acquire on its cold
        // path) sees the limits and the slot stored above.
        self.enabled.store(
            (armed || share) && any && policy != Policy::Disable,
            Ordering::Release,
        );
    }

    /// In the child after `fork` (atomic stores only), in this order: the launch path is
    /// disarmed; the parent's limiters (their mutexes may be held by threads that were not
    /// copied, their events belong to the parent's contexts) and its slot are forgotten,
    /// leaked rather than dropped; the heartbeat, whose thread was not copied, is reset. The
    /// child's next call builds its process state, which starts this again.
    pub(crate) fn reset_in_child(&self) {
        self.enabled.store(false, Ordering::Relaxed);
        for d in &self.devices {
            d.forget();
        }
        self.slot.store(ptr::null_mut(), Ordering::Relaxed);
        self.heartbeat.reset_in_child();
        gate::reset_in_child();
    }

    /// At exit: the heartbeat stops (it would put the container back on the board); each
    /// device's limiter takes its record off the turn board and says what it did (at
    /// `LIBCUDA_LOG_LEVEL` 3), if no thread holds it (an exit never waits for a launch).
    pub(crate) fn stop_at_exit(&self) {
        self.heartbeat.stop();
        gate::stop_at_exit();
        // Both exit paths may call this: say it once.
        if self.said_stats.swap(true, Ordering::Relaxed) {
            return;
        }
        #[cfg(feature = "launch-timing")]
        if let Some(line) = launch_timing::report() {
            vlog!(INFO, "{line}");
        }
        for (d, cell) in self.devices.iter().enumerate() {
            let Some(m) = cell.get() else { continue };
            let Ok(mut l) = m.try_lock() else { continue };
            // Off the board now: lower priorities stop keeping their queues short for us.
            l.leave_board();
            let s = l.stats();
            let util = l.utilization().map_or(-1.0, |u| u * 100.0);
            let part = l.allotment().fraction * 100.0;
            vlog!(
                INFO,
                "device {d}: limiter stats: {} launches ({} of unknown cost), {} samples ({} gated, {} gates opened late), {} segments \
                 ({} markers, {} of them timed, {} queries), busy {:.1} ms, util {util:.0}%, part {part:.0}%, \
                 waits {} (pace {}, queue {}, hold {}, hold expiries {}), timer errors {}",
                s.launches,
                s.unknown_launches,
                s.samples,
                s.gated_samples,
                s.forced_gates,
                s.segments,
                s.markers,
                s.timed_markers,
                s.queries,
                s.busy_ns / 1e6,
                s.waits,
                s.pace_waits,
                s.queue_waits,
                s.hold_waits,
                s.hold_expiries,
                s.timer_errors
            );
            let c = l.cost_profile();
            vlog!(
                INFO,
                "device {d}: limiter costs: {} identities, samples {} clean, {} gapped, {} kept \
                 out; latency {:.1} us, drain {:.1} us; launches at their estimate {:.1} ms, \
                 at their smallest sample {:.1} ms",
                c.ids,
                c.chained,
                c.fresh,
                c.outliers,
                c.latency.unwrap_or(0.0) / 1e3,
                c.drain / 1e3,
                c.by_estimate / 1e6,
                c.by_smallest / 1e6
            );
            // Which identities the charge rests on, and whether their samples agree (a few
            // long samples setting an estimate is contention inside samples, not work).
            if crate::log::enabled(DEBUG) {
                for r in l.heaviest_identities(12) {
                    let us = |v: &[f64]| {
                        v.iter()
                            .map(|x| format!("{:.1}", x / 1e3))
                            .collect::<Vec<_>>()
                            .join(" ")
                    };
                    vlog!(
                        DEBUG,
                        "device {d}: identity {:#x}: {} launches at {:.1} us; clean [{}] gapped \
                         [{}] us; outliers in a row {}",
                        r.id,
                        r.launches,
                        r.cost / 1e3,
                        us(&r.chained),
                        us(&r.fresh),
                        r.outliers
                    );
                }
            }
        }
    }

    fn policy(&self) -> Policy {
        match self.policy.load(Ordering::Relaxed) {
            1 => Policy::Force,
            2 => Policy::Disable,
            3 => Policy::Monitor,
            _ => Policy::Default,
        }
    }

    /// The turn board's directory, if there is one.
    fn turn_dir(&self) -> Option<&str> {
        self.turn_dir
            .get_or_publish(|| Some(vgpu_env::DEFAULT_TURN_DIR.to_owned()))
            .as_deref()
    }

    fn shared(&self) -> Option<&'static SharedLedger> {
        let p = self.slot.load(Ordering::Acquire);
        // SAFETY: only ever set from a `&'static SharedLedger` in `start`.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    fn slot(&self) -> Option<&'static ProcessSlot> {
        self.shared().map(SharedLedger::slot)
    }

    /// The file index of CUDA ordinal `d` (the GPU's; `d` itself without a file), `None` for
    /// a GPU the file does not list (its contexts are refused) or before CUDA is initialized.
    fn file_index(&self, d: usize) -> Option<usize> {
        match self.shared() {
            Some(s) => s
                .file_device(DeviceIndex(d as u32))
                .map(DeviceIndex::as_usize),
            None => Some(d),
        }
    }

    /// The limit of CUDA ordinal `d` in percent (0 = none): its GPU's.
    fn limit_pct(&self, d: usize) -> u32 {
        match self.file_index(d) {
            Some(i) => self.limit_pct_of_index(i),
            None => self.env_limit[d].load(Ordering::Relaxed),
        }
    }

    /// The limit of the container's device `i` (the file's index, which the environment's
    /// `_<i>` names too: docs/compatibility.md) in percent (0 = none): the file's when it has
    /// one, else the environment's.
    fn limit_pct_of_index(&self, i: usize) -> u32 {
        if let Some(s) = self.slot()
            && let Some(p) = s.table().sm_limit(DeviceIndex(i as u32))
        {
            return p as u32;
        }
        self.env_limit[i].load(Ordering::Relaxed)
    }

    /// Before a launch of identity `id` on `device`/`stream`: may wait; `Err` is the code
    /// the launch returns without launching.
    pub(crate) fn before_launch(
        &'static self,
        device: DeviceIndex,
        stream: CUstream,
        id: LaunchId,
    ) -> Result<(), CUresult> {
        // A guard left by a launch whose `after_launch` never ran (it cannot happen with the
        // hook's call sites, but must not deadlock this thread).
        drop(HELD.with(|h| h.borrow_mut().take()));
        let d = device.0 as usize;
        if d >= MAX_DEVICES || !self.enabled.load(Ordering::Acquire) {
            return Ok(());
        }
        let Some(fns) = self.events.get() else {
            return Ok(());
        };
        let key = StreamKey::of(stream);
        if launch_timing::timed!(launch_timing::part::CAPTURE, fns.capturing(stream)) {
            // Captured launches do not run now; the graph's launch is measured instead.
            return Ok(());
        }
        let mut guard = self
            .device_limiter(d, fns)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Built at the first wait only: a launch that goes at once never calls prctl.
        let mut slack: Option<WakeSlack> = None;
        loop {
            match guard.admit(key, id) {
                Admission::Go(ticket) => {
                    if ticket.counted() {
                        let held = Held {
                            guard,
                            ticket,
                            key,
                            reported: false,
                        };
                        HELD.with(|h| *h.borrow_mut() = Some(held));
                    }
                    return Ok(());
                }
                Admission::Wait(ns) => {
                    launch_timing::timed!(launch_timing::part::WAIT, {
                        slack.get_or_insert_with(WakeSlack::tight).tighten();
                        std::thread::sleep(Duration::from_nanos(ns));
                    });
                }
            }
        }
    }

    /// Starts the share-mode heartbeat thread unless it runs (a container announced itself
    /// on a board).
    fn want_heartbeat(&'static self) {
        self.heartbeat
            .want(MAX_DEVICES, move |d| self.idle_heartbeat(d));
    }

    /// The heartbeat thread's beat for CUDA ordinal `d`: its limiter's idle heartbeat, if
    /// it has one and no launch holds it (skipped then: that launch publishes itself).
    fn idle_heartbeat(&self, d: usize) {
        let Some(m) = self.devices.get(d).and_then(Published::get) else {
            return;
        };
        let mut l = match m.try_lock() {
            Ok(l) => l,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        l.idle_heartbeat();
    }

    fn device_limiter(&'static self, d: usize, fns: &'static EventFns) -> &'static DeviceLimiter {
        self.devices[d].get_or_publish(|| self.new_limiter(d, fns))
    }

    #[cold]
    fn new_limiter(&'static self, d: usize, fns: &'static EventFns) -> DeviceLimiter {
        let mut cfg = LimiterConfig {
            policy: self.policy(),
            priority: self.priority.load(Ordering::Relaxed),
            ..LimiterConfig::default()
        };
        if self.share.load(Ordering::Relaxed) {
            cfg.mode = SmMode::Share;
            cfg.ceiling_pct = self.ceiling.load(Ordering::Relaxed);
        }
        #[cfg(feature = "launch-timing")]
        launch_timing::diag::tune(&mut cfg);
        let view = FileView::new(d, self);
        let board = BoardView::new(d, self);
        Mutex::new(Limiter::new(
            cfg,
            MonoClock,
            EventTimer::new(fns, d),
            view,
            board,
        ))
    }
}

impl SmLimiter {
    /// Whether any SM limit is active in this process (one relaxed load).
    #[inline(always)]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// After the launch [`Self::before_launch`] admitted on this thread, which returned
    /// `result`.
    pub(crate) fn after_launch(&self, result: CUresult) {
        if let Some(held) = HELD.with(|h| h.borrow_mut().take()) {
            held.report(result.is_success());
        }
    }
}

/// A launch admitted and counted, between [`SmLimiter::before_launch`] and
/// [`SmLimiter::after_launch`].
struct Held {
    guard: MutexGuard<'static, Limiter<MonoClock, EventTimer, FileView, BoardView>>,
    ticket: Ticket,
    key: StreamKey,
    reported: bool,
}

impl Held {
    fn report(mut self, ok: bool) {
        self.guard.launched(self.ticket, self.key, ok);
        self.reported = true;
    }
}

impl Drop for Held {
    /// A launch whose report never came counts as not launched: a sample's segment is
    /// dropped and its gate opened, so the stream never waits on it.
    fn drop(&mut self) {
        if !self.reported {
            self.guard.launched(self.ticket, self.key, false);
        }
    }
}

thread_local! {
    static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_shm::{TableInit, UsageTable};

    /// A limiter of its own (the process root's is shared by every test).
    fn limiter() -> &'static SmLimiter {
        Box::leak(Box::new(SmLimiter::new()))
    }

    fn config(pairs: &[(&str, &str)]) -> Config {
        Config::from_pairs(pairs.iter().copied()).expect("valid configuration")
    }

    fn armed(sm: &SmLimiter) -> bool {
        sm.enabled.load(Ordering::Relaxed)
    }

    #[test]
    fn only_a_limit_in_the_environment_arms_the_launch_path() {
        let sm = limiter();
        assert!(!armed(sm), "not started");
        sm.start(&config(&[]), None);
        assert!(!armed(sm), "no limit");
        sm.start(&config(&[("CUDA_DEVICE_SM_LIMIT", "50")]), None);
        assert!(armed(sm));
        assert_eq!(sm.limit_pct(0), 50);
        sm.start(
            &config(&[
                ("CUDA_DEVICE_SM_LIMIT", "50"),
                ("GPU_CORE_UTILIZATION_POLICY", "disable"),
            ]),
            None,
        );
        assert!(!armed(sm), "policy disable");
    }

    #[test]
    fn the_slot_handed_over_gives_the_file_limits_and_a_forked_child_forgets_it() {
        let path = std::env::temp_dir().join(format!("vgpu-hook-sm-slot-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let init = TableInit {
            uuids: vec!["GPU-test".into()],
            memory_limits: vec![None],
            sm_limits: vec![Some(30)],
            priority: 1,
        };
        let table = UsageTable::open_or_create(&path, &init).unwrap();
        let slot: &'static SharedLedger =
            Box::leak(Box::new(SharedLedger::new(table.register_self().unwrap())));
        let file_only = limiter();
        file_only.start(&config(&[]), Some(slot));
        assert!(
            !armed(file_only),
            "a limit only in the file does not arm the launch path (docs/sm-limit.md)"
        );
        let sm = limiter();
        sm.start(&config(&[("CUDA_DEVICE_SM_LIMIT", "50")]), Some(slot));
        assert!(armed(sm));
        assert_eq!(sm.limit_pct(0), 30, "the file's limit wins");
        assert!(sm.slot().is_some());
        sm.reset_in_child();
        assert!(!armed(sm), "disarmed in the child until its state is built");
        assert!(sm.slot().is_none(), "the parent's slot is forgotten");
        assert_eq!(sm.limit_pct(0), 50, "the environment's again");
        let _ = std::fs::remove_file(&path);
    }
}
