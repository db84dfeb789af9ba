//! Graphs, stream capture and graph memory.

use super::*;

impl Sim {
    pub(super) fn capture_graph(&self, stream: u64) -> CuResult<u64> {
        self.read_handle(
            (tag::STREAM, stream, CUDA_ERROR_INVALID_HANDLE),
            |st| &st.streams,
            |s| s.capture.map(|c| c.graph),
        )?
        .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }

    /// A graph allocation is no longer in use (freed by a node, `cuMemFree` or `cuMemFreeAsync`).
    pub(super) fn graph_unlive(&self, dptr: u64) {
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

    /// `cuGraphCreate`.
    pub fn graph_create(&self) -> CuResult<u64> {
        Ok(self.new_handle(tag::GRAPH, |st| &mut st.graphs, Graph::default()))
    }

    pub(super) fn add_node(&self, g: u64, n: Node) -> CuResult<u64> {
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
        self.drop_handle((tag::GRAPH, g, CUDA_ERROR_INVALID_VALUE), |st| {
            &mut st.graphs
        })
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
    /// or a global-mode capture begun by any thread. (Driver 580 does so for
    /// `cuMemPoolGetAttribute`: `gpu-tests/capture_rules.sh` shows which calls on a GPU.)
    pub(super) fn capture_unsafe_call(&self) -> CuResult<()> {
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
        self.drop_handle((tag::EXEC, e, CUDA_ERROR_INVALID_VALUE), |st| &mut st.execs)
    }

    /// `cuGraphLaunch`: memory nodes take their memory now (so an out-of-memory launch fails
    /// here); kernels run in node order on the stream.
    pub fn graph_launch(&'static self, e: u64, stream: StreamArg) -> CuResult<()> {
        let (q, mut st, nodes) = self.exec_on_stream(e, stream)?;
        for (dev, dptr) in mem_alloc_nodes(&nodes) {
            if st
                .graph_allocs
                .get(&dptr)
                .ok_or(CUDA_ERROR_INVALID_VALUE)?
                .live
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            self.back_graph_alloc(&mut st, dev, dptr)?;
            let ga = st.graph_allocs.get_mut(&dptr).expect("present");
            ga.live = true;
            let (size, region) = (ga.size, ga.region.clone());
            let gm = &mut st.graph_mem[dev];
            gm.used += size;
            gm.used_high = gm.used_high.max(gm.used);
            st.allocs.insert(
                dptr,
                Alloc {
                    size,
                    accounted: 0,
                    dev,
                    ctx: None,
                    kind: AllocKind::Graph,
                    region,
                },
            );
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
    pub fn graph_upload(&self, e: u64, stream: StreamArg) -> CuResult<()> {
        let (_q, mut st, nodes) = self.exec_on_stream(e, stream)?;
        for (dev, dptr) in mem_alloc_nodes(&nodes) {
            self.back_graph_alloc(&mut st, dev, dptr)?;
        }
        Ok(())
    }

    /// What launching or uploading exec `e` on `stream` starts from: the stream's queue (it
    /// must not be capturing), the state locked, and a copy of the exec's nodes.
    fn exec_on_stream(
        &self,
        e: u64,
        stream: StreamArg,
    ) -> CuResult<(Arc<StreamQueue>, MutexGuard<'_, State>, Vec<Node>)> {
        let id = unhandle(tag::EXEC, e).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let q = self.uncaptured_queue(stream)?;
        let st = self.st();
        let nodes = st.execs.get(&id).ok_or(CUDA_ERROR_INVALID_VALUE)?.clone();
        Ok((q, st, nodes))
    }

    /// A graph memory node takes its memory from the device the first time its graph is
    /// uploaded or launched (the driver's graph heap then keeps it).
    pub(super) fn back_graph_alloc(&self, st: &mut State, dev: usize, dptr: u64) -> CuResult<()> {
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
}

/// `(device, address)` of each graph memory-allocation node, in node order.
fn mem_alloc_nodes(nodes: &[Node]) -> impl Iterator<Item = (usize, u64)> + '_ {
    nodes.iter().filter_map(|n| match *n {
        Node::MemAlloc { dev, dptr } => Some((dev, dptr)),
        _ => None,
    })
}
