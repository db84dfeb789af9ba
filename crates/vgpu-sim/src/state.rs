//! The simulated driver's state and semantics, in safe Rust: devices, contexts, allocations,
//! virtual memory, pools, arrays, streams, events, modules, kernels and graphs.
//!
//! The exported C functions (`driver.rs`, `nvml.rs`) only translate pointers to and from the
//! methods here. Errors are driver result codes (`u32`).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::codes::*;
use crate::config::{ConfigError, SimConfig};
use crate::engine::{BusyLog, Event, StreamQueue};
use crate::hostmem::{self, HostRegion, PhysMem, VaRange};

/// Result of a simulated driver operation: a value or a driver error code.
pub type CuResult<T> = Result<T, u32>;

/// Granularity of virtual-memory allocations and pool blocks (2 MiB, as on NVIDIA GPUs).
pub const GRANULARITY: u64 = 2 << 20;
/// Alignment and accounting granule of `cuMemAlloc`.
pub const ALLOC_ALIGN: u64 = 512;
/// Row alignment of `cuMemAllocPitch`.
pub const PITCH_ALIGN: u64 = 512;

/// Handle kinds, stored in the low 4 bits of every handle the simulator hands out.
#[allow(missing_docs)]
pub mod tag {
    pub const CTX: u64 = 1;
    pub const STREAM: u64 = 2;
    pub const EVENT: u64 = 3;
    pub const MODULE: u64 = 4;
    pub const FUNC: u64 = 5;
    pub const GRAPH: u64 = 6;
    pub const EXEC: u64 = 7;
    pub const NODE: u64 = 8;
    pub const POOL: u64 = 9;
    pub const ARRAY: u64 = 10;
    pub const MIPMAP: u64 = 11;
    pub const VMM: u64 = 12;
}

/// Encodes an object id as a handle of kind `t`.
pub fn handle(t: u64, id: u64) -> u64 {
    (id << 4) | t
}

/// Decodes a handle of kind `t` (`None` for null or another kind).
pub fn unhandle(t: u64, h: u64) -> Option<u64> {
    (h != 0 && h & 0xf == t).then_some(h >> 4)
}

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

/// One physical device.
#[derive(Debug)]
pub struct Device {
    /// Bytes of memory.
    pub total: u64,
    /// Bytes used by processes outside this one.
    pub other_used: u64,
    /// UUID bytes.
    pub uuid: [u8; 16],
    /// Bytes this process uses (contexts, modules, allocations, pools, arrays).
    pub used: AtomicU64,
    /// Kernel busy time.
    pub busy: BusyLog,
}

impl Device {
    /// Bytes free on the device for everybody.
    pub fn free(&self) -> u64 {
        self.total
            .saturating_sub(self.other_used)
            .saturating_sub(self.used.load(Ordering::Relaxed))
    }

    fn reserve(&self, bytes: u64) -> CuResult<()> {
        let cap = self.total.saturating_sub(self.other_used);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(bytes).filter(|n| *n <= cap)
            })
            .map(|_| ())
            .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)
    }

    fn release(&self, bytes: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(bytes))
            });
    }
}

/// How an allocation was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocKind {
    /// `cuMemAlloc`.
    Device,
    /// `cuMemAllocPitch`.
    Pitch,
    /// `cuMemAllocManaged`.
    Managed,
    /// A block of a memory pool (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`).
    Pool(u64),
    /// A graph memory node's allocation.
    Graph,
}

/// A live allocation.
#[derive(Debug)]
pub struct Alloc {
    /// Bytes asked for.
    pub size: u64,
    /// Bytes taken from the device.
    pub accounted: u64,
    /// Physical device.
    pub dev: usize,
    /// Owning context (freed with it), if any.
    pub ctx: Option<u64>,
    /// How it was made.
    pub kind: AllocKind,
    region: Arc<HostRegion>,
}

#[derive(Debug)]
struct Phys {
    size: u64,
    dev: Option<usize>,
    mem: Arc<PhysMem>,
    prop: [u8; 32],
    refs: u32,
    maps: u32,
}

#[derive(Debug)]
struct Mapping {
    size: u64,
    handle: u64,
    va: u64,
}

#[derive(Debug)]
struct Pool {
    dev: usize,
    free: Vec<(u64, Arc<HostRegion>)>,
    reserved: u64,
    used: u64,
    reserved_high: u64,
    used_high: u64,
    threshold: u64,
    reuse: [i32; 3],
    destroyed: bool,
}

/// An array's descriptor (the 3D form; 1D/2D arrays have zero height/depth).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArrayDesc {
    /// Width in elements.
    pub width: u64,
    /// Height (0 for 1D).
    pub height: u64,
    /// Depth (0 for 1D/2D).
    pub depth: u64,
    /// `CUarray_format`.
    pub format: u32,
    /// Channels: 1, 2 or 4.
    pub channels: u32,
    /// `CUDA_ARRAY3D_*` flags.
    pub flags: u32,
}

impl ArrayDesc {
    fn elem_bytes(&self) -> CuResult<u64> {
        let per = match self.format {
            0x01 | 0x08 => 1,
            0x02 | 0x09 | 0x10 => 2,
            0x03 | 0x0a | 0x20 => 4,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        if !matches!(self.channels, 1 | 2 | 4) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(per * self.channels as u64)
    }

    /// Bytes this array occupies on the simulated device.
    pub fn bytes(&self) -> CuResult<u64> {
        let layered = self.flags & 0x1 != 0;
        if self.width == 0 || (self.height == 0 && self.depth != 0 && !layered) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let b = self
            .width
            .checked_mul(self.height.max(1))
            .and_then(|v| v.checked_mul(self.depth.max(1)))
            .and_then(|v| v.checked_mul(self.elem_bytes().ok()?))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        round_up(b, ALLOC_ALIGN).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    fn level(&self, l: u32) -> ArrayDesc {
        let shrink = |v: u64| if v == 0 { 0 } else { (v >> l).max(1) };
        ArrayDesc {
            width: shrink(self.width),
            height: shrink(self.height),
            depth: shrink(self.depth),
            ..*self
        }
    }
}

#[derive(Debug)]
struct Array {
    dev: usize,
    ctx: u64,
    bytes: u64,
    desc: ArrayDesc,
    levels: u32,
    /// For a level of a mipmapped array: owned by the parent, not freed on its own.
    parent: Option<u64>,
}

#[derive(Debug)]
struct Stream {
    ctx: u64,
    flags: u32,
    q: Arc<StreamQueue>,
    capture: Option<Capture>,
}

/// A stream capture in progress.
#[derive(Debug, Clone, Copy)]
struct Capture {
    graph: u64,
    /// `CUstreamCaptureMode`: 0 global, 1 thread-local, 2 relaxed.
    mode: u32,
    thread: std::thread::ThreadId,
    /// A prohibited call was made while it ran: ending it fails.
    invalidated: bool,
}

/// The built-in kernels a simulated module can contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// `spin(u64 ns)`: keeps its stream busy for `ns` nanoseconds.
    Spin,
    /// `fill(u32* p, u32 value, u64 count)`: writes `count` words.
    Fill,
    /// Any other entry: does nothing.
    Noop,
}

impl Kernel {
    /// Kernel for an entry name.
    pub fn by_name(name: &str) -> Kernel {
        match name {
            "spin" => Kernel::Spin,
            "fill" => Kernel::Fill,
            _ => Kernel::Noop,
        }
    }

    /// Sizes of its parameters, in order.
    pub fn param_sizes(self) -> &'static [usize] {
        match self {
            Kernel::Spin => &[8],
            Kernel::Fill => &[8, 4, 8],
            Kernel::Noop => &[],
        }
    }
}

#[derive(Debug)]
struct Module {
    ctx: u64,
    dev: usize,
    entries: Vec<String>,
    /// Device memory its code takes now (0 until loaded under lazy loading).
    accounted: u64,
    /// Its code is on the device (at load when eager, at the first launch when lazy).
    loaded: bool,
}

#[derive(Debug, Clone)]
struct Func {
    module: u64,
    kernel: Kernel,
}

/// A kernel launch, as queued or as stored in a graph.
#[derive(Debug, Clone)]
pub struct Launch {
    /// What runs.
    pub kernel: Kernel,
    /// Physical device.
    pub dev: usize,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Parameters, packed in order at their natural sizes.
    pub args: Vec<u8>,
}

impl Launch {
    fn arg_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.args[off..off + 8]);
        u64::from_le_bytes(b)
    }

    fn arg_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.args[off..off + 4]);
        u32::from_le_bytes(b)
    }
}

#[derive(Debug, Clone)]
enum Node {
    Kernel(Launch),
    Empty,
    MemAlloc { dev: usize, dptr: u64 },
    MemFree { dptr: u64 },
}

#[derive(Debug, Default)]
struct Graph {
    nodes: Vec<(u64, Node)>,
}

#[derive(Debug)]
struct GraphAlloc {
    dev: usize,
    size: u64,
    region: Arc<HostRegion>,
    backed: bool,
    live: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct GraphMemStats {
    used: u64,
    reserved: u64,
    used_high: u64,
    reserved_high: u64,
}

#[derive(Debug)]
struct Ctx {
    dev: usize,
    ordinal: i32,
    flags: u32,
    primary: bool,
    null_stream: Arc<StreamQueue>,
    limits: HashMap<u32, u64>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Primary {
    ctx: Option<u64>,
    refs: u32,
    flags: u32,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    ctxs: HashMap<u64, Ctx>,
    primary: Vec<Primary>,
    allocs: BTreeMap<u64, Alloc>,
    phys: HashMap<u64, Phys>,
    vas: BTreeMap<u64, VaRange>,
    maps: BTreeMap<u64, Mapping>,
    pools: HashMap<u64, Pool>,
    default_pool: Vec<Option<u64>>,
    current_pool: Vec<Option<u64>>,
    arrays: HashMap<u64, Array>,
    streams: HashMap<u64, Stream>,
    events: HashMap<u64, Arc<Event>>,
    modules: HashMap<u64, Module>,
    funcs: HashMap<u64, Func>,
    graphs: HashMap<u64, Graph>,
    execs: HashMap<u64, Vec<Node>>,
    graph_allocs: HashMap<u64, GraphAlloc>,
    graph_mem: Vec<GraphMemStats>,
    host_allocs: HashMap<u64, Arc<HostRegion>>,
}

impl State {
    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// The allocation containing `[p, p + len)`, if any.
    fn alloc_at(&self, p: u64) -> Option<(&u64, &Alloc)> {
        self.allocs
            .range(..=p)
            .next_back()
            .filter(|(b, a)| p < *b + a.size.max(1))
    }

    fn map_at(&self, p: u64) -> Option<(&u64, &Mapping)> {
        self.maps
            .range(..=p)
            .next_back()
            .filter(|(b, m)| p < *b + m.size)
    }

    /// Whether `[p, p + len)` is device memory this process may touch.
    fn check_range(&self, p: u64, len: u64) -> CuResult<()> {
        if len == 0 {
            return Ok(());
        }
        let end = p.checked_add(len - 1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((b, a)) = self.alloc_at(p) {
            let cap = (a.region.len() as u64).max(a.size);
            if end < *b + cap {
                return Ok(());
            }
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // Virtual-memory ranges may span several adjacent mappings.
        let mut at = p;
        while at <= end {
            let (b, m) = self.map_at(at).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            at = b + m.size;
        }
        Ok(())
    }

    fn is_device_range(&self, p: u64, len: u64) -> bool {
        self.check_range(p, len).is_ok()
    }
}

thread_local! {
    static CTX_STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    static PER_THREAD_STREAMS: RefCell<HashMap<u64, Arc<StreamQueue>>> = RefCell::new(HashMap::new());
}

/// The simulated machine and driver.
#[derive(Debug)]
pub struct Sim {
    /// Configuration read at start.
    pub cfg: SimConfig,
    /// Physical devices (NVML order).
    pub devices: Vec<Device>,
    pid: u32,
    inited: AtomicBool,
    st: Mutex<State>,
    fault_calls: Vec<AtomicU64>,
}

static SIM: OnceLock<Result<Sim, ConfigError>> = OnceLock::new();

/// Set in a child after `fork`: the parent's driver state is not usable there.
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// The process-wide simulator (configured from the environment on first use).
pub fn global() -> Result<&'static Sim, u32> {
    match SIM.get_or_init(|| SimConfig::from_env().map(Sim::new)) {
        Ok(s) => Ok(s),
        Err(e) => {
            static SAID: AtomicBool = AtomicBool::new(false);
            if !SAID.swap(true, Ordering::Relaxed) {
                eprintln!("{e}");
            }
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

/// The simulator if `cuInit` succeeded in this process, else `CUDA_ERROR_NOT_INITIALIZED`.
pub fn inited() -> CuResult<&'static Sim> {
    match SIM.get() {
        Some(Ok(s)) if s.inited.load(Ordering::Acquire) && !FORKED.load(Ordering::Relaxed) => Ok(s),
        _ => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

/// Per-parameter value of `cuPointerGetAttribute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtrAttr {
    /// A 32-bit value.
    U32(u32),
    /// A 64-bit value (pointers, sizes, handles).
    U64(u64),
}

impl Sim {
    /// A simulator for `cfg` (not yet initialized).
    pub fn new(cfg: SimConfig) -> Sim {
        let devices = cfg
            .devices
            .iter()
            .map(|d| Device {
                total: d.total_mem,
                other_used: d.other_used,
                uuid: d.uuid,
                used: AtomicU64::new(0),
                busy: BusyLog::new(cfg.power),
            })
            .collect::<Vec<_>>();
        let n = devices.len();
        static AT_FORK: std::sync::Once = std::sync::Once::new();
        AT_FORK.call_once(|| crate::hostmem::at_fork_child(forked_child));
        let st = State {
            primary: vec![Primary::default(); n],
            default_pool: vec![None; n],
            current_pool: vec![None; n],
            graph_mem: vec![GraphMemStats::default(); n],
            ..State::default()
        };
        Sim {
            fault_calls: cfg.faults.iter().map(|_| AtomicU64::new(0)).collect(),
            cfg,
            devices,
            pid: std::process::id(),
            inited: AtomicBool::new(false),
            st: Mutex::new(st),
        }
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `cuInit`.
    pub fn init(&self, flags: u32) -> CuResult<()> {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if FORKED.load(Ordering::Relaxed) {
            // Like the real driver: a child forked after initialization cannot use it.
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        }
        if self.cfg.visible.is_empty() {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        self.inited.store(true, Ordering::Release);
        Ok(())
    }

    /// Applies injected faults for entry point `op`; `alloc` marks allocating calls.
    pub fn fault(&self, op: &str, alloc: bool) -> CuResult<()> {
        for (i, f) in self.cfg.faults.iter().enumerate() {
            if f.op == op || (alloc && f.op == "alloc") {
                let n = self.fault_calls[i].fetch_add(1, Ordering::Relaxed) + 1;
                if f.nth.is_none_or(|k| k == n) {
                    return Err(f.code);
                }
            }
        }
        Ok(())
    }

    // ----- devices -----

    /// Visible device count.
    pub fn device_count(&self) -> usize {
        self.cfg.visible.len()
    }

    /// Physical index of CUDA ordinal `ord`.
    pub fn phys(&self, ord: i32) -> CuResult<usize> {
        usize::try_from(ord)
            .ok()
            .and_then(|o| self.cfg.visible.get(o).copied())
            .ok_or(CUDA_ERROR_INVALID_DEVICE)
    }

    /// CUDA ordinal of physical device `p`, if visible.
    pub fn ordinal_of(&self, p: usize) -> Option<i32> {
        self.cfg
            .visible
            .iter()
            .position(|&v| v == p)
            .map(|o| o as i32)
    }

    /// `cuDeviceGetAttribute`.
    pub fn attribute(&self, attr: i32, ord: i32) -> CuResult<i32> {
        let p = self.phys(ord)?;
        let (maj, min) = self.cfg.compute_capability;
        Ok(match attr {
            1 => 1024,
            2 | 3 => 1024,
            4 => 64,
            5 => i32::MAX,
            6 | 7 => 65535,
            8 => 49152,
            9 => 65536,
            10 => 32,
            11 => i32::MAX,
            12 => 65536,
            13 => 1_980_000,
            14 => 512,
            15 => 1,
            16 => self.cfg.sm_count,
            17 | 18 => 0,
            19 => 1,
            20 => 0,
            31 => 1,
            32 => 1,
            33 => p as i32 + 1,
            34 | 35 => 0,
            36 => 2_619_000,
            37 => 5120,
            38 => 60 << 20,
            39 => 2048,
            40 => 2,
            41 => 1,
            50 => 0,
            75 => maj,
            76 => min,
            81 => 228 << 10,
            82 => 65536,
            83 => 1,
            84 => 0,
            86 => 1,
            88 => 1,
            89 => 1,
            95 => 1,
            97 => 227 << 10,
            102 => 1,
            106 => 32,
            115 => 1,
            116 => 0b1,
            a if (0..=160).contains(&a) => 0,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    }

    // ----- contexts -----

    fn new_ctx(&self, st: &mut State, ord: i32, flags: u32, primary: bool) -> CuResult<u64> {
        let p = self.phys(ord)?;
        self.devices[p].reserve(self.cfg.ctx_overhead)?;
        let id = st.id();
        st.ctxs.insert(
            id,
            Ctx {
                dev: p,
                ordinal: ord,
                flags,
                primary,
                null_stream: StreamQueue::new(),
                limits: HashMap::new(),
            },
        );
        Ok(id)
    }

    /// Frees everything a context owns (allocations, arrays, modules, streams).
    fn clear_ctx(&self, st: &mut State, id: u64) {
        let bases: Vec<u64> = st
            .allocs
            .iter()
            .filter(|(_, a)| {
                a.ctx == Some(id) && !matches!(a.kind, AllocKind::Pool(_) | AllocKind::Graph)
            })
            .map(|(b, _)| *b)
            .collect();
        for b in bases {
            if let Some(a) = st.allocs.remove(&b) {
                self.devices[a.dev].release(a.accounted);
            }
        }
        let arrays: Vec<u64> = st
            .arrays
            .iter()
            .filter(|(_, a)| a.ctx == id)
            .map(|(k, _)| *k)
            .collect();
        for k in arrays {
            if let Some(a) = st.arrays.remove(&k)
                && a.parent.is_none()
            {
                self.devices[a.dev].release(a.bytes);
            }
        }
        let mods: Vec<u64> = st
            .modules
            .iter()
            .filter(|(_, m)| m.ctx == id)
            .map(|(k, _)| *k)
            .collect();
        for k in mods {
            if let Some(m) = st.modules.remove(&k) {
                self.devices[m.dev].release(m.accounted);
                st.funcs.retain(|_, f| f.module != k);
            }
        }
        let streams: Vec<u64> = st
            .streams
            .iter()
            .filter(|(_, s)| s.ctx == id)
            .map(|(k, _)| *k)
            .collect();
        for k in streams {
            if let Some(s) = st.streams.remove(&k) {
                s.q.close();
            }
        }
    }

    fn destroy_ctx(&self, st: &mut State, id: u64) {
        self.clear_ctx(st, id);
        if let Some(c) = st.ctxs.remove(&id) {
            c.null_stream.close();
            self.devices[c.dev].release(self.cfg.ctx_overhead);
        }
    }

    fn ctx_waits(&self, id: u64) -> Vec<Arc<StreamQueue>> {
        let st = self.st();
        let mut qs: Vec<Arc<StreamQueue>> = st
            .streams
            .values()
            .filter(|s| s.ctx == id)
            .map(|s| s.q.clone())
            .collect();
        if let Some(c) = st.ctxs.get(&id) {
            qs.push(c.null_stream.clone());
        }
        drop(st);
        PER_THREAD_STREAMS.with(|m| {
            if let Some(q) = m.borrow().get(&id) {
                qs.push(q.clone());
            }
        });
        qs
    }

    /// `cuCtxCreate`: a new context, made current.
    pub fn ctx_create(&self, flags: u32, ord: i32) -> CuResult<u64> {
        let mut st = self.st();
        let id = self.new_ctx(&mut st, ord, flags, false)?;
        drop(st);
        CTX_STACK.with(|s| s.borrow_mut().push(id));
        Ok(id)
    }

    /// `cuCtxDestroy`.
    pub fn ctx_destroy(&self, id: u64) -> CuResult<()> {
        let mut st = self.st();
        match st.ctxs.get(&id) {
            None => return Err(CUDA_ERROR_INVALID_CONTEXT),
            Some(c) if c.primary => return Err(CUDA_ERROR_INVALID_CONTEXT),
            Some(_) => {}
        }
        drop(st);
        for q in self.ctx_waits(id) {
            q.drain();
        }
        st = self.st();
        self.destroy_ctx(&mut st, id);
        drop(st);
        CTX_STACK.with(|s| s.borrow_mut().retain(|&c| c != id));
        Ok(())
    }

    /// The calling thread's current context.
    pub fn current(&self) -> CuResult<u64> {
        let id = CTX_STACK
            .with(|s| s.borrow().last().copied())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if self.st().ctxs.contains_key(&id) {
            Ok(id)
        } else {
            Err(CUDA_ERROR_INVALID_CONTEXT)
        }
    }

    /// The current context id or 0 (`cuCtxGetCurrent`).
    pub fn current_or_null(&self) -> u64 {
        CTX_STACK.with(|s| s.borrow().last().copied()).unwrap_or(0)
    }

    /// `cuCtxSetCurrent` (0 pops).
    pub fn set_current(&self, id: u64) -> CuResult<()> {
        if id != 0 && !self.st().ctxs.contains_key(&id) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        CTX_STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            if id != 0 {
                s.push(id);
            }
        });
        Ok(())
    }

    /// `cuCtxPushCurrent`.
    pub fn push(&self, id: u64) -> CuResult<()> {
        if !self.st().ctxs.contains_key(&id) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        CTX_STACK.with(|s| s.borrow_mut().push(id));
        Ok(())
    }

    /// `cuCtxPopCurrent`.
    pub fn pop(&self) -> CuResult<u64> {
        CTX_STACK
            .with(|s| s.borrow_mut().pop())
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)
    }

    /// CUDA ordinal, flags and physical device of context `id` (0 = current).
    pub fn ctx_info(&self, id: u64) -> CuResult<(i32, u32, usize)> {
        let id = if id == 0 { self.current()? } else { id };
        let st = self.st();
        let c = st.ctxs.get(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok((c.ordinal, c.flags, c.dev))
    }

    /// `cuCtxSynchronize`.
    pub fn ctx_sync(&self, id: u64) -> CuResult<()> {
        let id = if id == 0 { self.current()? } else { id };
        for q in self.ctx_waits(id) {
            q.drain();
        }
        self.trim_pools_at_sync();
        Ok(())
    }

    /// `cuCtxSetLimit` / `cuCtxGetLimit`.
    pub fn ctx_limit(&self, limit: u32, set: Option<u64>) -> CuResult<u64> {
        let id = self.current()?;
        if limit > 6 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = self.st();
        let c = st.ctxs.get_mut(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if let Some(v) = set {
            c.limits.insert(limit, v);
        }
        let default = match limit {
            0 => 1024,
            1 => 1 << 20,
            2 => 8 << 20,
            3 => 2,
            4 => 2048,
            _ => 0,
        };
        Ok(*c.limits.get(&limit).unwrap_or(&default))
    }

    /// `cuDevicePrimaryCtxRetain`.
    pub fn primary_retain(&self, ord: i32) -> CuResult<u64> {
        let p = self.phys(ord)?;
        let mut st = self.st();
        let pr = st.primary[p];
        let id = match pr.ctx {
            Some(id) => id,
            None => self.new_ctx(&mut st, ord, pr.flags, true)?,
        };
        st.primary[p].ctx = Some(id);
        st.primary[p].refs += 1;
        Ok(id)
    }

    /// `cuDevicePrimaryCtxRelease`: the context is destroyed when the last reference goes.
    pub fn primary_release(&self, ord: i32) -> CuResult<()> {
        let p = self.phys(ord)?;
        let st = self.st();
        let pr = st.primary[p];
        let Some(id) = pr.ctx.filter(|_| pr.refs > 0) else {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        };
        drop(st);
        if pr.refs == 1 {
            for q in self.ctx_waits(id) {
                q.drain();
            }
        }
        let mut st = self.st();
        st.primary[p].refs -= 1;
        if st.primary[p].refs == 0 {
            st.primary[p].ctx = None;
            self.destroy_ctx(&mut st, id);
        }
        Ok(())
    }

    /// `cuDevicePrimaryCtxReset`: frees everything the primary context owns.
    pub fn primary_reset(&self, ord: i32) -> CuResult<()> {
        let p = self.phys(ord)?;
        let id = self.st().primary[p].ctx;
        if let Some(id) = id {
            for q in self.ctx_waits(id) {
                q.drain();
            }
            let mut st = self.st();
            self.clear_ctx(&mut st, id);
        }
        Ok(())
    }

    /// `cuDevicePrimaryCtxGetState`: (flags, active).
    pub fn primary_state(&self, ord: i32) -> CuResult<(u32, bool)> {
        let p = self.phys(ord)?;
        let pr = self.st().primary[p];
        Ok((pr.flags, pr.refs > 0))
    }

    /// `cuDevicePrimaryCtxSetFlags`.
    pub fn primary_set_flags(&self, ord: i32, flags: u32) -> CuResult<()> {
        let p = self.phys(ord)?;
        self.st().primary[p].flags = flags;
        Ok(())
    }

    // ----- plain allocations -----

    fn cur_dev(&self) -> CuResult<(u64, usize)> {
        let id = self.current()?;
        let st = self.st();
        let c = st.ctxs.get(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok((id, c.dev))
    }

    fn alloc_in(&self, size: u64, accounted: u64, kind: AllocKind) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (ctx, dev) = self.cur_dev()?;
        self.devices[dev].reserve(accounted)?;
        let Some(region) = HostRegion::new(size as usize) else {
            self.devices[dev].release(accounted);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        let base = region.addr();
        let a = Alloc {
            size,
            accounted,
            dev,
            ctx: Some(ctx),
            kind,
            region: Arc::new(region),
        };
        self.st().allocs.insert(base, a);
        Ok(base)
    }

    /// `cuMemAlloc_v2`.
    pub fn mem_alloc(&self, size: u64) -> CuResult<u64> {
        let acc = round_up(size, ALLOC_ALIGN).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.alloc_in(size, acc, AllocKind::Device)
    }

    /// `cuMemAllocPitch_v2`: (pointer, pitch).
    pub fn mem_alloc_pitch(&self, width: u64, height: u64, elem: u32) -> CuResult<(u64, u64)> {
        if !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let pitch = round_up(width, PITCH_ALIGN).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let size = pitch.checked_mul(height).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        Ok((self.alloc_in(size, size, AllocKind::Pitch)?, pitch))
    }

    /// `cuMemAllocManaged` (counted on the current context's device).
    pub fn mem_alloc_managed(&self, size: u64, flags: u32) -> CuResult<u64> {
        if !matches!(flags, 1 | 2) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let acc = round_up(size, ALLOC_ALIGN).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.alloc_in(size, acc, AllocKind::Managed)
    }

    /// `cuMemFree_v2`: any allocation base, stream-ordered ones included.
    pub fn mem_free(&self, p: u64) -> CuResult<()> {
        if p == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut st = self.st();
        match st.allocs.get(&p).map(|a| a.kind) {
            None => Err(CUDA_ERROR_INVALID_VALUE),
            Some(AllocKind::Graph) => {
                drop(st);
                self.graph_unlive(p);
                Ok(())
            }
            Some(_) => {
                let a = st.allocs.remove(&p).expect("present");
                self.drop_alloc(&mut st, a);
                Ok(())
            }
        }
    }

    fn drop_alloc(&self, st: &mut State, a: Alloc) {
        match a.kind {
            AllocKind::Pool(pid) => {
                if let Some(pool) = st.pools.get_mut(&pid) {
                    pool.used = pool.used.saturating_sub(a.accounted);
                    if pool.destroyed {
                        pool.reserved = pool.reserved.saturating_sub(a.accounted);
                        self.devices[a.dev].release(a.accounted);
                    } else {
                        pool.free.push((a.accounted, a.region));
                    }
                }
            }
            _ => self.devices[a.dev].release(a.accounted),
        }
    }

    /// `cuMemGetInfo_v2`: (free, total) of the current context's device.
    pub fn mem_info(&self) -> CuResult<(u64, u64)> {
        let (_, dev) = self.cur_dev()?;
        let d = &self.devices[dev];
        Ok((d.free(), d.total))
    }

    /// `cuMemGetAddressRange_v2`: (base, size) of the allocation or mapping containing `p`.
    pub fn address_range(&self, p: u64) -> CuResult<(u64, u64)> {
        let st = self.st();
        if let Some((b, a)) = st.alloc_at(p) {
            return Ok((*b, a.size));
        }
        if let Some((b, m)) = st.map_at(p) {
            return Ok((*b, m.size));
        }
        Err(CUDA_ERROR_NOT_FOUND)
    }

    /// `cuPointerGetAttribute`.
    pub fn pointer_attr(&self, attr: u32, p: u64) -> CuResult<PtrAttr> {
        let st = self.st();
        let found = if let Some((b, a)) = st.alloc_at(p) {
            Some((
                *b,
                a.size,
                a.dev,
                a.ctx.unwrap_or(0),
                a.kind == AllocKind::Managed,
                a.kind,
            ))
        } else {
            st.map_at(p).map(|(b, m)| {
                let dev = st.phys.get(&m.handle).and_then(|h| h.dev).unwrap_or(0);
                (*b, m.size, dev, 0, false, AllocKind::Device)
            })
        };
        let Some((base, size, dev, ctx, managed, kind)) = found else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        let ord = self.ordinal_of(dev).unwrap_or(0);
        Ok(match attr {
            1 => PtrAttr::U64(if ctx == 0 { 0 } else { handle(tag::CTX, ctx) }),
            2 => PtrAttr::U32(if managed { 4 } else { 2 }),
            3 => PtrAttr::U64(p),
            4 if managed => PtrAttr::U64(p),
            4 => return Err(CUDA_ERROR_INVALID_VALUE),
            6 => PtrAttr::U32(0),
            7 => PtrAttr::U64(base),
            8 => PtrAttr::U32(managed as u32),
            9 => PtrAttr::U32(ord as u32),
            10 => PtrAttr::U32(matches!(kind, AllocKind::Device | AllocKind::Pitch) as u32),
            11 => PtrAttr::U64(base),
            12 => PtrAttr::U64(size),
            13 => PtrAttr::U32(1),
            14 => PtrAttr::U64(0),
            15 => PtrAttr::U32(0),
            16 => PtrAttr::U32(3),
            17 => match kind {
                AllocKind::Pool(pid) => PtrAttr::U64(handle(tag::POOL, pid)),
                _ => PtrAttr::U64(0),
            },
            18 => PtrAttr::U64(size),
            19 => PtrAttr::U64(base),
            20 => PtrAttr::U64(base),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    }

    /// Whether `p` lies in device memory of this process.
    pub fn is_device_ptr(&self, p: u64) -> bool {
        self.st().is_device_range(p, 1)
    }

    // ----- copies and memsets -----

    fn sync_current(&self) -> CuResult<()> {
        let id = self.current()?;
        for q in self.ctx_waits(id) {
            q.drain();
        }
        Ok(())
    }

    /// Synchronous copy; `dst_dev`/`src_dev` say which side must be device memory.
    pub fn memcpy(&self, dst: u64, src: u64, n: u64, dst_dev: bool, src_dev: bool) -> CuResult<()> {
        self.sync_current()?;
        self.copy_now(dst, src, n, dst_dev, src_dev)
    }

    fn copy_now(&self, dst: u64, src: u64, n: u64, dst_dev: bool, src_dev: bool) -> CuResult<()> {
        let st = self.st();
        if (dst_dev && st.check_range(dst, n).is_err())
            || (src_dev && st.check_range(src, n).is_err())
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if (!dst_dev && dst == 0) || (!src_dev && src == 0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: device ranges were checked against live allocations under the lock, which we
        // still hold; host ranges are the caller's promise, as with the real driver.
        unsafe { hostmem::copy(dst, src, n as usize) };
        Ok(())
    }

    /// Synchronous memset of `count` elements of `elem` bytes.
    pub fn memset(&self, dst: u64, value: u32, elem: usize, count: u64) -> CuResult<()> {
        self.sync_current()?;
        self.set_now(dst, value, elem, count)
    }

    fn set_now(&self, dst: u64, value: u32, elem: usize, count: u64) -> CuResult<()> {
        let st = self.st();
        let len = count
            .checked_mul(elem as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.check_range(dst, len)?;
        // SAFETY: checked above against live device memory, lock held.
        unsafe { hostmem::fill(dst, value, elem, count as usize) };
        Ok(())
    }

    /// Stream-ordered copy.
    pub fn memcpy_async(
        &'static self,
        dst: u64,
        src: u64,
        n: u64,
        dirs: (bool, bool),
        stream: u64,
        per_thread: bool,
    ) -> CuResult<()> {
        let (q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        {
            let st = self.st();
            if (dirs.0 && st.check_range(dst, n).is_err())
                || (dirs.1 && st.check_range(src, n).is_err())
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        q.submit(Box::new(move || {
            let _ = self.copy_now(dst, src, n, dirs.0, dirs.1);
        }));
        Ok(())
    }

    /// Stream-ordered memset.
    pub fn memset_async(
        &'static self,
        dst: u64,
        value: u32,
        elem: usize,
        count: u64,
        stream: u64,
        per_thread: bool,
    ) -> CuResult<()> {
        let (q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        self.st()
            .check_range(dst, count.saturating_mul(elem as u64))?;
        q.submit(Box::new(move || {
            let _ = self.set_now(dst, value, elem, count);
        }));
        Ok(())
    }

    // ----- pinned host memory (not device memory; not counted) -----

    /// `cuMemAllocHost` / `cuMemHostAlloc`.
    pub fn host_alloc(&self, size: u64) -> CuResult<u64> {
        self.current()?;
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let r = HostRegion::new(size as usize).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let a = r.addr();
        self.st().host_allocs.insert(a, Arc::new(r));
        Ok(a)
    }

    /// `cuMemFreeHost`.
    pub fn host_free(&self, p: u64) -> CuResult<()> {
        self.st()
            .host_allocs
            .remove(&p)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    // ----- virtual memory management -----

    /// `cuMemCreate`: `location` is `Some(ordinal)` for device memory, `None` for host memory.
    pub fn mem_create(&self, size: u64, location: Option<i32>, prop: [u8; 32]) -> CuResult<u64> {
        if size == 0 || size % GRANULARITY != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = location.map(|o| self.phys(o)).transpose()?;
        if let Some(d) = dev {
            self.devices[d].reserve(size)?;
        }
        let Some(mem) = PhysMem::new(size as usize) else {
            if let Some(d) = dev {
                self.devices[d].release(size);
            }
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        };
        let mut st = self.st();
        let id = st.id();
        st.phys.insert(
            id,
            Phys {
                size,
                dev,
                mem: Arc::new(mem),
                prop,
                refs: 1,
                maps: 0,
            },
        );
        Ok(handle(tag::VMM, id))
    }

    fn phys_maybe_free(&self, st: &mut State, id: u64) {
        if let Some(ph) = st.phys.get(&id)
            && ph.refs == 0
            && ph.maps == 0
        {
            let ph = st.phys.remove(&id).expect("present");
            if let Some(d) = ph.dev {
                self.devices[d].release(ph.size);
            }
        }
    }

    /// `cuMemRelease`: memory goes back once it is also unmapped everywhere.
    pub fn mem_release(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::VMM, h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        let ph = st
            .phys
            .get_mut(&id)
            .filter(|p| p.refs > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        ph.refs -= 1;
        self.phys_maybe_free(&mut st, id);
        Ok(())
    }

    /// `cuMemAddressReserve`.
    pub fn address_reserve(&self, size: u64, align: u64) -> CuResult<u64> {
        if size == 0 || size % GRANULARITY != 0 || (align != 0 && !align.is_power_of_two()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let va = VaRange::new(size as usize, align.max(GRANULARITY) as usize)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let a = va.addr();
        self.st().vas.insert(a, va);
        Ok(a)
    }

    /// `cuMemAddressFree`.
    pub fn address_free(&self, p: u64, size: u64) -> CuResult<()> {
        let mut st = self.st();
        if st.vas.get(&p).is_none_or(|v| v.len() as u64 != size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inside: Vec<u64> = st.maps.range(p..p + size).map(|(k, _)| *k).collect();
        for k in inside {
            let m = st.maps.remove(&k).expect("present");
            if let Some(ph) = st.phys.get_mut(&m.handle) {
                ph.maps -= 1;
            }
            self.phys_maybe_free(&mut st, m.handle);
        }
        st.vas.remove(&p);
        Ok(())
    }

    /// `cuMemMap`.
    pub fn mem_map(&self, p: u64, size: u64, offset: u64, h: u64) -> CuResult<()> {
        let id = unhandle(tag::VMM, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let ph = st
            .phys
            .get(&id)
            .filter(|p| p.refs > 0)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if size == 0 || offset.checked_add(size).is_none_or(|e| e > ph.size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mem = ph.mem.clone();
        let (&vb, va) = st
            .vas
            .range(..=p)
            .next_back()
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if p + size > vb + va.len() as u64 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if st.maps.range(p..p + size).next().is_some() || st.map_at(p).is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if !va.map(p, size as usize, &mem, offset as usize) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        st.phys.get_mut(&id).expect("present").maps += 1;
        st.maps.insert(
            p,
            Mapping {
                size,
                handle: id,
                va: vb,
            },
        );
        Ok(())
    }

    /// `cuMemUnmap`.
    pub fn mem_unmap(&self, p: u64, size: u64) -> CuResult<()> {
        let mut st = self.st();
        let inside: Vec<u64> = st
            .maps
            .range(p..p.saturating_add(size))
            .map(|(k, _)| *k)
            .collect();
        if inside.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for k in inside {
            let m = st.maps.remove(&k).expect("present");
            if let Some(va) = st.vas.get(&m.va) {
                va.unmap(k, m.size as usize);
            }
            if let Some(ph) = st.phys.get_mut(&m.handle) {
                ph.maps -= 1;
            }
            self.phys_maybe_free(&mut st, m.handle);
        }
        Ok(())
    }

    /// `cuMemSetAccess`: the range must be mapped.
    pub fn set_access(&self, p: u64, size: u64) -> CuResult<()> {
        self.st().check_range(p, size)
    }

    /// `cuMemGetAllocationPropertiesFromHandle`.
    pub fn handle_props(&self, h: u64) -> CuResult<[u8; 32]> {
        let id = unhandle(tag::VMM, h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.st()
            .phys
            .get(&id)
            .map(|p| p.prop)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `cuMemRetainAllocationHandle`.
    pub fn retain_handle(&self, p: u64) -> CuResult<u64> {
        let mut st = self.st();
        let id = st
            .map_at(p)
            .map(|(_, m)| m.handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        st.phys.get_mut(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?.refs += 1;
        Ok(handle(tag::VMM, id))
    }

    // ----- stream-ordered allocation -----

    fn pool_new(&self, st: &mut State, dev: usize) -> u64 {
        let id = st.id();
        st.pools.insert(
            id,
            Pool {
                dev,
                free: Vec::new(),
                reserved: 0,
                used: 0,
                reserved_high: 0,
                used_high: 0,
                threshold: 0,
                reuse: [1, 1, 1],
                destroyed: false,
            },
        );
        id
    }

    fn default_pool_of(&self, st: &mut State, dev: usize) -> u64 {
        match st.default_pool[dev] {
            Some(id) => id,
            None => {
                let id = self.pool_new(st, dev);
                st.default_pool[dev] = Some(id);
                id
            }
        }
    }

    /// `cuDeviceGetDefaultMemPool`.
    pub fn default_pool(&self, ord: i32) -> CuResult<u64> {
        let p = self.phys(ord)?;
        let mut st = self.st();
        Ok(handle(tag::POOL, self.default_pool_of(&mut st, p)))
    }

    /// `cuDeviceGetMemPool`.
    pub fn current_pool(&self, ord: i32) -> CuResult<u64> {
        let p = self.phys(ord)?;
        let mut st = self.st();
        let id = match st.current_pool[p] {
            Some(id) => id,
            None => self.default_pool_of(&mut st, p),
        };
        Ok(handle(tag::POOL, id))
    }

    /// `cuDeviceSetMemPool`.
    pub fn set_current_pool(&self, ord: i32, pool: u64) -> CuResult<()> {
        let p = self.phys(ord)?;
        let id = unhandle(tag::POOL, pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        if st
            .pools
            .get(&id)
            .is_none_or(|pl| pl.dev != p || pl.destroyed)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        st.current_pool[p] = Some(id);
        Ok(())
    }

    /// `cuMemPoolCreate` for device `ord`.
    pub fn pool_create(&self, ord: i32) -> CuResult<u64> {
        let p = self.phys(ord)?;
        let mut st = self.st();
        Ok(handle(tag::POOL, self.pool_new(&mut st, p)))
    }

    /// `cuMemPoolDestroy`: unused blocks go back now, used ones when freed.
    pub fn pool_destroy(&self, pool: u64) -> CuResult<()> {
        let id = unhandle(tag::POOL, pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        if st.default_pool.contains(&Some(id)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let pl = st
            .pools
            .get_mut(&id)
            .filter(|p| !p.destroyed)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        pl.destroyed = true;
        let dev = pl.dev;
        let freed: u64 = pl.free.drain(..).map(|(s, _)| s).sum();
        pl.reserved -= freed;
        self.devices[dev].release(freed);
        for cur in st.current_pool.iter_mut() {
            if *cur == Some(id) {
                *cur = None;
            }
        }
        Ok(())
    }

    fn pool_trim_locked(&self, st: &mut State, id: u64, keep: u64) {
        let Some(pl) = st.pools.get_mut(&id) else {
            return;
        };
        pl.free.sort_by_key(|(s, _)| *s);
        while pl.reserved > keep {
            let Some((s, _)) = pl.free.pop() else { break };
            pl.reserved -= s;
            self.devices[pl.dev].release(s);
        }
    }

    /// `cuMemPoolTrimTo`.
    pub fn pool_trim(&self, pool: u64, keep: u64) -> CuResult<()> {
        let id = unhandle(tag::POOL, pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        if !st.pools.contains_key(&id) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.pool_trim_locked(&mut st, id, keep);
        Ok(())
    }

    fn trim_pools_at_sync(&self) {
        let mut st = self.st();
        let ids: Vec<(u64, u64)> = st.pools.iter().map(|(k, p)| (*k, p.threshold)).collect();
        for (id, t) in ids {
            self.pool_trim_locked(&mut st, id, t);
        }
    }

    /// `cuMemPoolGetAttribute` (value widened to u64); prohibited during stream capture.
    pub fn pool_get_attr(&self, pool: u64, attr: u32) -> CuResult<u64> {
        self.capture_unsafe_call()?;
        let id = unhandle(tag::POOL, pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let st = self.st();
        let p = st.pools.get(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(match attr {
            1..=3 => p.reuse[attr as usize - 1] as u64,
            4 => p.threshold,
            5 => p.reserved,
            6 => p.reserved_high,
            7 => p.used,
            8 => p.used_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    }

    /// `cuMemPoolSetAttribute`.
    pub fn pool_set_attr(&self, pool: u64, attr: u32, v: u64) -> CuResult<()> {
        let id = unhandle(tag::POOL, pool).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        let p = st.pools.get_mut(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match attr {
            1..=3 => p.reuse[attr as usize - 1] = v as i32,
            4 => p.threshold = v,
            6 if v == 0 => p.reserved_high = p.reserved,
            8 if v == 0 => p.used_high = p.used,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    }

    /// `cuMemAllocAsync` (`pool` 0 = the device's current pool) and `cuMemAllocFromPoolAsync`.
    pub fn alloc_async(
        &self,
        size: u64,
        pool: u64,
        stream: u64,
        per_thread: bool,
    ) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (_q, capturing) = self.stream_queue(stream, per_thread)?;
        let (ctx, dev) = self.cur_dev()?;
        if capturing {
            // Captured, it becomes a memory node of the graph being built, as with the driver.
            let g = self.capture_graph(stream)?;
            let ord = self.ordinal_of(dev).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
            return Ok(self
                .graph_add_mem_alloc(handle(tag::GRAPH, g), ord, size)?
                .1);
        }
        let block = round_up(size, GRANULARITY).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let mut st = self.st();
        let id = if pool == 0 {
            match st.current_pool[dev] {
                Some(id) => id,
                None => self.default_pool_of(&mut st, dev),
            }
        } else {
            unhandle(tag::POOL, pool).ok_or(CUDA_ERROR_INVALID_VALUE)?
        };
        let pl = st
            .pools
            .get_mut(&id)
            .filter(|p| !p.destroyed)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let pdev = pl.dev;
        // Best fit among free blocks, else a new block from the device.
        let best = pl
            .free
            .iter()
            .enumerate()
            .filter(|(_, (s, _))| *s >= block)
            .min_by_key(|(_, (s, _))| *s);
        let (bsize, region) = if let Some((i, _)) = best {
            pl.free.swap_remove(i)
        } else {
            if self.devices[pdev].reserve(block).is_err() {
                // Give back this pool's unused blocks before failing, as the driver does.
                self.pool_trim_locked(&mut st, id, 0);
                self.devices[pdev].reserve(block)?;
            }
            let Some(r) = HostRegion::new(block as usize) else {
                self.devices[pdev].release(block);
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            };
            let pl = st.pools.get_mut(&id).expect("present");
            pl.reserved += block;
            pl.reserved_high = pl.reserved_high.max(pl.reserved);
            (block, Arc::new(r))
        };
        let pl = st.pools.get_mut(&id).expect("present");
        pl.used += bsize;
        pl.used_high = pl.used_high.max(pl.used);
        let base = region.addr();
        st.allocs.insert(
            base,
            Alloc {
                size,
                accounted: bsize,
                dev: pdev,
                ctx: Some(ctx),
                kind: AllocKind::Pool(id),
                region,
            },
        );
        Ok(base)
    }

    /// `cuMemFreeAsync`: the memory returns to its pool (or device) when the stream gets there.
    pub fn free_async(&'static self, p: u64, stream: u64, per_thread: bool) -> CuResult<()> {
        let (q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            // Only graph memory can be freed inside a capture (a memory-free node).
            if !self.st().graph_allocs.contains_key(&p) {
                return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            let g = self.capture_graph(stream)?;
            self.graph_add_mem_free(handle(tag::GRAPH, g), p)?;
            return Ok(());
        }
        let mut st = self.st();
        match st.allocs.get(&p).map(|a| a.kind) {
            None => return Err(CUDA_ERROR_INVALID_VALUE),
            Some(AllocKind::Graph) => {
                // Graph memory freed outside its graph: it stays reserved for graphs until
                // cuDeviceGraphMemTrim.
                st.allocs.remove(&p);
                drop(st);
                q.submit(Box::new(move || self.graph_unlive(p)));
                return Ok(());
            }
            Some(_) => {}
        }
        let a = st.allocs.remove(&p).expect("present");
        drop(st);
        q.submit(Box::new(move || {
            let mut st = self.st();
            self.drop_alloc(&mut st, a);
        }));
        Ok(())
    }

    fn capture_graph(&self, stream: u64) -> CuResult<u64> {
        let id = unhandle(tag::STREAM, stream).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.st()
            .streams
            .get(&id)
            .and_then(|s| s.capture)
            .map(|c| c.graph)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// A graph allocation is no longer in use (freed by a node, `cuMemFree` or `cuMemFreeAsync`).
    fn graph_unlive(&self, dptr: u64) {
        let mut st = self.st();
        st.allocs.remove(&dptr);
        if let Some(ga) = st.graph_allocs.get_mut(&dptr)
            && ga.live
        {
            ga.live = false;
            let (dev, size) = (ga.dev, ga.size);
            st.graph_mem[dev].used -= size;
        }
    }

    // ----- arrays -----

    /// `cuArrayCreate_v2` / `cuArray3DCreate_v2`.
    pub fn array_create(&self, desc: ArrayDesc) -> CuResult<u64> {
        let bytes = desc.bytes()?;
        let (ctx, dev) = self.cur_dev()?;
        self.devices[dev].reserve(bytes)?;
        let mut st = self.st();
        let id = st.id();
        st.arrays.insert(
            id,
            Array {
                dev,
                ctx,
                bytes,
                desc,
                levels: 1,
                parent: None,
            },
        );
        Ok(handle(tag::ARRAY, id))
    }

    /// `cuArrayDestroy`.
    pub fn array_destroy(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::ARRAY, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        if st.arrays.get(&id).is_none_or(|a| a.parent.is_some()) {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let a = st.arrays.remove(&id).expect("present");
        self.devices[a.dev].release(a.bytes);
        Ok(())
    }

    /// `cuArray3DGetDescriptor_v2`.
    pub fn array_desc(&self, h: u64) -> CuResult<ArrayDesc> {
        let id = unhandle(tag::ARRAY, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.st()
            .arrays
            .get(&id)
            .map(|a| a.desc)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// `cuMipmappedArrayCreate`.
    pub fn mipmap_create(&self, desc: ArrayDesc, levels: u32) -> CuResult<u64> {
        let max_dim = desc.width.max(desc.height).max(desc.depth).max(1);
        let max_levels = 64 - max_dim.leading_zeros();
        if levels == 0 || levels > max_levels {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut bytes = 0u64;
        for l in 0..levels {
            bytes = bytes
                .checked_add(desc.level(l).bytes()?)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        }
        let (ctx, dev) = self.cur_dev()?;
        self.devices[dev].reserve(bytes)?;
        let mut st = self.st();
        let id = st.id();
        st.arrays.insert(
            id,
            Array {
                dev,
                ctx,
                bytes,
                desc,
                levels,
                parent: None,
            },
        );
        Ok(handle(tag::MIPMAP, id))
    }

    /// `cuMipmappedArrayGetLevel`.
    pub fn mipmap_level(&self, h: u64, level: u32) -> CuResult<u64> {
        let id = unhandle(tag::MIPMAP, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let a = st.arrays.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if level >= a.levels {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dev, ctx, desc) = (a.dev, a.ctx, a.desc.level(level));
        let lid = st.id();
        st.arrays.insert(
            lid,
            Array {
                dev,
                ctx,
                bytes: 0,
                desc,
                levels: 1,
                parent: Some(id),
            },
        );
        Ok(handle(tag::ARRAY, lid))
    }

    /// `cuMipmappedArrayDestroy`.
    pub fn mipmap_destroy(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::MIPMAP, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let a = st.arrays.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.arrays.retain(|_, l| l.parent != Some(id));
        self.devices[a.dev].release(a.bytes);
        Ok(())
    }

    // ----- streams and events -----

    /// `cuStreamCreate`.
    pub fn stream_create(&self, flags: u32) -> CuResult<u64> {
        let ctx = self.current()?;
        let mut st = self.st();
        let id = st.id();
        st.streams.insert(
            id,
            Stream {
                ctx,
                flags,
                q: StreamQueue::new(),
                capture: None,
            },
        );
        Ok(handle(tag::STREAM, id))
    }

    /// `cuStreamDestroy_v2` (pending work still runs).
    pub fn stream_destroy(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::STREAM, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let s = self
            .st()
            .streams
            .remove(&id)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        s.q.close();
        Ok(())
    }

    /// The queue behind a stream handle, and whether the stream is capturing.
    pub fn stream_queue(&self, h: u64, per_thread: bool) -> CuResult<(Arc<StreamQueue>, bool)> {
        if h == 2 || (h == 0 && per_thread) {
            let ctx = self.current()?;
            let q = PER_THREAD_STREAMS.with(|m| {
                m.borrow_mut()
                    .entry(ctx)
                    .or_insert_with(StreamQueue::new)
                    .clone()
            });
            return Ok((q, false));
        }
        if h == 0 || h == 1 {
            let ctx = self.current()?;
            let st = self.st();
            return Ok((
                st.ctxs
                    .get(&ctx)
                    .ok_or(CUDA_ERROR_INVALID_CONTEXT)?
                    .null_stream
                    .clone(),
                false,
            ));
        }
        let id = unhandle(tag::STREAM, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let st = self.st();
        let s = st.streams.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok((s.q.clone(), s.capture.is_some()))
    }

    /// `cuStreamGetFlags`.
    pub fn stream_flags(&self, h: u64) -> CuResult<u32> {
        match unhandle(tag::STREAM, h) {
            None => Ok(0),
            Some(id) => self
                .st()
                .streams
                .get(&id)
                .map(|s| s.flags)
                .ok_or(CUDA_ERROR_INVALID_HANDLE),
        }
    }

    /// `cuStreamSynchronize`.
    pub fn stream_sync(&self, h: u64, per_thread: bool) -> CuResult<()> {
        let (q, _) = self.stream_queue(h, per_thread)?;
        q.drain();
        self.trim_pools_at_sync();
        Ok(())
    }

    /// `cuStreamQuery`.
    pub fn stream_query(&self, h: u64, per_thread: bool) -> CuResult<()> {
        let (q, _) = self.stream_queue(h, per_thread)?;
        if q.done(q.last_ticket()) {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }

    /// `cuEventCreate`.
    pub fn event_create(&self, flags: u32) -> CuResult<u64> {
        self.current()?;
        let mut st = self.st();
        let id = st.id();
        st.events.insert(
            id,
            Arc::new(Event {
                flags,
                ..Event::default()
            }),
        );
        Ok(handle(tag::EVENT, id))
    }

    fn event(&self, h: u64) -> CuResult<Arc<Event>> {
        let id = unhandle(tag::EVENT, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.st()
            .events
            .get(&id)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// `cuEventDestroy_v2`.
    pub fn event_destroy(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::EVENT, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.st()
            .events
            .remove(&id)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// `cuEventRecord`.
    pub fn event_record(&self, h: u64, stream: u64, per_thread: bool) -> CuResult<()> {
        let e = self.event(h)?;
        let (q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        e.record(&q);
        Ok(())
    }

    /// `cuEventSynchronize`.
    pub fn event_sync(&self, h: u64) -> CuResult<()> {
        self.event(h)?.wait();
        self.trim_pools_at_sync();
        Ok(())
    }

    /// `cuEventQuery`.
    pub fn event_query(&self, h: u64) -> CuResult<()> {
        if self.event(h)?.done() {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }

    /// `cuEventElapsedTime` in milliseconds.
    pub fn event_elapsed(&self, a: u64, b: u64) -> CuResult<f32> {
        let (ea, eb) = (self.event(a)?, self.event(b)?);
        if (ea.flags | eb.flags) & 2 != 0 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let (Some(ta), Some(tb)) = (ea.time(), eb.time()) else {
            return Err(CUDA_ERROR_NOT_READY);
        };
        let ms = if tb >= ta {
            tb.duration_since(ta).as_secs_f64() * 1e3
        } else {
            -(ta.duration_since(tb).as_secs_f64() * 1e3)
        };
        Ok(ms as f32)
    }

    /// `cuStreamWaitEvent`: later work on the stream waits for the event.
    pub fn stream_wait_event(&self, stream: u64, ev: u64, per_thread: bool) -> CuResult<()> {
        let e = self.event(ev)?;
        let (q, _) = self.stream_queue(stream, per_thread)?;
        q.submit(Box::new(move || e.wait()));
        Ok(())
    }

    // ----- modules and kernels -----

    /// Entry names of a simulated module image: `vgpusim-module: a b c` or PTX text.
    pub fn parse_image(image: &[u8]) -> CuResult<Vec<String>> {
        let text = std::str::from_utf8(image).map_err(|_| CUDA_ERROR_INVALID_IMAGE)?;
        if let Some(rest) = text.strip_prefix("vgpusim-module:") {
            return Ok(rest.split_whitespace().map(str::to_string).collect());
        }
        if !text.contains(".entry") {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        let mut names = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find(".entry") {
            rest = &rest[i + 6..];
            let name: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$')
                .collect();
            if name.is_empty() {
                return Err(CUDA_ERROR_INVALID_IMAGE);
            }
            names.push(name);
        }
        Ok(names)
    }

    /// `cuModuleLoadData`.
    pub fn module_load(&self, image: &[u8]) -> CuResult<u64> {
        let entries = Self::parse_image(image)?;
        let (ctx, dev) = self.cur_dev()?;
        // Lazy loading: the code reaches the device at the first launch (`function_to_launch`).
        let acc = if self.cfg.lazy_loading {
            0
        } else {
            self.cfg.module_overhead
        };
        self.devices[dev].reserve(acc)?;
        let mut st = self.st();
        let id = st.id();
        st.modules.insert(
            id,
            Module {
                ctx,
                dev,
                entries,
                accounted: acc,
                loaded: !self.cfg.lazy_loading,
            },
        );
        Ok(handle(tag::MODULE, id))
    }

    /// The kernel behind a function handle about to be launched (or put in a graph): under
    /// lazy loading its module's code is loaded onto the device now, taking the module's
    /// memory (`CUDA_ERROR_OUT_OF_MEMORY` if the device is full), as the real driver does.
    pub fn function_to_launch(&self, f: u64) -> CuResult<(Kernel, usize)> {
        let id = unhandle(tag::FUNC, f).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let func = st
            .funcs
            .get(&id)
            .cloned()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let m = st
            .modules
            .get_mut(&func.module)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if !m.loaded {
            let acc = self.cfg.module_overhead;
            self.devices[m.dev].reserve(acc)?;
            m.accounted = acc;
            m.loaded = true;
        }
        Ok((func.kernel, m.dev))
    }

    /// Whether `h` is a live module.
    pub fn module_check(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::MODULE, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if self.st().modules.contains_key(&id) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }

    /// `cuModuleUnload`.
    pub fn module_unload(&self, h: u64) -> CuResult<()> {
        let id = unhandle(tag::MODULE, h).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let m = st.modules.remove(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.funcs.retain(|_, f| f.module != id);
        self.devices[m.dev].release(m.accounted);
        Ok(())
    }

    /// `cuModuleGetFunction`.
    pub fn get_function(&self, module: u64, name: &str) -> CuResult<u64> {
        let id = unhandle(tag::MODULE, module).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let mut st = self.st();
        let m = st.modules.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if !m.entries.iter().any(|e| e == name) {
            return Err(CUDA_ERROR_NOT_FOUND);
        }
        let fid = st.id();
        st.funcs.insert(
            fid,
            Func {
                module: id,
                kernel: Kernel::by_name(name),
            },
        );
        Ok(handle(tag::FUNC, fid))
    }

    /// The kernel behind a function handle and the device it lives on.
    pub fn function(&self, f: u64) -> CuResult<(Kernel, usize)> {
        let id = unhandle(tag::FUNC, f).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let st = self.st();
        let func = st.funcs.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let dev = st
            .modules
            .get(&func.module)
            .map(|m| m.dev)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok((func.kernel, dev))
    }

    /// Checks launch dimensions (`cooperative` limits the grid to what fits at once).
    pub fn check_dims(&self, grid: [u32; 3], block: [u32; 3], cooperative: bool) -> CuResult<()> {
        if grid.contains(&0) || block.contains(&0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let threads = block.iter().map(|&b| b as u64).product::<u64>();
        if threads > 1024 || block[2] > 64 || grid[1] > 65535 || grid[2] > 65535 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let blocks = grid.iter().map(|&g| g as u64).product::<u64>();
        if cooperative && blocks > self.cfg.sm_count as u64 * (2048 / threads.max(1)).min(32) {
            return Err(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
        }
        Ok(())
    }

    /// Queues a launch on `stream` (or records it into the graph the stream is capturing).
    pub fn launch(&'static self, l: Launch, stream: u64, per_thread: bool) -> CuResult<()> {
        let (q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            let id = unhandle(tag::STREAM, stream).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let mut st = self.st();
            let g = st
                .streams
                .get(&id)
                .and_then(|s| s.capture)
                .map(|c| c.graph)
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            let nid = st.id();
            st.graphs
                .get_mut(&g)
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?
                .nodes
                .push((nid, Node::Kernel(l)));
            return Ok(());
        }
        q.submit(Box::new(move || self.run_kernel(&l)));
        Ok(())
    }

    fn run_kernel(&self, l: &Launch) {
        let dev = &self.devices[l.dev];
        dev.busy.begin();
        match l.kernel {
            Kernel::Spin => {
                let ns = l.arg_u64(0);
                if ns > 0 {
                    let end = Instant::now() + Duration::from_nanos(ns);
                    std::thread::sleep(Duration::from_nanos(ns));
                    while Instant::now() < end {
                        std::hint::spin_loop();
                    }
                }
            }
            Kernel::Fill => {
                let (p, v, n) = (l.arg_u64(0), l.arg_u32(8), l.arg_u64(12));
                // An illegal address is reported nowhere (no sticky errors in the simulator);
                // the write is simply skipped.
                let _ = self.set_now(p, v, 4, n);
            }
            Kernel::Noop => {}
        }
        dev.busy.end();
    }

    // ----- graphs -----

    /// `cuGraphCreate`.
    pub fn graph_create(&self) -> CuResult<u64> {
        let mut st = self.st();
        let id = st.id();
        st.graphs.insert(id, Graph::default());
        Ok(handle(tag::GRAPH, id))
    }

    fn add_node(&self, g: u64, n: Node) -> CuResult<u64> {
        let id = unhandle(tag::GRAPH, g).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        let nid = st.id();
        st.graphs
            .get_mut(&id)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .nodes
            .push((nid, n));
        Ok(handle(tag::NODE, nid))
    }

    /// `cuGraphAddKernelNode`.
    pub fn graph_add_kernel(&self, g: u64, l: Launch) -> CuResult<u64> {
        self.add_node(g, Node::Kernel(l))
    }

    /// `cuGraphAddEmptyNode`.
    pub fn graph_add_empty(&self, g: u64) -> CuResult<u64> {
        self.add_node(g, Node::Empty)
    }

    /// `cuGraphAddMemAllocNode`: (node, device pointer). The address is fixed now; the memory
    /// is taken from the device when the graph is launched.
    pub fn graph_add_mem_alloc(&self, g: u64, ord: i32, size: u64) -> CuResult<(u64, u64)> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = self.phys(ord)?;
        let region = Arc::new(HostRegion::new(size as usize).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?);
        let dptr = region.addr();
        let node = self.add_node(g, Node::MemAlloc { dev, dptr })?;
        let size = round_up(size, GRANULARITY).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.st().graph_allocs.insert(
            dptr,
            GraphAlloc {
                dev,
                size,
                region,
                backed: false,
                live: false,
            },
        );
        Ok((node, dptr))
    }

    /// `cuGraphAddMemFreeNode`.
    pub fn graph_add_mem_free(&self, g: u64, dptr: u64) -> CuResult<u64> {
        if !self.st().graph_allocs.contains_key(&dptr) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.add_node(g, Node::MemFree { dptr })
    }

    /// `cuGraphGetNodes` (node handles in insertion order).
    pub fn graph_nodes(&self, g: u64) -> CuResult<Vec<u64>> {
        let id = unhandle(tag::GRAPH, g).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let st = self.st();
        let gr = st.graphs.get(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        Ok(gr
            .nodes
            .iter()
            .map(|(n, _)| handle(tag::NODE, *n))
            .collect())
    }

    /// `cuGraphDestroy`.
    pub fn graph_destroy(&self, g: u64) -> CuResult<()> {
        let id = unhandle(tag::GRAPH, g).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.st()
            .graphs
            .remove(&id)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `cuStreamBeginCapture_v2` with `CUstreamCaptureMode` `mode` (0 global, 1 thread-local,
    /// 2 relaxed).
    pub fn begin_capture(&self, stream: u64, mode: u32) -> CuResult<()> {
        if mode > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = unhandle(tag::STREAM, stream).ok_or(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)?;
        let mut st = self.st();
        let gid = st.id();
        let s = st.streams.get_mut(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if s.capture.is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let thread = std::thread::current().id();
        s.capture = Some(Capture {
            graph: gid,
            mode,
            thread,
            invalidated: false,
        });
        st.graphs.insert(gid, Graph::default());
        Ok(())
    }

    /// `cuStreamEndCapture`: the captured graph, or `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`
    /// when a prohibited call was made during the capture.
    pub fn end_capture(&self, stream: u64) -> CuResult<u64> {
        let id = unhandle(tag::STREAM, stream).ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        let mut st = self.st();
        let s = st.streams.get_mut(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let c = s.capture.take().ok_or(CUDA_ERROR_ILLEGAL_STATE)?;
        if c.invalidated {
            st.graphs.remove(&c.graph);
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        Ok(handle(tag::GRAPH, c.graph))
    }

    /// `cuStreamIsCapturing`: 0 none, 1 active, 2 invalidated.
    pub fn is_capturing(&self, stream: u64) -> CuResult<u32> {
        match unhandle(tag::STREAM, stream) {
            None => Ok(0),
            Some(id) => {
                let st = self.st();
                let s = st.streams.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
                Ok(match s.capture {
                    None => 0,
                    Some(c) if c.invalidated => 2,
                    Some(_) => 1,
                })
            }
        }
    }

    /// A call that is prohibited during stream capture: refused with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and the captures that prohibit it are
    /// invalidated, as the driver does. Prohibited: a non-relaxed capture begun by this thread,
    /// or a global-mode capture begun by any thread. (Seen on an H200 with driver 580 for
    /// `cuMemPoolGetAttribute`; `docs/gpu-acceptance.md`.)
    fn capture_unsafe_call(&self) -> CuResult<()> {
        let me = std::thread::current().id();
        let mut st = self.st();
        let mut hit = false;
        for s in st.streams.values_mut() {
            if let Some(c) = s.capture.as_mut()
                && (c.mode == 0 || (c.mode == 1 && c.thread == me))
            {
                c.invalidated = true;
                hit = true;
            }
        }
        if hit {
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// `cuGraphInstantiate*`.
    pub fn graph_instantiate(&self, g: u64) -> CuResult<u64> {
        let id = unhandle(tag::GRAPH, g).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut st = self.st();
        let nodes: Vec<Node> = st
            .graphs
            .get(&id)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?
            .nodes
            .iter()
            .map(|(_, n)| n.clone())
            .collect();
        let eid = st.id();
        st.execs.insert(eid, nodes);
        Ok(handle(tag::EXEC, eid))
    }

    /// `cuGraphExecDestroy`.
    pub fn graph_exec_destroy(&self, e: u64) -> CuResult<()> {
        let id = unhandle(tag::EXEC, e).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.st()
            .execs
            .remove(&id)
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// `cuGraphLaunch`: memory nodes take their memory now (so an out-of-memory launch fails
    /// here); kernels run in node order on the stream.
    pub fn graph_launch(&'static self, e: u64, stream: u64, per_thread: bool) -> CuResult<()> {
        let id = unhandle(tag::EXEC, e).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut st = self.st();
        let nodes = st.execs.get(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?.clone();
        for n in &nodes {
            if let Node::MemAlloc { dev, dptr } = n {
                if st
                    .graph_allocs
                    .get(dptr)
                    .ok_or(CUDA_ERROR_INVALID_VALUE)?
                    .live
                {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                self.back_graph_alloc(&mut st, *dev, *dptr)?;
                let ga = st.graph_allocs.get_mut(dptr).expect("present");
                ga.live = true;
                let (size, region) = (ga.size, ga.region.clone());
                let gm = &mut st.graph_mem[*dev];
                gm.used += size;
                gm.used_high = gm.used_high.max(gm.used);
                st.allocs.insert(
                    *dptr,
                    Alloc {
                        size,
                        accounted: 0,
                        dev: *dev,
                        ctx: None,
                        kind: AllocKind::Graph,
                        region,
                    },
                );
            }
        }
        drop(st);
        for n in nodes {
            match n {
                Node::Kernel(l) => {
                    q.submit(Box::new(move || self.run_kernel(&l)));
                }
                Node::MemFree { dptr } => {
                    q.submit(Box::new(move || self.graph_unlive(dptr)));
                }
                Node::Empty | Node::MemAlloc { .. } => {}
            }
        }
        Ok(())
    }

    /// `cuGraphUpload`: the graph's memory nodes take their memory from the device now (so the
    /// first launch does not have to).
    pub fn graph_upload(&self, e: u64, stream: u64, per_thread: bool) -> CuResult<()> {
        let id = unhandle(tag::EXEC, e).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let (_q, capturing) = self.stream_queue(stream, per_thread)?;
        if capturing {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut st = self.st();
        let nodes = st.execs.get(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?.clone();
        for n in &nodes {
            if let Node::MemAlloc { dev, dptr } = n {
                self.back_graph_alloc(&mut st, *dev, *dptr)?;
            }
        }
        Ok(())
    }

    /// A graph memory node takes its memory from the device the first time its graph is
    /// uploaded or launched (the driver's graph heap then keeps it).
    fn back_graph_alloc(&self, st: &mut State, dev: usize, dptr: u64) -> CuResult<()> {
        let ga = st
            .graph_allocs
            .get_mut(&dptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !ga.backed {
            self.devices[dev].reserve(ga.size)?;
            ga.backed = true;
            let gm = &mut st.graph_mem[dev];
            gm.reserved += ga.size;
            gm.reserved_high = gm.reserved_high.max(gm.reserved);
        }
        Ok(())
    }

    /// `cuDeviceGetGraphMemAttribute`.
    pub fn graph_mem_attr(&self, ord: i32, attr: u32) -> CuResult<u64> {
        let p = self.phys(ord)?;
        let g = self.st().graph_mem[p];
        Ok(match attr {
            0 => g.used,
            1 => g.used_high,
            2 => g.reserved,
            3 => g.reserved_high,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        })
    }

    /// `cuDeviceGraphMemTrim`: memory of graph allocations not in use goes back to the device.
    pub fn graph_mem_trim(&self, ord: i32) -> CuResult<()> {
        let p = self.phys(ord)?;
        let mut st = self.st();
        let mut freed = 0;
        for ga in st
            .graph_allocs
            .values_mut()
            .filter(|g| g.dev == p && g.backed && !g.live)
        {
            ga.backed = false;
            freed += ga.size;
        }
        st.graph_mem[p].reserved -= freed;
        self.devices[p].release(freed);
        Ok(())
    }

    // ----- IPC -----

    /// `cuIpcGetMemHandle`: 64 bytes naming the allocation containing `p`.
    pub fn ipc_handle(&self, p: u64) -> CuResult<[u8; 64]> {
        let st = self.st();
        let (b, a) = st.alloc_at(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !matches!(a.kind, AllocKind::Device | AllocKind::Pitch) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(b"vgpusim\0");
        h[8..12].copy_from_slice(&self.pid.to_le_bytes());
        h[16..24].copy_from_slice(&b.to_le_bytes());
        h[24..32].copy_from_slice(&a.size.to_le_bytes());
        Ok(h)
    }

    // ----- what NVML reports -----

    /// (total, free, used) of physical device `p` as NVML sees it (all processes).
    pub fn nvml_memory(&self, p: usize) -> (u64, u64, u64) {
        let d = &self.devices[p];
        let used = d.used.load(Ordering::Relaxed) + d.other_used;
        (d.total, d.total.saturating_sub(used), used)
    }

    /// Bytes this process uses on physical device `p`, and whether it has a context there.
    pub fn process_usage(&self, p: usize) -> (u64, bool) {
        let used = self.devices[p].used.load(Ordering::Relaxed);
        let has_ctx = match self.st.try_lock() {
            Ok(st) => st.ctxs.values().any(|c| c.dev == p),
            Err(_) => used > 0,
        };
        (used, has_ctx || used > 0)
    }

    /// Process id the simulator was started in.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The pid NVML lists this process under (`VGPU_SIM_NVML_PID`, else its own).
    pub fn nvml_pid(&self) -> u32 {
        self.cfg.nvml_pid.unwrap_or(self.pid)
    }
}

/// `CUDA_ERROR_ILLEGAL_STATE`.
pub const CUDA_ERROR_ILLEGAL_STATE: u32 = 401;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: u32 = 901;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use std::collections::HashMap;

    fn sim(pairs: &[(&str, &str)]) -> &'static Sim {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let s: &'static Sim = Box::leak(Box::new(Sim::new(
            SimConfig::from_lookup(|k| m.get(k).cloned()).unwrap(),
        )));
        s.init(0).unwrap();
        s
    }

    fn used(s: &Sim, p: usize) -> u64 {
        s.devices[p].used.load(Ordering::SeqCst)
    }

    #[test]
    fn allocations_are_counted_limited_and_freed() {
        let s = sim(&[
            ("VGPU_SIM_TOTAL_MEM", "1g"),
            ("VGPU_SIM_CTX_OVERHEAD", "1m"),
        ]);
        assert_eq!(s.mem_alloc(10), Err(CUDA_ERROR_INVALID_CONTEXT));
        let ctx = s.primary_retain(0).unwrap();
        s.set_current(ctx).unwrap();
        assert_eq!(used(s, 0), 1 << 20);
        let a = s.mem_alloc(1000).unwrap();
        assert_eq!(used(s, 0), (1 << 20) + 1024);
        assert_eq!(s.mem_alloc(1 << 30), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(s.address_range(a + 999).unwrap(), (a, 1000));
        s.memset(a, 7, 1, 1000).unwrap();
        let mut host = vec![0u8; 1000];
        s.memcpy(host.as_mut_ptr() as u64, a, 1000, false, true)
            .unwrap();
        assert!(host.iter().all(|&b| b == 7));
        assert_eq!(
            s.memcpy(host.as_mut_ptr() as u64, a, 5000, false, true),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(s.mem_free(a + 1), Err(CUDA_ERROR_INVALID_VALUE));
        s.mem_free(a).unwrap();
        assert_eq!(s.mem_free(a), Err(CUDA_ERROR_INVALID_VALUE));
        s.primary_release(0).unwrap();
        assert_eq!(used(s, 0), 0);
    }

    #[test]
    fn destroying_a_context_frees_what_it_owns() {
        let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
        let c = s.ctx_create(0, 0).unwrap();
        s.mem_alloc(1 << 20).unwrap();
        s.array_create(ArrayDesc {
            width: 64,
            height: 64,
            format: 0x20,
            channels: 4,
            ..Default::default()
        })
        .unwrap();
        assert!(used(s, 0) > 0);
        s.ctx_destroy(c).unwrap();
        assert_eq!(used(s, 0), 0);
        assert_eq!(s.current(), Err(CUDA_ERROR_INVALID_CONTEXT));
    }

    #[test]
    fn vmm_counts_on_create_and_frees_after_release_and_unmap() {
        let s = sim(&[
            ("VGPU_SIM_DEVICE_COUNT", "2"),
            ("VGPU_SIM_CTX_OVERHEAD", "0"),
        ]);
        let c = s.ctx_create(0, 0).unwrap();
        assert_eq!(
            s.mem_create(1 << 20, Some(1), [0; 32]),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        let h = s.mem_create(4 << 20, Some(1), [0; 32]).unwrap();
        assert_eq!(used(s, 1), 4 << 20);
        let va = s.address_reserve(8 << 20, 0).unwrap();
        s.mem_map(va, 4 << 20, 0, h).unwrap();
        s.mem_map(va + (4 << 20), 4 << 20, 0, h).unwrap();
        s.set_access(va, 8 << 20).unwrap();
        s.memset(va, 0xabcd, 4, 1).unwrap();
        let mut w = 0u32;
        s.memcpy(&mut w as *mut u32 as u64, va + (4 << 20), 4, false, true)
            .unwrap();
        assert_eq!(w, 0xabcd, "both mappings alias one physical allocation");
        assert_eq!(s.address_range(va + 5).unwrap(), (va, 4 << 20));
        s.mem_release(h).unwrap();
        assert_eq!(used(s, 1), 4 << 20, "still mapped");
        s.mem_unmap(va, 8 << 20).unwrap();
        assert_eq!(used(s, 1), 0);
        s.address_free(va, 8 << 20).unwrap();
        s.ctx_destroy(c).unwrap();
    }

    #[test]
    fn pools_reserve_blocks_and_release_at_sync() {
        let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
        s.ctx_create(0, 0).unwrap();
        let pool = s.default_pool(0).unwrap();
        let a = s.alloc_async(1000, 0, 0, false).unwrap();
        assert_eq!(s.pool_get_attr(pool, 5).unwrap(), GRANULARITY);
        assert_eq!(s.pool_get_attr(pool, 7).unwrap(), GRANULARITY);
        s.pool_set_attr(pool, 4, u64::MAX).unwrap();
        s.free_async(a, 0, false).unwrap();
        s.stream_sync(0, false).unwrap();
        assert_eq!(s.pool_get_attr(pool, 7).unwrap(), 0);
        assert_eq!(
            s.pool_get_attr(pool, 5).unwrap(),
            GRANULARITY,
            "kept below the threshold"
        );
        assert_eq!(used(s, 0), GRANULARITY);
        let b = s.alloc_async(10, 0, 0, false).unwrap();
        assert_eq!(b, a, "block reused");
        s.mem_free(b).unwrap();
        s.pool_trim(pool, 0).unwrap();
        assert_eq!(used(s, 0), 0);
    }

    #[test]
    fn module_code_takes_memory_at_load_when_eager_and_at_first_launch_when_lazy() {
        const MOD: u64 = 8 << 20;
        let launch_fill = |s: &'static Sim, f: u64| {
            let (kernel, dev) = s.function_to_launch(f)?;
            let l = Launch {
                kernel,
                dev,
                grid: [1; 3],
                block: [1; 3],
                args: vec![0; 20],
            };
            s.launch(l, 0, false)
        };
        let eager = sim(&[
            ("CUDA_MODULE_LOADING", "EAGER"),
            ("VGPU_SIM_MODULE_OVERHEAD", "8m"),
            ("VGPU_SIM_CTX_OVERHEAD", "0"),
        ]);
        eager.ctx_create(0, 0).unwrap();
        let m = eager.module_load(b"vgpusim-module: fill").unwrap();
        assert_eq!(used(eager, 0), MOD);
        eager.module_unload(m).unwrap();
        assert_eq!(used(eager, 0), 0);

        let lazy = sim(&[
            ("VGPU_SIM_MODULE_OVERHEAD", "8m"),
            ("VGPU_SIM_CTX_OVERHEAD", "0"),
            ("VGPU_SIM_TOTAL_MEM", "12m"),
        ]);
        assert!(
            lazy.cfg.lazy_loading,
            "lazy is the default, as with the real driver"
        );
        lazy.ctx_create(0, 0).unwrap();
        let m = lazy.module_load(b"vgpusim-module: fill").unwrap();
        let f = lazy.get_function(m, "fill").unwrap();
        assert_eq!(
            used(lazy, 0),
            0,
            "nothing on the device before the first launch"
        );
        launch_fill(lazy, f).unwrap();
        assert_eq!(used(lazy, 0), MOD, "loaded by the first launch");
        launch_fill(lazy, f).unwrap();
        assert_eq!(used(lazy, 0), MOD, "once");
        lazy.module_unload(m).unwrap();
        assert_eq!(used(lazy, 0), 0);
        // A device too full for the code: the launch fails with out of memory.
        let big = lazy.mem_alloc(8 << 20).unwrap();
        let m = lazy.module_load(b"vgpusim-module: fill").unwrap();
        let f = lazy.get_function(m, "fill").unwrap();
        assert_eq!(launch_fill(lazy, f), Err(CUDA_ERROR_OUT_OF_MEMORY));
        lazy.mem_free(big).unwrap();
        launch_fill(lazy, f).unwrap();
        assert_eq!(used(lazy, 0), MOD);
    }

    #[test]
    fn kernels_run_on_streams_and_events_time_them() {
        let s = sim(&[]);
        s.ctx_create(0, 0).unwrap();
        let m = s.module_load(b"vgpusim-module: spin fill").unwrap();
        let f = s.get_function(m, "spin").unwrap();
        assert_eq!(s.get_function(m, "nope"), Err(CUDA_ERROR_NOT_FOUND));
        let (k, dev) = s.function(f).unwrap();
        let st = s.stream_create(0).unwrap();
        let (e1, e2) = (s.event_create(0).unwrap(), s.event_create(0).unwrap());
        s.event_record(e1, st, false).unwrap();
        let l = Launch {
            kernel: k,
            dev,
            grid: [1; 3],
            block: [1; 3],
            args: 20_000_000u64.to_le_bytes().to_vec(),
        };
        s.launch(l, st, false).unwrap();
        s.event_record(e2, st, false).unwrap();
        assert_eq!(s.event_query(e2), Err(CUDA_ERROR_NOT_READY));
        s.event_sync(e2).unwrap();
        let ms = s.event_elapsed(e1, e2).unwrap();
        assert!((19.0..200.0).contains(&ms), "{ms}");
        assert!(s.devices[0].busy.percent(Duration::from_secs(1)) >= 1);
    }

    #[test]
    fn ptx_images_name_their_entries() {
        let ptx = b".version 7.0\n.visible .entry spin(\n.param .u64 a)\n{}\n.visible .entry fill(.param .u64 p)";
        assert_eq!(Sim::parse_image(ptx).unwrap(), vec!["spin", "fill"]);
        assert_eq!(Sim::parse_image(b"\x7fELF"), Err(CUDA_ERROR_INVALID_IMAGE));
    }

    #[test]
    fn capture_and_graph_memory() {
        let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
        s.ctx_create(0, 0).unwrap();
        let st = s.stream_create(0).unwrap();
        s.begin_capture(st, 0).unwrap();
        let l = Launch {
            kernel: Kernel::Noop,
            dev: 0,
            grid: [1; 3],
            block: [1; 3],
            args: vec![],
        };
        s.launch(l, st, false).unwrap();
        let g = s.end_capture(st).unwrap();
        assert_eq!(s.graph_nodes(g).unwrap().len(), 1);
        let (_, p) = s.graph_add_mem_alloc(g, 0, 3 << 20).unwrap();
        s.graph_add_mem_free(g, p).unwrap();
        let e = s.graph_instantiate(g).unwrap();
        s.graph_upload(e, st, false).unwrap();
        assert_eq!(used(s, 0), 4 << 20, "uploading takes the graph's memory");
        assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0, "reserved, not in use");
        s.graph_launch(e, st, false).unwrap();
        assert_eq!(used(s, 0), 4 << 20);
        s.stream_sync(st, false).unwrap();
        assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0);
        assert_eq!(s.graph_mem_attr(0, 2).unwrap(), 4 << 20);
        s.graph_mem_trim(0).unwrap();
        assert_eq!(used(s, 0), 0);
    }

    #[test]
    fn stream_ordered_allocation_in_a_capture_becomes_graph_memory() {
        let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
        s.ctx_create(0, 0).unwrap();
        let st = s.stream_create(0).unwrap();
        s.begin_capture(st, 0).unwrap();
        let p = s.alloc_async(3 << 20, 0, st, false).unwrap();
        assert_eq!(used(s, 0), 0, "nothing is taken while capturing");
        let g = s.end_capture(st).unwrap();
        let e = s.graph_instantiate(g).unwrap();
        s.graph_launch(e, st, false).unwrap();
        s.stream_sync(st, false).unwrap();
        assert_eq!(used(s, 0), 4 << 20);
        s.memset(p, 1, 1, 3 << 20).unwrap();
        // Freed outside its graph, it stays reserved for graphs until trimmed.
        s.free_async(p, st, false).unwrap();
        s.stream_sync(st, false).unwrap();
        assert_eq!(s.graph_mem_attr(0, 0).unwrap(), 0);
        assert_eq!(used(s, 0), 4 << 20);
        s.graph_mem_trim(0).unwrap();
        assert_eq!(used(s, 0), 0);
    }

    #[test]
    fn pool_queries_invalidate_a_global_capture_but_not_a_relaxed_one() {
        let s = sim(&[("VGPU_SIM_CTX_OVERHEAD", "0")]);
        s.ctx_create(0, 0).unwrap();
        let pool = s.default_pool(0).unwrap();
        let st = s.stream_create(0).unwrap();
        s.begin_capture(st, 0).unwrap();
        assert_eq!(
            s.pool_get_attr(pool, 5),
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        );
        assert_eq!(s.is_capturing(st), Ok(2));
        assert_eq!(
            s.end_capture(st),
            Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        );
        s.begin_capture(st, 2).unwrap();
        assert_eq!(s.pool_get_attr(pool, 5), Ok(0));
        assert!(s.end_capture(st).is_ok());
        assert_eq!(
            s.pool_get_attr(pool, 5),
            Ok(0),
            "no capture, no restriction"
        );
    }

    #[test]
    fn faults_fire_on_the_nth_call() {
        let s = sim(&[("VGPU_SIM_FAULTS", "cuMemAlloc_v2:2:1234")]);
        assert_eq!(s.fault("cuMemAlloc_v2", true), Ok(()));
        assert_eq!(s.fault("cuMemAlloc_v2", true), Err(1234));
        assert_eq!(s.fault("cuMemAlloc_v2", true), Ok(()));
    }
}
