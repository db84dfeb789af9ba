//! Stream-ordered allocation and memory pools.

use super::*;

impl Sim {
    pub(super) fn pool_new(&self, st: &mut State, dev: usize) -> u64 {
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

    pub(super) fn default_pool_of(&self, st: &mut State, dev: usize) -> u64 {
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
        let blocks: Vec<u64> = pl.free.drain(..).map(|(s, _)| s).collect();
        pl.reserved -= blocks.iter().sum::<u64>();
        for s in blocks {
            self.release_pool_block(dev, s);
        }
        for cur in st.current_pool.iter_mut() {
            if *cur == Some(id) {
                *cur = None;
            }
        }
        Ok(())
    }

    /// A pool's block of `size` goes back to device `dev`, with the driver's own memory for it
    /// (`VGPU_SIM_POOL_BLOCK_OVERHEAD`).
    pub(super) fn release_pool_block(&self, dev: usize, size: u64) {
        self.devices[dev].release(size + self.cfg.pool_block_overhead);
    }

    pub(super) fn pool_trim_locked(&self, st: &mut State, id: u64, keep: u64) {
        let Some(pl) = st.pools.get_mut(&id) else {
            return;
        };
        pl.free.sort_by_key(|(s, _)| *s);
        while pl.reserved > keep {
            let Some((s, _)) = pl.free.pop() else { break };
            pl.reserved -= s;
            let dev = pl.dev;
            self.release_pool_block(dev, s);
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

    pub(super) fn trim_pools_at_sync(&self) {
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
    pub fn alloc_async(&self, size: u64, pool: u64, stream: StreamArg) -> CuResult<u64> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (_q, capturing) = self.stream_queue(stream)?;
        let (ctx, dev) = self.cur_dev()?;
        if capturing {
            // Captured, it becomes a memory node of the graph being built, as with the driver.
            let g = self.capture_graph(stream.handle)?;
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
            let taken = block
                .checked_add(self.cfg.pool_block_overhead)
                .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            if self.devices[pdev].reserve(taken).is_err() {
                // Give back this pool's unused blocks before failing, as the driver does.
                self.pool_trim_locked(&mut st, id, 0);
                self.devices[pdev].reserve(taken)?;
            }
            let Some(r) = HostRegion::new(block as usize) else {
                self.release_pool_block(pdev, block);
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
    pub fn free_async(&'static self, p: u64, stream: StreamArg) -> CuResult<()> {
        let (q, capturing) = self.stream_queue(stream)?;
        if capturing {
            // Only graph memory can be freed inside a capture (a memory-free node).
            if !self.st().graph_allocs.contains_key(&p) {
                return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            }
            let g = self.capture_graph(stream.handle)?;
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
}
