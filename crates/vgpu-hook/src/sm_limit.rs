//! Compute (SM) limit on the launch path.
//!
//! # Interface (stable; the call sites in `hooks.rs` depend on it)
//!
//! Every launch export (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuLaunchCooperativeKernel`,
//! `cuGraphLaunch` and their `_ptsz` variants) does:
//!
//! ```text
//! let dev = if sm_limit::enabled() { Some(device of the stream) } else { None };
//! if let Some(d) = dev { sm_limit::before_launch(d, stream, kind)?; }   // may wait; Err = return code
//! let r = real launch;
//! if let Some(d) = dev { sm_limit::after_launch(d, stream, kind, r); }
//! ```
//!
//! - [`enabled`] is one relaxed atomic load. When no SM limit is configured it is false,
//!   and the launch path does no syscall, takes no lock and writes no shared memory.
//! - [`configure`] is called once when the process's state is built (and again in a
//!   forked child that uses CUDA), with the parsed environment.
//! - [`before_launch`] runs before the real launch on the caller's thread; returning
//!   `Err(code)` makes the launch return `code` without launching.
//! - [`after_launch`] runs after the real launch with its result.
//! - [`after_fork_in_child`] runs in the `pthread_atfork` child handler: only atomic
//!   stores are allowed there.
//! - The shared table (this process's `ProcessSlot`: `set_sm_util`, `table().sm_limit(..)`,
//!   `recent_kernel()`, `utilization_switch()`) is reachable as
//!   `crate::state::get()` → `Enforcement::Ready(r)` → `r.slot()`, once `configure` has run
//!   (the state is being built while `configure` runs, so fetch it lazily, not inside it).
//! - `stream` is the stream as the driver will see it: a `_ptsz` export passes
//!   `CU_STREAM_PER_THREAD` (0x2) when the application passed 0, so that the limiter's
//!   events go to the same (per-thread) stream as the launch.
//! - Added (backward compatible): [`attach`] gives the limiter the process's slot in the
//!   shared file once it is registered: container-wide limits, `sm_util` reporting and the
//!   monitor's fields. Without it the environment's limits apply per process.
//! - Added: [`context_creating`] runs just before the hook creates a context on a device
//!   (primary retain or `cuCtxCreate*`), never on the launch path: it records the device's
//!   power then, so the limiter's power share can measure the idle power from there to the
//!   first launch.
//!
//! # Body
//!
//! The control logic is the pure crate `vgpu-limiter` (docs/sm-limit.md says why it is
//! built this way). This file supplies its three inputs: a monotonic clock, CUDA events as
//! its GPU timer (resolved from the real `libcuda.so.1` with the real `dlsym`, never through
//! our exports), and the shared file as its container view. One limiter per device sits
//! behind a mutex that a launch holds from [`before_launch`] to [`after_launch`] (kept in a
//! thread-local), so admission, the marker around the launch and its accounting are one
//! step; a throttled launch sleeps holding it, which throttles the device's other launching
//! threads too, as the limit is per device.

use std::cell::{Cell, RefCell};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use vgpu_alloc_core::{DeviceIndex, MAX_DEVICES};
use vgpu_cuda_abi::{
    CUcontext, CUdevice, CUevent, CUresult, CUstream, c_int, c_uint, c_void, nvmlDevice_t,
    nvmlProcessUtilizationSample_t,
};
use vgpu_env::{Config, SmTuning};
use vgpu_limiter::power::PowerState;
use vgpu_limiter::{
    Admission, Clock, ContainerView, DeviceSample, GpuTimer, Limiter, LimiterConfig, Nanos,
    PeerShare, Policy, PowerSample, Ticket, TimerError, TurnTenant,
};
use vgpu_shm::{ProcessSlot, TurnBoard};

use crate::log::{DEBUG, INFO, WARN, vlog};

/// Which launch entry point is calling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaunchKind {
    /// `cuLaunchKernel[_ptsz]`
    Kernel,
    /// `cuLaunchKernelEx[_ptsz]`
    KernelEx,
    /// `cuLaunchCooperativeKernel[_ptsz]`
    Cooperative,
    /// `cuGraphLaunch[_ptsz]`: a whole graph of kernels.
    Graph,
}

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Whether any SM limit is active in this process (one relaxed load).
#[inline(always)]
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// SM limit per device from the environment, percent (0 = none).
static ENV_LIMIT: [AtomicU32; MAX_DEVICES] = [const { AtomicU32::new(0) }; MAX_DEVICES];
/// The policy, as `policy_code`.
static POLICY: AtomicU8 = AtomicU8::new(0);
/// The process's slot in the shared file, once [`attach`]ed (leaked, never freed).
static SLOT: AtomicPtr<ProcessSlot> = AtomicPtr::new(ptr::null_mut());
/// [`find_slot`] has looked for the slot in the hook's state.
static SLOT_LOOKED_UP: AtomicBool = AtomicBool::new(false);
/// One limiter per device, built on its first throttled launch (leaked, never freed).
static DEVICES: [AtomicPtr<DeviceLimiter>; MAX_DEVICES] =
    [const { AtomicPtr::new(ptr::null_mut()) }; MAX_DEVICES];

fn policy_code(p: Policy) -> u8 {
    match p {
        Policy::Default => 0,
        Policy::Force => 1,
        Policy::Disable => 2,
        Policy::Monitor => 3,
    }
}

fn policy() -> Policy {
    match POLICY.load(Ordering::Relaxed) {
        1 => Policy::Force,
        2 => Policy::Disable,
        3 => Policy::Monitor,
        _ => Policy::Default,
    }
}

/// Reads the SM limits from the configuration.
/// The limiter's tuning from the environment (set once by [`configure`]).
static TUNING: std::sync::OnceLock<SmTuning> = std::sync::OnceLock::new();

fn tuning() -> &'static SmTuning {
    TUNING.get_or_init(SmTuning::default)
}

pub(crate) fn configure(config: &Config) {
    let _ = TUNING.set(config.sm_tuning.clone());
    let policy = config.core_policy;
    POLICY.store(policy_code(policy), Ordering::Relaxed);
    for (d, l) in config.sm_limit.iter().enumerate() {
        let pct = l.map_or(0, u32::from);
        ENV_LIMIT[d].store(pct, Ordering::Relaxed);
        if pct > 0 {
            vlog!(INFO, "device {d}: SM limit {pct}% (policy {policy:?})");
        }
    }
    update_enabled();
}

/// Gives the limiter this process's registration in the shared file. Limits stored in
/// the file win over the environment; achieved utilization is reported in the slot.
#[allow(dead_code)]
pub(crate) fn attach(slot: &'static ProcessSlot) {
    SLOT.store(ptr::from_ref(slot).cast_mut(), Ordering::Release);
    update_enabled();
}

/// Finds the process's slot in the hook's state when nobody [`attach`]ed it (once; the
/// state exists by the first launch, as allocations come first).
fn find_slot() {
    if !SLOT.load(Ordering::Relaxed).is_null() || SLOT_LOOKED_UP.swap(true, Ordering::Relaxed) {
        return;
    }
    if let crate::state::Enforcement::Ready(ready) = crate::state::get()
        && let Some(slot) = ready.slot()
    {
        attach(slot);
    }
}

fn slot() -> Option<&'static ProcessSlot> {
    let p = SLOT.load(Ordering::Acquire);
    // SAFETY: only ever set from a `&'static ProcessSlot` in `attach`.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The limit of device `d` in percent (0 = none): the file's when it has one, else the
/// environment's.
fn limit_pct(d: usize) -> u32 {
    if let Some(s) = slot()
        && let Some(p) = s.table().sm_limit(DeviceIndex(d as u32))
    {
        return p as u32;
    }
    ENV_LIMIT[d].load(Ordering::Relaxed)
}

fn update_enabled() {
    let any = (0..MAX_DEVICES).any(|d| limit_pct(d) > 0);
    ENABLED.store(any && policy() != Policy::Disable, Ordering::Relaxed);
}

/// Before a launch on `device`/`stream`.
pub(crate) fn before_launch(
    device: DeviceIndex,
    stream: CUstream,
    _kind: LaunchKind,
) -> Result<(), CUresult> {
    // A guard left by a launch whose `after_launch` never ran (it cannot happen with the
    // hook's call sites, but must not deadlock this thread).
    drop(HELD.with(|h| h.borrow_mut().take()));
    let d = device.0 as usize;
    if d >= MAX_DEVICES {
        return Ok(());
    }
    let Some(fns) = events() else {
        return Ok(());
    };
    find_slot();
    let key = StreamKey::of(stream);
    if fns.capturing(stream) {
        // Captured launches do not run now; the graph's launch is measured instead.
        return Ok(());
    }
    let mut guard = device_limiter(d, fns)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    loop {
        match guard.admit(key) {
            Admission::Go(ticket) => {
                if ticket.counted() {
                    HELD.with(|h| *h.borrow_mut() = Some(Held { guard, ticket, key }));
                }
                return Ok(());
            }
            Admission::Wait(ns) => std::thread::sleep(Duration::from_nanos(ns)),
        }
    }
}

/// After a launch on `device`/`stream` that returned `result`.
pub(crate) fn after_launch(
    _device: DeviceIndex,
    _stream: CUstream,
    _kind: LaunchKind,
    result: CUresult,
) {
    if let Some(mut held) = HELD.with(|h| h.borrow_mut().take()) {
        held.guard
            .launched(held.ticket, held.key, result.is_success());
    }
}

/// In the child after `fork`: forget per-process limiter state.
pub(crate) fn after_fork_in_child() {
    ENABLED.store(false, Ordering::Relaxed);
    // The parent's limiters are leaked, not dropped: their mutexes may be held by threads
    // that were not copied, and their events belong to the parent's contexts.
    for d in &DEVICES {
        d.store(ptr::null_mut(), Ordering::Relaxed);
    }
    SLOT.store(ptr::null_mut(), Ordering::Relaxed);
    SLOT_LOOKED_UP.store(false, Ordering::Relaxed);
    // The child creates its own context (the parent's is not usable there) and records its
    // own baseline then; a baseline the parent had not handed over yet is leaked.
    for d in 0..MAX_DEVICES {
        BASELINE_CLAIMED[d].store(false, Ordering::Relaxed);
        BASELINE[d].store(ptr::null_mut(), Ordering::Relaxed);
    }
    crate::power::after_fork_in_child();
}

type DeviceLimiter = Mutex<Limiter<MonoClock, EventTimer, FileView>>;

struct Held {
    guard: MutexGuard<'static, Limiter<MonoClock, EventTimer, FileView>>,
    ticket: Ticket,
    key: StreamKey,
}

thread_local! {
    static HELD: RefCell<Option<Held>> = const { RefCell::new(None) };
    static THREAD_TOKEN: Cell<u64> = const { Cell::new(0) };
}

fn device_limiter(d: usize, fns: &'static EventFns) -> &'static DeviceLimiter {
    let p = DEVICES[d].load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: published pointers come from Box::into_raw and are never freed.
        return unsafe { &*p };
    }
    let mut cfg = LimiterConfig {
        policy: policy(),
        ..LimiterConfig::default()
    };
    let t = tuning();
    // The NVML-based contention correction is experimental: NVML's per-process utilization
    // proved unreliable under time slicing on the H200 (docs/sm-limit.md).
    if t.contention_correction {
        cfg.contention_period = 500_000_000;
    }
    cfg.turn_cycle = t.turn_cycle_ms * 1_000_000;
    cfg.turn_lead_in = t.turn_lead_us * 1_000;
    cfg.power_exponent = f64::from(t.power_exponent_pct) / 100.0;
    let view = FileView {
        device: d,
        nvml: NvmlProbe::Unopened,
        turns: TurnProbe::Unopened,
        power_log: PowerLog::default(),
    };
    let limiter = Limiter::new(cfg, MonoClock, EventTimer::new(fns), view);
    let fresh = Box::into_raw(Box::new(Mutex::new(limiter)));
    match DEVICES[d].compare_exchange(ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just published; never freed.
        Ok(_) => unsafe { &*fresh },
        Err(winner) => {
            // SAFETY: `fresh` was never shared.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: published pointers are never freed.
            unsafe { &*winner }
        }
    }
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

/// `CU_STREAM_LEGACY`.
const STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`.
const STREAM_PER_THREAD: usize = 0x2;

/// A stream as the limiter tells streams apart: the per-thread default stream is a
/// different stream in every thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StreamKey {
    handle: usize,
    /// The owning thread's token for the per-thread stream, else 0.
    owner: u64,
}

impl StreamKey {
    fn of(stream: CUstream) -> Self {
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
struct MonoClock;

impl Clock for MonoClock {
    fn now(&self) -> Nanos {
        vgpu_shm::monotonic_ns()
    }
}

type EventCreateFn = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
type EventFn = unsafe extern "C" fn(CUevent) -> CUresult;
type EventRecordFn = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
type EventElapsedFn = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
type StreamIsCapturingFn = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
type CtxGetCurrentFn = unsafe extern "C" fn(*mut CUcontext) -> CUresult;

/// The real driver's event functions.
#[derive(Debug)]
struct EventFns {
    create: EventCreateFn,
    destroy: EventFn,
    record: EventRecordFn,
    query: EventFn,
    elapsed: EventElapsedFn,
    is_capturing: StreamIsCapturingFn,
    ctx_current: CtxGetCurrentFn,
}

/// The event functions, resolved on first use (`None`, logged once, if the driver lacks any).
fn events() -> Option<&'static EventFns> {
    static FNS: AtomicPtr<EventFns> = AtomicPtr::new(ptr::null_mut());
    static FAILED: AtomicBool = AtomicBool::new(false);
    let p = FNS.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: published pointers come from Box::into_raw and are never freed.
        return Some(unsafe { &*p });
    }
    if FAILED.load(Ordering::Relaxed) {
        return None;
    }
    match resolve_events() {
        Some(fns) => {
            let fresh = Box::into_raw(Box::new(fns));
            match FNS.compare_exchange(ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                // SAFETY: just published; never freed.
                Ok(_) => Some(unsafe { &*fresh }),
                Err(winner) => {
                    // SAFETY: `fresh` was never shared.
                    drop(unsafe { Box::from_raw(fresh) });
                    // SAFETY: published pointers are never freed.
                    Some(unsafe { &*winner })
                }
            }
        }
        None => {
            if !FAILED.swap(true, Ordering::Relaxed) {
                vlog!(
                    WARN,
                    "SM limit not enforced: the driver lacks the event functions it needs"
                );
            }
            None
        }
    }
}

#[cold]
fn resolve_events() -> Option<EventFns> {
    let cuda = crate::real::cuda().ok()?;
    let ctx_current = cuda.u.cuCtxGetCurrent?;
    let dlsym = crate::real::real_dlsym()?;
    // SAFETY: RTLD_NOLOAD returns the already-loaded driver (the hook loaded it to get
    // `cuda`) without running any initializer.
    let lib = unsafe {
        libc::dlopen(
            crate::real::LIBCUDA.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NOLOAD,
        )
    };
    if lib.is_null() {
        return None;
    }
    let sym = |names: &[&std::ffi::CStr]| -> Option<*mut c_void> {
        names.iter().find_map(|n| {
            // SAFETY: dlsym on a live handle with a NUL-terminated name.
            let p = unsafe { dlsym(lib, n.as_ptr()) };
            (!p.is_null()).then_some(p)
        })
    };
    // SAFETY: each transmute turns a non-null symbol of the driver into its function of
    // exactly the C signature of the target type (cuda.h).
    unsafe {
        Some(EventFns {
            create: std::mem::transmute::<*mut c_void, EventCreateFn>(sym(&[c"cuEventCreate"])?),
            destroy: std::mem::transmute::<*mut c_void, EventFn>(sym(&[
                c"cuEventDestroy_v2",
                c"cuEventDestroy",
            ])?),
            record: std::mem::transmute::<*mut c_void, EventRecordFn>(sym(&[c"cuEventRecord"])?),
            query: std::mem::transmute::<*mut c_void, EventFn>(sym(&[c"cuEventQuery"])?),
            elapsed: std::mem::transmute::<*mut c_void, EventElapsedFn>(sym(&[
                c"cuEventElapsedTime_v2",
                c"cuEventElapsedTime",
            ])?),
            is_capturing: std::mem::transmute::<*mut c_void, StreamIsCapturingFn>(sym(&[
                c"cuStreamIsCapturing",
            ])?),
            ctx_current,
        })
    }
}

impl EventFns {
    /// Whether `stream` is being captured into a graph. An error counts as "not capturing":
    /// the launch then most likely fails too, and a failing event record only leaves the
    /// launch unmeasured (charged its estimate).
    fn capturing(&self, stream: CUstream) -> bool {
        let mut status: c_int = 0;
        // SAFETY: valid out-pointer; the stream handle is the application's, as it passes
        // it to the launch.
        let r = unsafe { (self.is_capturing)(stream, &mut status) };
        r.is_success() && status != 0
    }

    fn current_context(&self) -> Option<usize> {
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { (self.ctx_current)(&mut ctx) };
        (r.is_success() && !ctx.is_null()).then_some(ctx as usize)
    }
}

/// A recorded event and the context it was created in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EventMarker {
    event: usize,
    ctx: usize,
}

/// CUDA events as the limiter's GPU timer, recycled per context.
struct EventTimer {
    fns: &'static EventFns,
    /// Idle events per context.
    pool: Vec<(usize, Vec<usize>)>,
}

/// Idle events kept per context.
const POOL_PER_CONTEXT: usize = 64;

fn timer_error(r: CUresult) -> TimerError {
    TimerError { code: r.0 as i32 }
}

impl EventTimer {
    fn new(fns: &'static EventFns) -> Self {
        Self {
            fns,
            pool: Vec::new(),
        }
    }

    fn take(&mut self, ctx: usize) -> Option<usize> {
        self.pool.iter_mut().find(|(c, _)| *c == ctx)?.1.pop()
    }

    fn create(&self) -> Result<usize, TimerError> {
        let mut ev: CUevent = ptr::null_mut();
        // SAFETY: valid out-pointer; flags 0 = a timing event that spins on sync.
        let r = unsafe { (self.fns.create)(&mut ev, 0) };
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
}

impl GpuTimer for EventTimer {
    type Stream = StreamKey;
    type Marker = EventMarker;

    fn record(&mut self, stream: StreamKey) -> Result<EventMarker, TimerError> {
        if stream.owner != 0 && stream.owner != thread_token() {
            // Another thread's per-thread stream cannot be named from this thread.
            return Err(TimerError { code: -1 });
        }
        let ctx = self.fns.current_context().ok_or(TimerError { code: -2 })?;
        if let Some(event) = self.take(ctx) {
            if self.record_on(event, stream.handle).is_success() {
                return Ok(EventMarker { event, ctx });
            }
            // A stale pooled event (its context was destroyed and the handle reused).
            self.destroy(event);
        }
        let event = self.create()?;
        let r = self.record_on(event, stream.handle);
        if r.is_success() {
            Ok(EventMarker { event, ctx })
        } else {
            self.destroy(event);
            Err(timer_error(r))
        }
    }

    fn is_complete(&mut self, marker: EventMarker) -> Result<bool, TimerError> {
        // SAFETY: a recorded event we own.
        let r = unsafe { (self.fns.query)(marker.event as CUevent) };
        match r {
            CUresult::SUCCESS => Ok(true),
            CUresult::NOT_READY => Ok(false),
            e => Err(timer_error(e)),
        }
    }

    fn elapsed(&mut self, start: EventMarker, end: EventMarker) -> Result<Nanos, TimerError> {
        let mut ms = 0f32;
        // SAFETY: valid out-pointer; two completed events we own.
        let r =
            unsafe { (self.fns.elapsed)(&mut ms, start.event as CUevent, end.event as CUevent) };
        if r.is_success() {
            Ok((f64::from(ms) * 1e6).max(0.0) as Nanos)
        } else {
            Err(timer_error(r))
        }
    }

    fn release(&mut self, marker: EventMarker) {
        match self.pool.iter_mut().find(|(c, _)| *c == marker.ctx) {
            Some((_, idle)) if idle.len() < POOL_PER_CONTEXT => idle.push(marker.event),
            Some(_) => self.destroy(marker.event),
            None => self.pool.push((marker.ctx, vec![marker.event])),
        }
    }
}

/// The shared file's view of one device (environment limits only until [`attach`]).
struct FileView {
    device: usize,
    nvml: NvmlProbe,
    turns: TurnProbe,
    /// Which power-share conclusions were logged at INFO.
    power_log: PowerLog,
}

/// Announcements older than this are not tenants (three publish periods).
const TURN_MAX_AGE: Nanos = 300_000_000;
/// An entry this stale may be taken over.
const TURN_STALE: Nanos = 1_000_000_000;

/// This container's place on the GPU's turn board.
enum TurnProbe {
    Unopened,
    Unavailable,
    Open { board: TurnBoard, key: u64 },
}

impl TurnProbe {
    #[cold]
    fn open(device: usize) -> Self {
        // `VGPU_TURN_DIR` (vgpu-env), default /tmp/vgpulock; None = off.
        let Some(dir) = tuning().turn_dir.as_deref() else {
            return Self::Unavailable;
        };
        // Containers are told apart by their shared file (one per container); without one
        // this process is its own container.
        let key = match slot().and_then(|s| vgpu_shm::container_key(s.table().path()).ok()) {
            Some(k) => k,
            None => u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        };
        let uuid = crate::real::cuda()
            .ok()
            .and_then(|cuda| crate::driver::device_uuid(cuda, CUdevice(device as c_int)).ok());
        let Some(uuid) = uuid else {
            return Self::Unavailable;
        };
        let path = std::path::Path::new(dir).join(vgpu_shm::board_file_name(&uuid));
        if !std::path::Path::new(dir).is_dir() {
            vlog!(
                INFO,
                "device {device}: no {dir} directory: containers on this GPU do not take turns"
            );
            return Self::Unavailable;
        }
        match TurnBoard::open_or_create(&path) {
            Ok(board) => Self::Open { board, key },
            Err(e) => {
                vlog!(
                    WARN,
                    "device {device}: {e}: containers on this GPU do not take turns"
                );
                Self::Unavailable
            }
        }
    }
}

/// NVML's per-process utilization of one device, for the limiter's contention correction.
enum NvmlProbe {
    Unopened,
    Unavailable,
    Open {
        /// The `nvmlDevice_t` (an address, so the view stays `Send`).
        handle: usize,
        last_seen: u64,
        pid: u32,
        buf: Vec<nvmlProcessUtilizationSample_t>,
    },
}

impl NvmlProbe {
    #[cold]
    fn open(device: usize) -> Self {
        let handle = crate::real::cuda()
            .ok()
            .and_then(|cuda| crate::driver::nvml_device(cuda, CUdevice(device as c_int)));
        match handle {
            Some(handle) => Self::Open {
                handle: handle as usize,
                last_seen: 0,
                pid: std::process::id(),
                buf: Vec::new(),
            },
            None => Self::Unavailable,
        }
    }

    /// Our share and whether others ran, from the samples since the previous call. `None`
    /// when NVML has no sample of this process (for instance when it reports host pids
    /// and this process runs in a pid namespace): then no correction is made.
    fn sample(&mut self, device: usize) -> Option<DeviceSample> {
        if matches!(self, Self::Unopened) {
            *self = Self::open(device);
        }
        let Self::Open {
            handle,
            last_seen,
            pid,
            buf,
        } = self
        else {
            return None;
        };
        crate::driver::nvml_process_utilization(*handle as nvmlDevice_t, *last_seen, buf).ok()?;
        let (mut own, mut n, mut others) = (0u64, 0u64, false);
        for s in buf.iter() {
            *last_seen = (*last_seen).max(s.timeStamp);
            if s.pid == *pid {
                own += u64::from(s.smUtil.min(100));
                n += 1;
            } else if s.smUtil > 0 {
                others = true;
            }
        }
        (n > 0).then(|| DeviceSample {
            own: own as f64 / n as f64 / 100.0,
            others_active: others,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Power share: the device's power from NVML (docs/sm-limit.md), read by the `vgpu-power`
// thread (crate::power) and once before this process's first context on the device (the
// baseline); the launch path only loads the thread's latest reading.

/// Set by the first context creation on a device that records a baseline (at most one per
/// device and process).
static BASELINE_CLAIMED: [AtomicBool; MAX_DEVICES] =
    [const { AtomicBool::new(false) }; MAX_DEVICES];
/// The baseline recorded before the device's first context, until its limiter takes it
/// (from `Box::into_raw`; freed when taken).
static BASELINE: [AtomicPtr<PowerSample>; MAX_DEVICES] =
    [const { AtomicPtr::new(ptr::null_mut()) }; MAX_DEVICES];

/// Just before the hook creates a context on `device`: records the device's power, so that
/// the span from here to the first launch (the device idle, as far as this process goes)
/// measures its idle power. Only the first creation per device counts, and only when the
/// device has an SM limit and the power share is on.
pub(crate) fn context_creating(device: usize) {
    if !enabled() || device >= MAX_DEVICES || tuning().power_exponent_pct == 0 {
        return;
    }
    // The shared file's limit may be the only one.
    find_slot();
    if limit_pct(device) == 0 || BASELINE_CLAIMED[device].swap(true, Ordering::AcqRel) {
        return;
    }
    // Start the reader thread now: its first look, before any work of ours, may already
    // measure the idle power.
    crate::power::want(device);
    let Some(reader) = crate::power::Reader::open(device) else {
        vlog!(
            DEBUG,
            "device {device}: no power baseline: NVML has no handle for it"
        );
        return;
    };
    match reader.read(vgpu_shm::monotonic_ns()) {
        Ok(reading) => {
            // Before this process's first context: a quiet draw is the idle power.
            let sample = PowerSample {
                idle_mw: reading.quiet_draw_mw,
                ..reading.sample
            };
            vlog!(
                DEBUG,
                "device {device}: power baseline before its first context: {} mJ, limit {} mW",
                sample.energy_mj,
                sample.limit_mw
            );
            let fresh = Box::into_raw(Box::new(sample));
            if BASELINE[device]
                .compare_exchange(ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // SAFETY: `fresh` was never shared.
                drop(unsafe { Box::from_raw(fresh) });
            }
        }
        Err(code) => vlog!(
            DEBUG,
            "device {device}: no power baseline: NVML says {code:?}"
        ),
    }
}

/// Hands the device's baseline over (once).
fn take_baseline(device: usize) -> Option<PowerSample> {
    let p = BASELINE
        .get(device)?
        .swap(ptr::null_mut(), Ordering::AcqRel);
    // SAFETY: a non-null pointer here came from `Box::into_raw` in `context_creating`, and
    // the swap made this the only owner.
    (!p.is_null()).then(|| *unsafe { Box::from_raw(p) })
}

/// Decides which of the power share's conclusions are worth an INFO line: the first one
/// that knows the idle power, then any whose scale moved by more than [`SCALE_NEWS`] since
/// the last INFO line (the DEBUG level shows every one).
#[derive(Debug)]
struct PowerLog {
    idle_known: bool,
    scale_at_last_info: f64,
}

/// A change of the power share's scale worth an INFO line.
const SCALE_NEWS: f64 = 0.05;

impl Default for PowerLog {
    fn default() -> Self {
        Self {
            idle_known: false,
            // Before the power share knows anything it scales nothing.
            scale_at_last_info: 1.0,
        }
    }
}

impl PowerLog {
    fn wants_info(&mut self, state: &PowerState) -> bool {
        let idle_news = !self.idle_known && state.idle_watts.is_some();
        self.idle_known |= state.idle_watts.is_some();
        let scale_news = (state.scale - self.scale_at_last_info).abs() > SCALE_NEWS;
        if idle_news || scale_news {
            self.scale_at_last_info = state.scale;
        }
        idle_news || scale_news
    }
}

/// Watts for a log line, `?` while unknown.
struct Watts(Option<f64>);

impl std::fmt::Display for Watts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(w) => write!(f, "{w:.0}"),
            None => f.write_str("?"),
        }
    }
}

impl ContainerView for FileView {
    fn sm_limit_pct(&self) -> u32 {
        limit_pct(self.device)
    }

    fn recent_kernel(&self) -> i32 {
        slot().map_or(0, |s| s.table().recent_kernel())
    }

    fn utilization_switch(&self) -> i32 {
        // Without a file there is no monitor: treat the device as shared.
        slot().map_or(1, |s| s.table().utilization_switch())
    }

    fn peers(&self) -> Vec<PeerShare> {
        let Some(me) = slot() else {
            return Vec::new();
        };
        let snap = me.table().snapshot();
        snap.processes
            .iter()
            .filter(|p| p.slot != me.index() && p.alive)
            .filter_map(|p| p.devices.get(self.device))
            .map(|u| PeerShare {
                util_pct: u.sm_util.min(100) as u32,
                published_at: u.sm_util_at,
            })
            .collect()
    }

    fn publish_util(&mut self, util_pct: u32, now: Nanos) {
        vlog!(
            DEBUG,
            "device {}: achieved SM utilization {util_pct}%",
            self.device
        );
        if let Some(s) = slot() {
            s.publish_sm_util(DeviceIndex(self.device as u32), u64::from(util_pct), now);
        }
    }

    fn note_activity(&mut self, _now: Nanos) {
        // At most once a second (the limiter's activity period), and only in processes with
        // an SM limit: the unlimited launch path stays one relaxed load (docs/sm-limit.md).
        if let Some(s) = slot() {
            s.table().note_kernel_activity();
        }
    }

    fn turn_tenants(&mut self, now: Nanos, launch_ns: u64) -> Option<(u64, Vec<TurnTenant>)> {
        if matches!(self.turns, TurnProbe::Unopened) {
            self.turns = TurnProbe::open(self.device);
        }
        let TurnProbe::Open { board, key } = &mut self.turns else {
            return None;
        };
        let pct = limit_pct(self.device);
        let tenants = match board.announce(*key, pct, launch_ns, now, TURN_STALE, TURN_MAX_AGE) {
            Ok(t) => t,
            Err(e) => {
                vlog!(DEBUG, "device {}: turn board: {e}", self.device);
                return None;
            }
        };
        let tenants = tenants
            .into_iter()
            .map(|t| TurnTenant {
                key: t.key,
                limit_pct: t.limit_pct,
                launch_ns: t.launch_ns,
            })
            .collect();
        Some((*key, tenants))
    }

    fn device_sample(&mut self) -> Option<DeviceSample> {
        let sample = self.nvml.sample(self.device);
        if let Some(s) = sample {
            vlog!(
                DEBUG,
                "device {}: NVML sees this process at {:.0}%{}",
                self.device,
                s.own * 100.0,
                if s.others_active {
                    ", others active"
                } else {
                    ""
                }
            );
        }
        sample
    }

    fn power_sample(&mut self, _now: Nanos) -> Option<PowerSample> {
        // The reader thread's latest (a few atomic loads; NVML is not called here).
        crate::power::latest(self.device)
    }

    fn power_baseline(&mut self) -> Option<PowerSample> {
        take_baseline(self.device)
    }

    fn note_power(&mut self, state: &PowerState) {
        let d = self.device;
        vlog!(
            DEBUG,
            "device {d}: power {:.0} W, busy {:.0}%, idle {} W, busy {} W, limit {:.0} W, scale {:.2}",
            state.watts,
            state.busy * 100.0,
            Watts(state.idle_watts),
            Watts(state.busy_watts),
            state.limit_watts,
            state.scale
        );
        if self.power_log.wants_info(state) {
            vlog!(
                INFO,
                "device {d}: power share: idle {} W, {} W more per busy second, limit {:.0} W: \
                 SM limit scaled by {:.2}",
                Watts(state.idle_watts),
                Watts(state.busy_watts),
                state.limit_watts,
                state.scale
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(idle: Option<f64>, scale: f64) -> PowerState {
        PowerState {
            watts: 300.0,
            busy: 0.5,
            idle_watts: idle,
            busy_watts: idle.map(|_| 400.0),
            limit_watts: 500.0,
            scale,
        }
    }

    #[test]
    fn power_info_lines_when_idle_power_is_learnt_and_when_the_scale_moves() {
        let mut log = PowerLog::default();
        assert!(!log.wants_info(&state(None, 1.0)), "nothing known yet");
        assert!(
            log.wants_info(&state(Some(100.0), 1.0)),
            "idle power learnt"
        );
        assert!(!log.wants_info(&state(Some(100.0), 1.0)));
        assert!(!log.wants_info(&state(Some(100.0), 0.96)), "within 0.05");
        assert!(log.wants_info(&state(Some(100.0), 0.9)), "moved 0.1");
        // Measured from the last INFO line (0.9), not from the previous call.
        assert!(!log.wants_info(&state(Some(100.0), 0.86)));
        assert!(!log.wants_info(&state(Some(100.0), 0.86)));
        assert!(log.wants_info(&state(Some(100.0), 0.84)));
        assert!(
            !log.wants_info(&state(Some(100.0), f64::NAN)),
            "no NaN lines"
        );
    }

    #[test]
    fn a_scale_change_before_the_idle_power_is_known_is_logged_too() {
        let mut log = PowerLog::default();
        assert!(log.wants_info(&state(None, 0.8)));
        assert!(log.wants_info(&state(Some(90.0), 0.8)), "idle power learnt");
    }

    #[test]
    fn watts_show_a_question_mark_while_unknown() {
        assert_eq!(Watts(Some(99.6)).to_string(), "100");
        assert_eq!(Watts(None).to_string(), "?");
    }

    #[test]
    fn a_baseline_is_handed_over_once() {
        let d = MAX_DEVICES - 1;
        assert_eq!(take_baseline(d), None);
        let sample = PowerSample {
            at: 5,
            energy_mj: 7,
            limit_mw: 500_000,
            device_busy: Some(0.0),
            idle_mw: None,
        };
        BASELINE[d].store(Box::into_raw(Box::new(sample)), Ordering::Release);
        assert_eq!(take_baseline(d), Some(sample));
        assert_eq!(take_baseline(d), None);
        assert_eq!(take_baseline(MAX_DEVICES), None, "out of range");
    }
}
