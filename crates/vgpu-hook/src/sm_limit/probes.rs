//! What the limiter's container view asks outside the shared file: this container's place
//! on the GPU's turn board (node-wide, `VGPU_TURN_DIR`), and NVML's per-process utilization
//! for the experimental contention correction.

use vgpu_cuda_abi::{CUdevice, c_int, nvmlDevice_t, nvmlProcessUtilizationSample_t};
use vgpu_limiter::DeviceSample;
use vgpu_shm::TurnBoard;

use super::SmLimiter;
use crate::log::{INFO, WARN, vlog};

/// This container's place on the GPU's turn board.
pub(super) enum TurnProbe {
    Unopened,
    Unavailable,
    Open { board: TurnBoard, key: u64 },
}

impl TurnProbe {
    #[cold]
    pub(super) fn open(device: usize, sm: &SmLimiter) -> Self {
        // `VGPU_TURN_DIR` (vgpu-env), default /tmp/vgpulock; None = off.
        let Some(dir) = sm.tuning().turn_dir.as_deref() else {
            return Self::Unavailable;
        };
        // Containers are told apart by their shared file (one per container); without one
        // this process is its own container.
        let key = match sm
            .slot()
            .and_then(|s| vgpu_shm::container_key(s.table().path()).ok())
        {
            Some(k) => k,
            None => u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
        };
        let uuid = crate::real::cuda()
            .ok()
            .and_then(|cuda| crate::driver::device_uuid(cuda, CUdevice(device as c_int)).ok());
        let Some(uuid) = uuid else {
            return Self::Unavailable;
        };
        let path = std::path::Path::new(dir).join(vgpu_shm::board_file_name(&uuid));
        if !std::path::Path::new(dir).is_dir() {
            vlog!(
                INFO,
                "device {device}: no {dir} directory: containers on this GPU do not take turns"
            );
            return Self::Unavailable;
        }
        match TurnBoard::open_or_create(&path) {
            Ok(board) => Self::Open { board, key },
            Err(e) => {
                vlog!(
                    WARN,
                    "device {device}: {e}: containers on this GPU do not take turns"
                );
                Self::Unavailable
            }
        }
    }
}

/// NVML's per-process utilization of one device, for the limiter's contention correction.
pub(super) enum NvmlProbe {
    Unopened,
    Unavailable,
    Open {
        /// The `nvmlDevice_t` (an address, so the view stays `Send`).
        handle: usize,
        last_seen: u64,
        pid: u32,
        buf: Vec<nvmlProcessUtilizationSample_t>,
    },
}

impl NvmlProbe {
    #[cold]
    fn open(device: usize) -> Self {
        let handle = crate::real::cuda()
            .ok()
            .and_then(|cuda| crate::driver::nvml_device(cuda, CUdevice(device as c_int)));
        match handle {
            Some(handle) => Self::Open {
                handle: handle as usize,
                last_seen: 0,
                pid: std::process::id(),
                buf: Vec::new(),
            },
            None => Self::Unavailable,
        }
    }

    /// Our share and whether others ran, from the samples since the previous call. `None`
    /// when NVML has no sample of this process (for instance when it reports host pids
    /// and this process runs in a pid namespace): then no correction is made.
    pub(super) fn sample(&mut self, device: usize) -> Option<DeviceSample> {
        if matches!(self, Self::Unopened) {
            *self = Self::open(device);
        }
        let Self::Open {
            handle,
            last_seen,
            pid,
            buf,
        } = self
        else {
            return None;
        };
        crate::driver::nvml_process_utilization(*handle as nvmlDevice_t, *last_seen, buf).ok()?;
        let (mut own, mut n, mut others) = (0u64, 0u64, false);
        for s in buf.iter() {
            *last_seen = (*last_seen).max(s.timeStamp);
            if s.pid == *pid {
                own += u64::from(s.smUtil.min(100));
                n += 1;
            } else if s.smUtil > 0 {
                others = true;
            }
        }
        (n > 0).then(|| DeviceSample {
            own: own as f64 / n as f64 / 100.0,
            others_active: others,
        })
    }
}
