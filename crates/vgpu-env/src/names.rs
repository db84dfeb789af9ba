//! The names of the variables and their defaults: every setting of the product that comes
//! from the environment is named here, once.

/// Default per-device memory limit (all devices).
pub const ENV_MEMORY_LIMIT: &str = "CUDA_DEVICE_MEMORY_LIMIT";
/// Default SM limit in percent (all devices).
pub const ENV_SM_LIMIT: &str = "CUDA_DEVICE_SM_LIMIT";
/// Path of the shared usage file.
pub const ENV_SHARED_CACHE: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";
/// `force`, `disable`, `monitor` or `default`.
pub const ENV_CORE_POLICY: &str = "GPU_CORE_UTILIZATION_POLICY";
/// Priority written to the shared file for the monitor.
pub const ENV_TASK_PRIORITY: &str = "CUDA_TASK_PRIORITY";
/// Log verbosity 0..=4.
pub const ENV_LOG_LEVEL: &str = "LIBCUDA_LOG_LEVEL";
/// Accepted for compatibility; has no effect (as in HAMi-core).
pub const ENV_ACTIVE_OOM_KILLER: &str = "ACTIVE_OOM_KILLER";
/// The CUDA device selection, kept raw for the hook to resolve.
pub const ENV_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";
/// `0` turns the sub-allocator off (every request goes straight to the device).
pub const ENV_SUBALLOC: &str = "VGPU_SUBALLOC";
/// `0` stops counting `cuMemAllocManaged` against the limit.
pub const ENV_COUNT_MANAGED: &str = "VGPU_COUNT_MANAGED";
/// Sub-allocator region size (HAMi-core's OVERSIZE).
pub const ENV_REGION_SIZE: &str = "VGPU_ALLOC_OVERSIZE";
/// Sub-allocator chunk size (HAMi-core's BITSIZE).
pub const ENV_CHUNK_SIZE: &str = "VGPU_ALLOC_BITSIZE";
/// Requests below this are sub-allocated (HAMi-core's IPCSIZE).
pub const ENV_SUBALLOC_THRESHOLD: &str = "VGPU_ALLOC_IPCSIZE";
/// Direct allocations are accounted rounded up to this (HAMi-core's ALIGN).
pub const ENV_ALIGN: &str = "VGPU_ALLOC_ALIGN";
/// How often (milliseconds) the hook may reconcile its accounting with NVML's per-process
/// used memory on the paths that rate-limit it; `off` turns reconciliation off.
pub const ENV_RECONCILE_MS: &str = "VGPU_RECONCILE_MS";
/// Default of [`ENV_RECONCILE_MS`].
pub const DEFAULT_RECONCILE_MS: u64 = 100;
/// `1` turns on the experimental NVML-based contention correction of the SM limiter.
pub const ENV_SM_CONTENTION: &str = "VGPU_SM_CONTENTION";
/// Directory of the node-wide turn boards (SM limit); `off` disables turns.
pub const ENV_TURN_DIR: &str = "VGPU_TURN_DIR";
/// Default of [`ENV_TURN_DIR`]: the host directory HAMi's device plugin mounts into every
/// container.
pub const DEFAULT_TURN_DIR: &str = "/tmp/vgpulock";
/// Shortest turn cycle of containers sharing a GPU, milliseconds.
pub const ENV_TURN_CYCLE_MS: &str = "VGPU_TURN_CYCLE_MS";
/// How long before its window a container may start queueing, microseconds.
pub const ENV_TURN_LEAD_US: &str = "VGPU_TURN_LEAD_US";
/// Share mode: how long after its queued work ends a container that takes no turns still
/// counts as busy (its `busy_until` grace), microseconds. Lower-priority containers are held
/// that long after the last launch of a higher one: host gaps shorter than this inside a
/// request do not let them in.
pub const ENV_SHARE_GRACE_US: &str = "VGPU_SHARE_GRACE_US";
/// Share mode: the most work (microseconds of GPU time) a container keeps queued while a
/// container of higher priority is on the board: the urgent one's next kernel waits at most
/// about this long behind ours.
pub const ENV_SHARE_OUTRANKED_QUEUE_US: &str = "VGPU_SHARE_OUTRANKED_QUEUE_US";
/// Share mode: a held lower-priority container may fill the gaps of a sparse higher one with
/// at most this much queued, microseconds (default 125); 0 = no gap filling: held while the
/// higher one is busy.
pub const ENV_SHARE_GAP_FILL_US: &str = "VGPU_SHARE_GAP_FILL_US";
/// Timer slack (microseconds) of the hook's waits before a launch; 0 (also when unset) = as
/// tight as the kernel allows. Linux's own default (50 us) lets a held container sleep past
/// the moment it may launch again.
pub const ENV_WAKE_SLACK_US: &str = "VGPU_WAKE_SLACK_US";
/// How strongly the SM limit also bounds a tenant's share of the GPU's power budget: an
/// exponent from 0 (time only) to 1 (the power share fully), default 0.5; `off` = 0.
pub const ENV_SM_POWER_EXPONENT: &str = "VGPU_SM_POWER_EXPONENT";
/// HAMi's oversubscription switch (`true` when `deviceMemoryScaling > 1`): the limit still
/// bounds what a container holds, but what the physical device has no room for is backed by
/// host memory at a device address instead of failing (docs/oversubscription.md).
pub const ENV_OVERSUBSCRIBE: &str = "CUDA_OVERSUBSCRIBE";
/// vgpu's own: how much host memory a container may hold at device addresses beyond its
/// device limit (a size; 0 = none). Its device-resident memory still never exceeds the limit.
pub const ENV_HOST_SPILL: &str = "VGPU_HOST_SPILL";
/// With host backing on: device memory to leave free on the GPU (a size; default 0). An
/// allocation that would leave less is host-backed instead, so an oversubscribed tenant does
/// not take the GPU's last bytes from its neighbours (and their new contexts).
pub const ENV_DEVICE_RESERVE: &str = "VGPU_DEVICE_RESERVE";
/// How `CUDA_DEVICE_SM_LIMIT` is read: `cap` (HAMi's meaning, the default) or `share`
/// (a guaranteed share that borrows idle time, with `CUDA_TASK_PRIORITY` ordering who
/// borrows first; docs/sm-limit.md).
pub const ENV_SM_MODE: &str = "VGPU_SM_MODE";
/// Share mode: the most a container may borrow up to, percent (default 100).
pub const ENV_SM_CEILING: &str = "VGPU_SM_CEILING";
/// Default of [`ENV_SHARED_CACHE`].
pub const DEFAULT_SHARED_CACHE: &str = "/tmp/cudevshr.cache";
