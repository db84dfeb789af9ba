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
/// Directory of the node-wide turn boards (SM limit: how containers on one GPU see each
/// other's claims); `off`: no board.
pub const ENV_TURN_DIR: &str = "VGPU_TURN_DIR";
/// Default of [`ENV_TURN_DIR`]: the host directory HAMi's device plugin mounts into every
/// container.
pub const DEFAULT_TURN_DIR: &str = "/tmp/vgpulock";
/// Tuning variables of earlier versions' SM limiter. The limiter has no tuning knobs now
/// (docs/sm-limit.md): each of these, when set, draws one warning and has no effect.
pub const RETIRED_SM_VARIABLES: [&str; 8] = [
    "VGPU_SM_CONTENTION",
    "VGPU_TURN_CYCLE_MS",
    "VGPU_TURN_LEAD_US",
    "VGPU_SHARE_GRACE_US",
    "VGPU_SHARE_OUTRANKED_QUEUE_US",
    "VGPU_SHARE_GAP_FILL_US",
    "VGPU_WAKE_SLACK_US",
    "VGPU_SM_POWER_EXPONENT",
];
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
/// Swapping an idle process's movable device memory out to host memory (docs/swap.md):
/// `<duration>` (`30s`, `500ms`, `5m`: swap out after that long with no work queued and no
/// call that can touch device memory; `vgpu swap-out` is honoured too), `manual` (only on
/// `vgpu swap-out`) or `off` (the default: no swapping, and the gate costs one load).
pub const ENV_IDLE_SWAP: &str = "VGPU_IDLE_SWAP";
/// How long a call waits for device room that swapping makes: a swap-in before the call that
/// needed it fails with out-of-memory, and an allocation of priority 0 while a less urgent
/// container swaps out for it (a duration; default [`DEFAULT_SWAP_IN_WAIT_MS`] ms).
pub const ENV_SWAP_IN_WAIT: &str = "VGPU_SWAP_IN_WAIT";
/// With swapping on: make the program's `cuMemAlloc` allocations of 2 MiB and more VMM
/// allocations of the hook's, which can be swapped out (`1`; default `0`). Such memory has no
/// `cuIpcGetMemHandle` (refused, naming this variable).
pub const ENV_SWAP_MOVABLE: &str = "VGPU_SWAP_MOVABLE";
/// With swapping on: keep the host memory a swap-in emptied for the next swap-out (`1`, the
/// default) or give it back (`0`). Pinning fresh host memory is what makes a swap-out slow
/// (docs/swap.md); a kept copy makes every swap-out after the first a copy at link speed.
pub const ENV_SWAP_KEEP_HOST: &str = "VGPU_SWAP_KEEP_HOST";
/// Default of [`ENV_SWAP_IN_WAIT`], milliseconds.
pub const DEFAULT_SWAP_IN_WAIT_MS: u64 = 10_000;
/// How `CUDA_DEVICE_SM_LIMIT` is read: `cap` (HAMi's meaning, the default) or `share`
/// (a guaranteed share that borrows idle time, with `CUDA_TASK_PRIORITY` ordering who
/// borrows first; docs/sm-limit.md).
pub const ENV_SM_MODE: &str = "VGPU_SM_MODE";
/// Share mode: the most a container may use, percent (1..=100, default 100).
pub const ENV_SM_CEILING: &str = "VGPU_SM_CEILING";
/// Default of [`ENV_SHARED_CACHE`].
pub const DEFAULT_SHARED_CACHE: &str = "/tmp/cudevshr.cache";
