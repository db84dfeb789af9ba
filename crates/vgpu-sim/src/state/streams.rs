//! Streams and events.

use super::*;

/// A stream as a call names it: its handle (0 the default stream, 1 `CU_STREAM_LEGACY`, 2
/// `CU_STREAM_PER_THREAD`, else a created stream) and whether the call came through a `_ptsz`
/// export, for which the default stream is the calling thread's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamArg {
    pub handle: u64,
    pub per_thread: bool,
}

impl StreamArg {
    /// `handle` as a legacy-default-stream export names it.
    pub const fn legacy(handle: u64) -> Self {
        Self {
            handle,
            per_thread: false,
        }
    }
}

impl Sim {
    /// `cuStreamCreate`.
    pub fn stream_create(&self, flags: u32) -> CuResult<u64> {
        let ctx = self.current()?;
        Ok(self.new_handle(
            tag::STREAM,
            |st| &mut st.streams,
            Stream {
                ctx,
                flags,
                q: StreamQueue::new(),
                capture: None,
            },
        ))
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

    /// The queue of `stream` for work a capture cannot record
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` while the stream is capturing).
    pub(super) fn uncaptured_queue(&self, stream: StreamArg) -> CuResult<Arc<StreamQueue>> {
        match self.stream_queue(stream)? {
            (_, true) => Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
            (q, false) => Ok(q),
        }
    }

    /// The queue behind `stream`, and whether the stream is capturing.
    pub fn stream_queue(&self, stream: StreamArg) -> CuResult<(Arc<StreamQueue>, bool)> {
        let h = stream.handle;
        if h == 2 || (h == 0 && stream.per_thread) {
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
    pub fn stream_sync(&self, stream: StreamArg) -> CuResult<()> {
        let (q, _) = self.stream_queue(stream)?;
        q.drain();
        self.trim_pools_at_sync();
        Ok(())
    }

    /// `cuStreamQuery`.
    pub fn stream_query(&self, stream: StreamArg) -> CuResult<()> {
        let (q, _) = self.stream_queue(stream)?;
        if q.done(q.last_ticket()) {
            Ok(())
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    }

    /// `cuEventCreate`.
    pub fn event_create(&self, flags: u32) -> CuResult<u64> {
        self.current()?;
        Ok(self.new_handle(
            tag::EVENT,
            |st| &mut st.events,
            Arc::new(Event {
                flags,
                ..Event::default()
            }),
        ))
    }

    pub(super) fn event(&self, h: u64) -> CuResult<Arc<Event>> {
        self.read_handle(
            (tag::EVENT, h, CUDA_ERROR_INVALID_HANDLE),
            |st| &st.events,
            Arc::clone,
        )
    }

    /// `cuEventDestroy_v2`.
    pub fn event_destroy(&self, h: u64) -> CuResult<()> {
        self.drop_handle((tag::EVENT, h, CUDA_ERROR_INVALID_HANDLE), |st| {
            &mut st.events
        })
    }

    /// `cuEventRecord`.
    pub fn event_record(&self, h: u64, stream: StreamArg) -> CuResult<()> {
        let e = self.event(h)?;
        let q = self.uncaptured_queue(stream)?;
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
    pub fn stream_wait_event(&self, stream: StreamArg, ev: u64) -> CuResult<()> {
        let e = self.event(ev)?;
        let (q, _) = self.stream_queue(stream)?;
        q.submit(Box::new(move || e.wait()));
        Ok(())
    }

    /// `cuStreamWaitValue32`: later work on the stream waits until the 32-bit word at `addr`
    /// satisfies `flags` against `value` (`CU_STREAM_WAIT_VALUE_GEQ` 0, as a wrapping
    /// difference; `EQ` 1; `AND` 2). The simulated driver takes words in pinned allocations
    /// (which the waiting job keeps mapped) and registered host memory (which the program
    /// keeps valid: the driver API's contract), not device memory as the real one also does;
    /// `NOR` and a capturing stream are refused.
    pub fn stream_wait_value32(
        &self,
        stream: StreamArg,
        addr: u64,
        value: u32,
        flags: u32,
    ) -> CuResult<()> {
        self.current()?;
        if flags > 2 || addr % 4 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let source = {
            let st = self.st();
            let r = st.pinned_at(addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            match (st.pinned.get(&r.base), st.registered.get(&r.base)) {
                (Some(a), _) => WordSource::Allocation(a.region.clone()),
                (None, Some(reg)) => WordSource::Registered(reg.ptr, r.pinning.size),
                (None, None) => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        };
        if source.word(addr).is_none() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let q = self.uncaptured_queue(stream)?;
        q.submit(Box::new(move || {
            let Some(word) = source.word(addr) else {
                return;
            };
            while let Some(w) = hostmem::load_u32(word) {
                let met = match flags {
                    0 => (w.wrapping_sub(value) as i32) >= 0,
                    1 => w == value,
                    _ => w & value != 0,
                };
                if met {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        }));
        Ok(())
    }
}

/// Where a stream wait's word lies.
enum WordSource {
    /// A pinned allocation, kept mapped by the waiting job.
    Allocation(Arc<HostRegion>),
    /// Registered host memory of `size` bytes.
    Registered(HostPtr, u64),
}

impl WordSource {
    fn word(&self, addr: u64) -> Option<hostmem::Span<'_>> {
        match self {
            Self::Allocation(region) => region.span(addr, 4),
            Self::Registered(ptr, size) => ptr.span(*size)?.sub(addr, 4),
        }
    }
}
