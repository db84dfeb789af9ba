//! Contexts: primary and created, the per-thread current stack, limits and synchronization.

use super::*;

impl Sim {
    pub(super) fn new_ctx(
        &self,
        st: &mut State,
        ord: i32,
        flags: u32,
        primary: bool,
    ) -> CuResult<u64> {
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
    pub(super) fn clear_ctx(&self, st: &mut State, id: u64) {
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
        let arrays = ids_where(&st.arrays, |a| a.ctx == id);
        for k in arrays {
            if let Some(a) = st.arrays.remove(&k)
                && a.parent.is_none()
            {
                self.devices[a.dev].release(a.bytes);
            }
        }
        let mods = ids_where(&st.modules, |m| m.ctx == id);
        for k in mods {
            if let Some(m) = st.modules.remove(&k) {
                self.devices[m.dev].release(m.accounted);
                st.funcs.retain(|_, f| f.module != k);
            }
        }
        let streams = ids_where(&st.streams, |s| s.ctx == id);
        for k in streams {
            if let Some(s) = st.streams.remove(&k) {
                s.q.close();
            }
        }
        // Pinned host memory and registrations go with the context that made them (portable
        // ones too: portable is about which contexts may use it), as `cudaDeviceReset`
        // "destroys all allocations": the pages are unmapped, and the program's pointers
        // into them dangle, as with the real driver.
        let pinned: Vec<u64> = (st.pinned.iter())
            .filter(|(_, a)| a.pinning.ctx == id)
            .map(|(b, _)| *b)
            .collect();
        for b in pinned {
            if let Some(a) = st.pinned.remove(&b) {
                self.host.release(a.region.len() as u64);
            }
        }
        let registered: Vec<u64> = (st.registered.iter())
            .filter(|(_, r)| r.pinning.ctx == id)
            .map(|(b, _)| *b)
            .collect();
        for b in registered {
            if let Some(r) = st.registered.remove(&b) {
                self.host.release(r.accounted);
            }
        }
    }

    pub(super) fn destroy_ctx(&self, st: &mut State, id: u64) {
        self.clear_ctx(st, id);
        if let Some(c) = st.ctxs.remove(&id) {
            c.null_stream.close();
            self.devices[c.dev].release(self.cfg.ctx_overhead);
        }
    }

    pub(super) fn ctx_waits(&self, id: u64) -> Vec<Arc<StreamQueue>> {
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
}

/// The ids of the objects in `table` that `owned` picks (collected, so the table can then change).
fn ids_where<T>(table: &HashMap<u64, T>, owned: impl Fn(&T) -> bool) -> Vec<u64> {
    table
        .iter()
        .filter(|(_, object)| owned(object))
        .map(|(id, _)| *id)
        .collect()
}
