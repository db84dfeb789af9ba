//! The limiter's clock and GPU timer: `CLOCK_MONOTONIC`, and CUDA events recorded around
//! launches (the real driver's, from `real`'s table of used symbols), recycled per context.

use std::cell::Cell;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vgpu_cuda_abi::{CUcontext, CUevent, CUresult, CUstream, CUstreamCaptureStatus, pfn};
use vgpu_limiter::{Clock, GpuTimer, MarkerKind, Nanos, TimerError};

use super::gate::SampleGate;
use super::launch_timing::{part, timed};
use crate::log::{WARN, vlog};
use crate::published::Published;

thread_local! {
    static THREAD_TOKEN: Cell<u64> = const { Cell::new(0) };
}

/// A small number unique to the calling thread (never 0).
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    THREAD_TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// The calling thread's timer slack, tightened for the launch path's waits and put back
/// when the launch goes (on drop). Linux lets a sleep end up to the slack late (50 us by
/// default): a container that wakes that late for its turn leaves the GPU idle meanwhile.
pub(super) struct WakeSlack {
    /// The slack wanted, ns (`None`: leave the thread's as it is).
    want: Option<u64>,
    /// The thread's own slack, while ours is set.
    old: Option<libc::c_ulong>,
}

impl WakeSlack {
    /// As tight as the kernel allows: the waits are short (at most the limiter's longest
    /// single wait, 2 ms) and only a held launch waits, and a held container that wakes
    /// 50 µs late leaves its part of the GPU idle meanwhile.
    pub(super) fn tight() -> Self {
        Self {
            want: Some(1),
            old: None,
        }
    }

    /// Before a wait: sets the wanted slack (once; nothing if it already is the thread's).
    pub(super) fn tighten(&mut self) {
        let Some(want) = self.want.take() else {
            return;
        };
        // SAFETY: PR_GET_TIMERSLACK takes no further argument and returns the slack in ns
        // (or -1); it touches no memory of ours.
        let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        if old <= 0 || old as u64 == want {
            return;
        }
        // SAFETY: PR_SET_TIMERSLACK takes the slack in ns by value; it affects only this
        // thread's timers.
        if unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, want as libc::c_ulong) } == 0 {
            self.old = Some(old as libc::c_ulong);
        }
    }
}

impl Drop for WakeSlack {
    fn drop(&mut self) {
        if let Some(old) = self.old.take() {
            // SAFETY: as in `tighten`; the value is the thread's own, read there.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, old) };
        }
    }
}

/// `CU_STREAM_LEGACY`.
const STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`.
const STREAM_PER_THREAD: usize = 0x2;

/// A stream as the limiter tells streams apart: the per-thread default stream is a
/// different stream in every thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct StreamKey {
    handle: usize,
    /// The owning thread's token for the per-thread stream, else 0.
    owner: u64,
}

impl StreamKey {
    pub(super) fn of(stream: CUstream) -> Self {
        match stream as usize {
            STREAM_PER_THREAD => Self {
                handle: STREAM_PER_THREAD,
                owner: thread_token(),
            },
            // The NULL stream and CU_STREAM_LEGACY are the same stream.
            STREAM_LEGACY => Self {
                handle: 0,
                owner: 0,
            },
            h => Self {
                handle: h,
                owner: 0,
            },
        }
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds (a vDSO read, no syscall), as is: the shared file's
/// `sm_util` publish times are on this time line, which every process of the host shares
/// (containers included: the monotonic clock is not namespaced), so a peer's time compares
/// with ours.
#[derive(Debug, Clone, Copy)]
pub(super) struct MonoClock;

impl Clock for MonoClock {
    fn now(&self) -> Nanos {
        vgpu_shm::monotonic_ns()
    }
}

/// The real driver's functions the GPU timer calls (from the driver table's used
/// functions, so never through our exports), each one present.
#[derive(Debug)]
pub(super) struct EventFns {
    create: pfn::cuEventCreate,
    destroy: pfn::cuEventDestroy_v2,
    record: pfn::cuEventRecord,
    query: pfn::cuEventQuery,
    elapsed: pfn::cuEventElapsedTime,
    is_capturing: pfn::cuStreamIsCapturing,
    ctx_current: pfn::cuCtxGetCurrent,
}

/// The event functions, resolved on first use (`None`, logged once, if the driver lacks any).
pub(super) struct Events {
    fns: Published<EventFns>,
    failed: AtomicBool,
}

impl Events {
    pub(super) const fn new() -> Self {
        Self {
            fns: Published::new(),
            failed: AtomicBool::new(false),
        }
    }

    pub(super) fn get(&self) -> Option<&EventFns> {
        if let Some(fns) = self.fns.get() {
            return Some(fns);
        }
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        self.resolve()
    }

    #[cold]
    fn resolve(&self) -> Option<&EventFns> {
        match resolve_events() {
            Some(fns) => Some(self.fns.publish(fns)),
            None => {
                if !self.failed.swap(true, Ordering::Relaxed) {
                    vlog!(
                        WARN,
                        "SM limit not enforced: the driver lacks the event functions it needs"
                    );
                }
                None
            }
        }
    }
}

#[cold]
fn resolve_events() -> Option<EventFns> {
    let u = &crate::real::cuda().ok()?.u;
    Some(EventFns {
        create: u.cuEventCreate?,
        destroy: u.cuEventDestroy_v2.or(u.cuEventDestroy)?,
        record: u.cuEventRecord?,
        query: u.cuEventQuery?,
        elapsed: u.cuEventElapsedTime_v2.or(u.cuEventElapsedTime)?,
        is_capturing: u.cuStreamIsCapturing?,
        ctx_current: u.cuCtxGetCurrent?,
    })
}

impl EventFns {
    /// Whether `stream` is being captured into a graph. An error counts as "not capturing":
    /// the launch then most likely fails too, and a failing event record only leaves the
    /// launch unmeasured (charged its estimate).
    ///
    /// The legacy default stream (the null handle of a legacy entry point, or
    /// `CU_STREAM_LEGACY`) is never captured: the driver refuses to begin a capture on it.
    /// Most PyTorch work runs there, so its launches skip the driver call (one of the two
    /// the limited launch path makes on every launch).
    pub(super) fn capturing(&self, stream: CUstream) -> bool {
        if (stream as usize) <= 1 {
            return false;
        }
        let mut status = CUstreamCaptureStatus(0);
        // SAFETY: valid out-pointer; the stream handle is the application's, as it passes
        // it to the launch.
        let r = unsafe { (self.is_capturing)(stream, &mut status) };
        r.is_success() && status.0 != 0
    }

    fn current_context(&self) -> Option<usize> {
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { (self.ctx_current)(&mut ctx) };
        (r.is_success() && !ctx.is_null()).then_some(ctx as usize)
    }
}

/// A recorded event, the context it was created in and whether it is a timing event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct EventMarker {
    event: usize,
    ctx: usize,
    timed: bool,
}

/// CUDA events as the limiter's GPU timer, recycled per context and kind.
pub(super) struct EventTimer {
    fns: &'static EventFns,
    /// Idle events per context and kind (timed or not).
    pool: Vec<((usize, bool), Vec<usize>)>,
    gate: SampleGate,
}

/// `CU_EVENT_DISABLE_TIMING`: a completion-only event.
const EVENT_DISABLE_TIMING: u32 = 0x2;

/// Idle events kept per context and kind.
const POOL_PER_CONTEXT: usize = 64;

fn timer_error(r: CUresult) -> TimerError {
    TimerError { code: r.0 as i32 }
}

impl EventTimer {
    pub(super) fn new(fns: &'static EventFns, device: usize) -> Self {
        Self {
            fns,
            pool: Vec::new(),
            gate: SampleGate::new(device),
        }
    }

    fn take(&mut self, key: (usize, bool)) -> Option<usize> {
        self.pool.iter_mut().find(|(k, _)| *k == key)?.1.pop()
    }

    fn create(&self, timed: bool) -> Result<usize, TimerError> {
        let mut ev: CUevent = ptr::null_mut();
        // A timing event, or a completion-only one (both spin on sync, which we never do).
        let flags = if timed { 0 } else { EVENT_DISABLE_TIMING };
        #[cfg(feature = "launch-timing")]
        let flags = flags | super::launch_timing::diag::event_flags();
        // SAFETY: valid out-pointer and flags the driver knows.
        let r = unsafe { (self.fns.create)(&mut ev, flags) };
        if r.is_success() && !ev.is_null() {
            Ok(ev as usize)
        } else {
            Err(timer_error(r))
        }
    }

    fn destroy(&self, event: usize) {
        // SAFETY: an event we created; errors (e.g. its context is gone) leave nothing to do.
        let _ = unsafe { (self.fns.destroy)(event as CUevent) };
    }

    fn record_on(&self, event: usize, handle: usize) -> CUresult {
        // SAFETY: an event of the current context and the application's stream handle.
        unsafe { (self.fns.record)(event as CUevent, handle as CUstream) }
    }

    /// Records a marker on `stream` with a pooled event of the current context and kind (a
    /// new one if none is idle or the pooled one is stale).
    fn record_pooled(&mut self, stream: StreamKey, timed: bool) -> Result<EventMarker, TimerError> {
        let ctx = self.fns.current_context().ok_or(TimerError { code: -2 })?;
        if let Some(event) = self.take((ctx, timed)) {
            if self.record_on(event, stream.handle).is_success() {
                return Ok(EventMarker { event, ctx, timed });
            }
            // A stale pooled event (its context was destroyed and the handle reused).
            self.destroy(event);
        }
        let event = self.create(timed)?;
        let r = self.record_on(event, stream.handle);
        if r.is_success() {
            Ok(EventMarker { event, ctx, timed })
        } else {
            self.destroy(event);
            Err(timer_error(r))
        }
    }
}

impl GpuTimer for EventTimer {
    type Stream = StreamKey;
    type Marker = EventMarker;

    fn record(&mut self, stream: StreamKey, kind: MarkerKind) -> Result<EventMarker, TimerError> {
        if stream.owner != 0 && stream.owner != thread_token() {
            // Another thread's per-thread stream cannot be named from this thread.
            return Err(TimerError { code: -1 });
        }
        #[cfg(feature = "launch-timing")]
        if super::launch_timing::diag::no_events() {
            return Err(TimerError { code: -3 });
        }
        timed!(
            part::RECORD,
            self.record_pooled(stream, kind == MarkerKind::Timed)
        )
    }

    fn is_complete(&mut self, marker: EventMarker) -> Result<bool, TimerError> {
        // SAFETY: a recorded event we own.
        let r = timed!(part::QUERY, unsafe {
            (self.fns.query)(marker.event as CUevent)
        });
        match r {
            CUresult::SUCCESS => Ok(true),
            CUresult::NOT_READY => Ok(false),
            e => Err(timer_error(e)),
        }
    }

    fn elapsed(&mut self, start: EventMarker, end: EventMarker) -> Result<Nanos, TimerError> {
        let mut ms = 0f32;
        // SAFETY: valid out-pointer; two completed events we own.
        let r = timed!(part::ELAPSED, unsafe {
            (self.fns.elapsed)(&mut ms, start.event as CUevent, end.event as CUevent)
        });
        if r.is_success() {
            Ok((f64::from(ms) * 1e6).max(0.0) as Nanos)
        } else {
            Err(timer_error(r))
        }
    }

    fn release(&mut self, marker: EventMarker) {
        let key = (marker.ctx, marker.timed);
        match self.pool.iter_mut().find(|(k, _)| *k == key) {
            Some((_, idle)) if idle.len() < POOL_PER_CONTEXT => idle.push(marker.event),
            Some(_) => self.destroy(marker.event),
            None => self.pool.push((key, vec![marker.event])),
        }
    }

    fn gate(&mut self, stream: StreamKey) -> Result<(), TimerError> {
        if stream.owner != 0 && stream.owner != thread_token() {
            return Err(TimerError { code: -1 });
        }
        self.gate.hold(stream.handle)
    }

    fn open_gates(&mut self) -> bool {
        self.gate.open()
    }
}

#[cfg(test)]
mod tests {
    use super::WakeSlack;

    fn slack() -> i32 {
        // SAFETY: as in `WakeSlack::tighten`.
        unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) }
    }

    #[test]
    fn wake_slack_is_tightened_for_the_waits_and_put_back_after() {
        std::thread::spawn(|| {
            let own = slack();
            assert!(own > 1, "a thread's slack is positive: {own}");
            {
                let mut s = WakeSlack::tight();
                assert_eq!(slack(), own, "nothing changes before a wait");
                s.tighten();
                assert_eq!(slack(), 1, "as tight as the kernel allows");
                s.tighten();
                assert_eq!(slack(), 1);
            }
            assert_eq!(slack(), own, "the thread's own slack is back");
        })
        .join()
        .unwrap();
    }
}
