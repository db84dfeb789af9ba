//! Graph memory: graphs reserve their memory at launch, from a per-device graph heap we
//! measure (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) after launches and trims.

use super::*;

pub(super) fn settle_graph(st: &Ready, cuda: &Cuda, dev: CUdevice) {
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
    node: *mut CUgraphNode,
    graph: CUgraph,
    dependencies: *const CUgraphNode,
    num_dependencies: usize,
    params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    let cuda = tri!(real::cuda());
    let real_call = || {
        call!(
            cuda,
            h.cuGraphAddMemAllocNode(node, graph, dependencies, num_dependencies, params)
        )
    };
    let Some(st) = ready_state() else {
        return real_call();
    };
    // SAFETY: `params` is null or valid (driver contract).
    if let Some(p) = unsafe { read_in(params) } {
        let loc = p.poolProps.location;
        if let Some(idx) =
            dev_index(CUdevice(loc.id)).filter(|_| loc.type_ == CUmemLocationType::DEVICE)
        {
            if let Err(r) = refuse_unless_it_fits(st, idx, p.bytesize as u64) {
                return r;
            }
        }
    }
    let r = real_call();
    if r.is_success() {
        st.graph_mem_possible.store(true, Ordering::Relaxed);
    }
    r
}

pub(crate) unsafe fn cuDeviceGraphMemTrim(dev: CUdevice) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuDeviceGraphMemTrim(dev));
    if let Some(st) = ready_state().filter(|_| r.is_success()) {
        settle_graph(st, cuda, dev);
    }
    r
}

pub(crate) unsafe fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuGraphUpload(exec, stream));
    after_graph_launch(cuda, stream, r)
}

pub(crate) unsafe fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = call!(cuda, h.cuGraphUpload_ptsz(exec, stream));
    after_graph_launch(cuda, stream, r)
}

/// After a graph launch or upload: graphs with memory nodes reserve device memory now.
pub(super) fn after_graph_launch(cuda: &Cuda, stream: CUstream, r: CUresult) -> CUresult {
    if r.is_success() {
        if let Some(st) = ready_state().filter(|st| st.graph_mem_possible.load(Ordering::Relaxed)) {
            if let Ok(dev) = driver::stream_device(cuda, stream) {
                settle_graph(st, cuda, dev);
            }
        }
    }
    r
}

pub(crate) unsafe fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = launch(
        cuda,
        || stream,
        LaunchKind::Graph,
        || call!(cuda, h.cuGraphLaunch(exec, stream)),
    );
    after_graph_launch(cuda, stream, r)
}

pub(crate) unsafe fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    let cuda = tri!(real::cuda());
    let r = launch(
        cuda,
        || per_thread(stream),
        LaunchKind::Graph,
        || call!(cuda, h.cuGraphLaunch_ptsz(exec, stream)),
    );
    after_graph_launch(cuda, stream, r)
}
