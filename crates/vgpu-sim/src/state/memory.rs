//! Plain allocations (`cuMemAlloc`, pitch, managed), pointer queries, copies, memsets and IPC
//! handles.

use super::*;

impl Sim {
    pub(super) fn cur_dev(&self) -> CuResult<(u64, usize)> {
        let id = self.current()?;
        let st = self.st();
        let c = st.ctxs.get(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok((id, c.dev))
    }

    pub(super) fn alloc_in(&self, size: u64, accounted: u64, kind: AllocKind) -> CuResult<u64> {
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

    pub(super) fn drop_alloc(&self, st: &mut State, a: Alloc) {
        match a.kind {
            AllocKind::Pool(pid) => {
                if let Some(pool) = st.pools.get_mut(&pid) {
                    pool.used = pool.used.saturating_sub(a.accounted);
                    if pool.destroyed {
                        pool.reserved = pool.reserved.saturating_sub(a.accounted);
                        self.release_pool_block(a.dev, a.accounted);
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
        } else if let Some((b, m)) = st.map_at(p) {
            let dev = st.phys.get(&m.handle).and_then(|h| h.dev).unwrap_or(0);
            Some((*b, m.size, dev, 0, false, AllocKind::Device))
        } else {
            st.pinned_at(p).map(|r| {
                let (size, ctx) = (r.pinning.size, r.pinning.ctx);
                let dev = st.ctxs.get(&ctx).map_or(0, |c| c.dev);
                (r.base, size, dev, ctx, false, AllocKind::Device)
            })
        };
        let Some((base, size, dev, ctx, managed, kind)) = found else {
            return Err(CUDA_ERROR_INVALID_VALUE);
        };
        // Pinned host memory: CU_MEMORYTYPE_HOST, with a host pointer.
        let host = st.alloc_at(p).is_none() && st.map_at(p).is_none();
        let ord = self.ordinal_of(dev).unwrap_or(0);
        Ok(match attr {
            1 => PtrAttr::U64(if ctx == 0 { 0 } else { handle(tag::CTX, ctx) }),
            2 => PtrAttr::U32(if host {
                1
            } else if managed {
                4
            } else {
                2
            }),
            3 => PtrAttr::U64(p),
            4 if managed || host => PtrAttr::U64(p),
            4 => return Err(CUDA_ERROR_INVALID_VALUE),
            6 => PtrAttr::U32(0),
            7 => PtrAttr::U64(base),
            8 => PtrAttr::U32(managed as u32),
            9 => PtrAttr::U32(ord as u32),
            10 => {
                PtrAttr::U32((!host && matches!(kind, AllocKind::Device | AllocKind::Pitch)) as u32)
            }
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

    pub(super) fn sync_current(&self) -> CuResult<()> {
        let id = self.current()?;
        for q in self.ctx_waits(id) {
            q.drain();
        }
        Ok(())
    }

    /// Synchronous copy of `n` bytes.
    pub fn memcpy(&self, dst: Addr, src: Addr, n: u64) -> CuResult<()> {
        self.sync_current()?;
        self.copy_now(dst, src, n)
    }

    pub(super) fn copy_now(&self, dst: Addr, src: Addr, n: u64) -> CuResult<()> {
        // A side in the program's pageable memory runs at the pageable rate (the real driver
        // stages it through pinned buffers of its own), the state not held meanwhile.
        if let Some(us) = n.checked_div(self.cfg.pageable_mbps) {
            let pageable =
                |a: &Addr| matches!(a, Addr::Host(h) if self.st().pinned_at(h.addr()).is_none());
            if pageable(&dst) || pageable(&src) {
                std::thread::sleep(std::time::Duration::from_micros(us));
            }
        }
        let st = self.st();
        hostmem::copy(st.span(dst, n)?, st.span(src, n)?);
        Ok(())
    }

    /// Synchronous memset of `count` elements of `elem` bytes.
    pub fn memset(&self, dst: u64, value: u32, elem: usize, count: u64) -> CuResult<()> {
        self.sync_current()?;
        self.set_now(dst, value, elem, count)
    }

    pub(super) fn set_now(&self, dst: u64, value: u32, elem: usize, count: u64) -> CuResult<()> {
        let st = self.st();
        let len = count
            .checked_mul(elem as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        hostmem::fill(st.device_span(dst, len)?, value, elem);
        Ok(())
    }

    /// Stream-ordered copy.
    pub fn memcpy_async(
        &'static self,
        dst: Addr,
        src: Addr,
        n: u64,
        stream: StreamArg,
    ) -> CuResult<()> {
        self.stream_ordered(
            stream,
            |st| {
                st.span(dst, n)?;
                st.span(src, n).map(drop)
            },
            move |s| s.copy_now(dst, src, n),
        )
    }

    /// Stream-ordered memset.
    pub fn memset_async(
        &'static self,
        dst: u64,
        value: u32,
        elem: usize,
        count: u64,
        stream: StreamArg,
    ) -> CuResult<()> {
        self.stream_ordered(
            stream,
            |st| st.check_range(dst, count.saturating_mul(elem as u64)),
            move |s| s.set_now(dst, value, elem, count),
        )
    }

    /// A copy or memset in `stream`'s order (the stream must not be capturing): `check`ed
    /// now, as the driver checks the call, and done when the stream gets to it.
    fn stream_ordered(
        &'static self,
        stream: StreamArg,
        check: impl FnOnce(&State) -> CuResult<()>,
        op: impl FnOnce(&'static Sim) -> CuResult<()> + Send + 'static,
    ) -> CuResult<()> {
        let q = self.uncaptured_queue(stream)?;
        check(&self.st())?;
        // A failure by then is the stream's, which the simulator does not report.
        q.submit(Box::new(move || {
            let _ = op(self);
        }));
        Ok(())
    }

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
}
