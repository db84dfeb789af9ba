//! Graph memory: graphs reserve their memory at launch, from a per-device graph heap we
//! measure (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) after launches and trims.

#![allow(unsafe_code)] // reads or writes the caller's pointers

use super::*;

fn settle_graph(st: &Ready, cuda: &Cuda, dev: CUdevice) {
    let Some(idx) = dev_index(dev) else { return };
    let Ok(measured) = driver::graph_mem_reserved(cuda, dev) else {
        return;
    };
    if measured == 0 && st.graph.get(dev.0).is_none() {
        return;
    }
    let m = st.graph.settle(st.ledger(), dev.0, idx, measured, 0);
    if m.shortfall > 0 {
        vlog!(
            WARN,
            "device {idx}: graph memory holds {} bytes more than the limit allows",
            m.shortfall
        );
    }
}

/// Refuses (with the usual log line) an allocation that alone cannot fit what is left of the
/// limit, for memory charged later by measurement (graph memory nodes, captured allocations).
pub(super) fn refuse_unless_it_fits(
    st: &Ready,
    idx: DeviceIndex,
    bytes: u64,
) -> Result<(), CUresult> {
    st.ledger()
        .try_reserve(idx, UsageClass::Data, bytes)
        .map_err(|oom| log_oom(&oom))?;
    st.ledger().release(idx, UsageClass::Data, bytes);
    Ok(())
}

pub(crate) unsafe fn cuGraphAddMemAllocNode(
    forward: impl Forward,
    _node: *mut CUgraphNode,
    _graph: CUgraph,
    _dependencies: *const CUgraphNode,
    _num_dependencies: usize,
    params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> Result<(), CUresult> {
    let cuda = real::cuda()?;
    // Graph memory is taken at launch: refused here while enforcement is off.
    let st = ready()?;
    // SAFETY: `params` is null or valid (driver contract).
    if let Some(p) = unsafe { read_in(params) } {
        let loc = p.poolProps.location;
        if let Some(idx) =
            dev_index(CUdevice(loc.id)).filter(|_| loc.type_ == CUmemLocationType::DEVICE)
        {
            refuse_unless_it_fits(st, idx, p.bytesize as u64)?;
        }
    }
    forward(cuda)?;
    st.graph_mem_possible.store(true, Ordering::Relaxed);
    Ok(())
}

/// `cuDeviceGraphMemTrim` succeeded: the graph heap may hold less.
pub(crate) fn graph_mem_trimmed(cuda: &Cuda, dev: CUdevice) -> Result<(), CUresult> {
    if let Some(st) = ready_state() {
        settle_graph(st, cuda, dev);
    }
    Ok(())
}

/// After a graph launch or upload succeeded: graphs with memory nodes reserve device memory
/// now.
pub(crate) fn graph_launched(cuda: &Cuda, stream: CUstream) -> Result<(), CUresult> {
    if let Some(st) = ready_state().filter(|st| st.graph_mem_possible.load(Ordering::Relaxed)) {
        if let Ok(dev) = driver::stream_device(cuda, stream) {
            settle_graph(st, cuda, dev);
        }
    }
    Ok(())
}

/// A launch like any other (the SM limit's), then what the graph's memory nodes took.
pub(crate) fn cuGraphLaunch(
    variant: StreamKind,
    forward: impl Forward,
    exec: CUgraphExec,
    stream: CUstream,
) -> Result<(), CUresult> {
    // A graph does the same work at every launch: its handle is its identity.
    launch(
        variant,
        || (stream, sm_limit::launch_id(&[exec as u64])),
        forward,
    )?;
    graph_launched(real::cuda()?, stream)
}
