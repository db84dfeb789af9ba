//! The simulated driver's state and semantics, in safe Rust: devices, contexts, allocations,
//! virtual memory, pools, arrays, streams, events, modules, kernels and graphs.
//!
//! The exported C functions (`driver/`, `nvml.rs`) only translate pointers to and from the
//! methods here. Errors are driver result codes (`u32`).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::codes::*;
use crate::engine::{BusyLog, Event, StreamQueue};
use crate::hostmem::{self, HostPtr, HostRegion, PhysMem, Span, VaRange};
use crate::machine::{ConfigError, SimConfig};

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

/// Adds `bytes` to the counter `used` unless that takes it past `cap`
/// (`CUDA_ERROR_OUT_OF_MEMORY`): the device's and the host's memory are charged alike.
fn reserve_under(used: &AtomicU64, cap: u64, bytes: u64) -> CuResult<()> {
    used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
        u.checked_add(bytes).filter(|n| *n <= cap)
    })
    .map(|_| ())
    .map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)
}

/// Takes `bytes` off the counter `used`, stopping at zero.
fn release_from(used: &AtomicU64, bytes: u64) {
    let _ = used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
        Some(u.saturating_sub(bytes))
    });
}

fn round_up(n: u64, to: u64) -> Option<u64> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

mod arrays;
mod contexts;
mod devices;
mod graphs;
mod init;
mod memory;
mod modules;
mod nvml_view;
mod pinned;
mod pools;
mod shared_mem;
mod streams;
#[cfg(test)]
mod tests;
mod vmm;
pub use vmm::HOST_CREATIONS;

pub use arrays::ArrayDesc;
pub use devices::Device;
pub use init::{global, inited};
pub use modules::{Kernel, Launch};
pub use pinned::HostMemory;
pub use streams::StreamArg;
pub use vmm::PROP_GPU_DIRECT_RDMA;

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
    /// Imported from an exported descriptor: its bytes are the exporter's, counted there
    /// (freeing it gives no device memory back).
    imported: bool,
}

/// What `cuMemExportToShareableHandle` exported, by the descriptor's inode: the exporter's
/// memory, which an import maps.
#[derive(Debug)]
struct Export {
    size: u64,
    dev: Option<usize>,
    mem: Arc<PhysMem>,
    prop: [u8; 32],
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

#[derive(Debug)]
struct Module {
    ctx: u64,
    dev: usize,
    entries: Vec<String>,
    /// Device memory its code takes now (0 until loaded under lazy loading).
    accounted: u64,
    /// Its code is on the device (at load when eager, at the first launch when lazy).
    loaded: bool,
    /// Per entry (as `entries`): its function was loaded into the context (under lazy
    /// loading, by its first launch, which waited for the context's work; see
    /// `Sim::function_for_launch_call`).
    entry_loaded: Vec<bool>,
}

#[derive(Debug, Clone)]
struct Func {
    module: u64,
    /// Its index in the module's `entries`.
    entry: usize,
    kernel: Kernel,
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
    /// Ids of freed physical allocations, handed out again under `reuse_vmm_handles`.
    freed_phys: Vec<u64>,
    /// Exported descriptors (by inode), for `cuMemImportFromShareableHandle`.
    exports: HashMap<u64, Export>,
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
    pinned: BTreeMap<u64, pinned::PinnedAlloc>,
    registered: BTreeMap<u64, pinned::Registration>,
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

    /// `[p, p + len)` if it is device memory this process may touch.
    fn device_span(&self, p: u64, len: u64) -> CuResult<Span<'_>> {
        if len == 0 {
            return Ok(Span::empty());
        }
        let end = p.checked_add(len - 1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((_, a)) = self.alloc_at(p) {
            return a.region.span(p, len).ok_or(CUDA_ERROR_INVALID_VALUE);
        }
        if self.pinned_at(p).is_some() {
            // Pinned host memory, at its device pointer (its own address).
            return self.pinned_span(p, len).ok_or(CUDA_ERROR_INVALID_VALUE);
        }
        // Virtual-memory ranges may span several adjacent mappings (of one reservation).
        let (_, first) = self.map_at(p).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut at = p;
        while at <= end {
            let (b, m) = self.map_at(at).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            at = b + m.size;
        }
        self.vas
            .get(&first.va)
            .and_then(|va| va.span(p, len))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Whether `[p, p + len)` is device memory this process may touch.
    fn check_range(&self, p: u64, len: u64) -> CuResult<()> {
        self.device_span(p, len).map(|_| ())
    }

    /// `len` bytes at one side of a copy.
    fn span(&self, at: Addr, len: u64) -> CuResult<Span<'_>> {
        match at {
            Addr::Device(p) => self.device_span(p, len),
            Addr::Host(h) => h.span(len).ok_or(CUDA_ERROR_INVALID_VALUE),
        }
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
    /// Host memory held pinned or host-located, against `VGPU_SIM_HOST_PINNED_LIMIT`.
    pub host: HostMemory,
    pid: u32,
    inited: AtomicBool,
    st: Mutex<State>,
    fault_calls: Vec<AtomicU64>,
}

/// One side of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addr {
    /// Device memory: checked against the live allocations and mappings.
    Device(u64),
    /// Host memory a program passed in.
    Host(HostPtr),
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
        let shared = cfg
            .shared_mem
            .as_deref()
            .and_then(shared_mem::SharedMem::open)
            .map(Arc::new);
        let devices = cfg
            .devices
            .iter()
            .enumerate()
            .map(|(index, d)| Device {
                total: d.total_mem,
                other_used: d.other_used,
                uuid: d.uuid,
                used: AtomicU64::new(0),
                busy: BusyLog::new(cfg.power),
                index,
                shared: shared.clone(),
            })
            .collect::<Vec<_>>();
        let n = devices.len();
        init::watch_forks();
        let st = State {
            primary: vec![Primary::default(); n],
            default_pool: vec![None; n],
            current_pool: vec![None; n],
            graph_mem: vec![GraphMemStats::default(); n],
            ..State::default()
        };
        Sim {
            fault_calls: cfg.faults.iter().map(|_| AtomicU64::new(0)).collect(),
            host: HostMemory::new(cfg.host_pinned_limit),
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

    /// Stores `object` in the table `pick` chooses under a fresh id and returns its handle
    /// of kind `t`: every `cu*Create` ends this way.
    fn new_handle<T>(
        &self,
        t: u64,
        pick: impl FnOnce(&mut State) -> &mut HashMap<u64, T>,
        object: T,
    ) -> u64 {
        let mut st = self.st();
        let id = st.id();
        pick(&mut st).insert(id, object);
        handle(t, id)
    }

    /// Reads the object behind handle `h` of kind `t` with `read`; `err` when the handle
    /// is of another kind or names nothing.
    fn read_handle<T, R>(
        &self,
        (t, h, err): (u64, u64, u32),
        pick: impl FnOnce(&State) -> &HashMap<u64, T>,
        read: impl FnOnce(&T) -> R,
    ) -> CuResult<R> {
        let id = unhandle(t, h).ok_or(err)?;
        pick(&self.st()).get(&id).map(read).ok_or(err)
    }

    /// Removes the object behind handle `h` of kind `t`; `err` as in [`Self::read_handle`].
    fn drop_handle<T>(
        &self,
        (t, h, err): (u64, u64, u32),
        pick: impl FnOnce(&mut State) -> &mut HashMap<u64, T>,
    ) -> CuResult<()> {
        let id = unhandle(t, h).ok_or(err)?;
        pick(&mut self.st()).remove(&id).map(drop).ok_or(err)
    }
}
