//! Modules, functions, the built-in kernels and launches.

use super::*;

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
    pub(super) fn arg_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.args[off..off + 8]);
        u64::from_le_bytes(b)
    }

    pub(super) fn arg_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.args[off..off + 4]);
        u32::from_le_bytes(b)
    }
}

impl Sim {
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
        Ok(self.new_handle(
            tag::MODULE,
            |st| &mut st.modules,
            Module {
                ctx,
                dev,
                entry_loaded: vec![!self.cfg.lazy_loading; entries.len()],
                entries,
                accounted: acc,
                loaded: !self.cfg.lazy_loading,
            },
        ))
    }

    /// The kernel behind a function handle a launch call launches (`cuLaunchKernel`,
    /// `cuLaunchCooperativeKernel`, `cuLaunchKernelEx`, their `_ptsz` forms). Under lazy
    /// loading the function's first launch in its context loads it, and loading waits for
    /// the context: the call blocks, before anything is queued, until every stream of the
    /// context has run what was queued on it (as `cuCtxSynchronize`; the CUDA programming
    /// guide, "Lazy Loading": loading a kernel may need context synchronization). Work that
    /// waits for something the caller does only after the call (a stream waiting on a host
    /// word) then deadlocks, as on the real driver. `EAGER`: every function was loaded with
    /// its module, nothing waits.
    pub fn function_for_launch_call(&self, f: u64) -> CuResult<(Kernel, usize)> {
        if self.cfg.lazy_loading
            && let Some(ctx) = self.unloaded_function_ctx(f)?
        {
            // Not under the state lock: stream jobs take it.
            for q in self.ctx_waits(ctx) {
                q.drain();
            }
        }
        self.function_to_launch(f)
    }

    /// The context of function `f` if it is not loaded into it yet.
    fn unloaded_function_ctx(&self, f: u64) -> CuResult<Option<u64>> {
        let id = unhandle(tag::FUNC, f).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let st = self.st();
        let func = st.funcs.get(&id).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let m = st
            .modules
            .get(&func.module)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        Ok((!m.entry_loaded[func.entry]).then_some(m.ctx))
    }

    /// The kernel behind a function handle about to be launched (or put in a graph): under
    /// lazy loading its module's code is loaded onto the device now, taking the module's
    /// memory (`CUDA_ERROR_OUT_OF_MEMORY` if the device is full), as the real driver does,
    /// and the function counts as loaded into its context (a graph kernel node loads it
    /// without waiting; a launch call waits first, [`Self::function_for_launch_call`]).
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
        m.entry_loaded[func.entry] = true;
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
        let entry = m
            .entries
            .iter()
            .position(|e| e == name)
            .ok_or(CUDA_ERROR_NOT_FOUND)?;
        let fid = st.id();
        st.funcs.insert(
            fid,
            Func {
                module: id,
                entry,
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
    pub fn launch(&'static self, l: Launch, stream: StreamArg) -> CuResult<()> {
        let (q, capturing) = self.stream_queue(stream)?;
        if capturing {
            let id = unhandle(tag::STREAM, stream.handle).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
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

    pub(super) fn run_kernel(&self, l: &Launch) {
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
}
