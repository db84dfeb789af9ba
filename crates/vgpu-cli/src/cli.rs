//! The command line: every subcommand and flag, as clap derive types.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};

use crate::limits::{MemoryFlag, SmFlag};
use crate::units::parse_interval;
use crate::usage_file;

/// Where the kubelet keeps per-pod log directories (`vgpu exporter --pod-logs`).
pub const DEFAULT_POD_LOGS: &str = "/var/log/pods";

/// HAMi's DRA driver's checkpoint (its kubelet plugin directory, `hami-core-gpu.project-hami.io`;
/// `vgpu exporter --dra-checkpoint`).
pub const DEFAULT_DRA_CHECKPOINT: &str =
    "/var/lib/kubelet/plugins/hami-core-gpu.project-hami.io/checkpoint.json";

/// Share a GPU: run programs under memory and compute limits, see and change usage.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu",
    version,
    about = "Run CUDA programs under per-device memory and compute (SM) limits, and see what they use.",
    long_about = "Run CUDA programs under per-device memory and compute (SM) limits, and see what they use.\n\n\
vgpu preloads libvgpu.so (a drop-in replacement for HAMi-core) into unmodified programs. All \
processes that share one usage file share one limit per device; `vgpu run` gives each job its own \
file unless --share NAME or --cache PATH joins a group.\n\n\
Sizes: 4g, 4096m, 512Mi, 1.5GiB or a byte count (binary units). 0 = unlimited.",
    after_help = "Start with `vgpu demo` to see a limit enforced, `vgpu doctor` to check this machine."
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a program under limits (sets the environment, preloads libvgpu.so, execs).
    Run(RunArgs),
    /// Show devices, limits, usage and processes of a usage file (like nvidia-smi).
    Status(StatusArgs),
    /// Show `status` repeatedly, refreshing the terminal.
    Watch(WatchArgs),
    /// Change the memory or SM limit in a live usage file.
    SetLimit(SetLimitArgs),
    /// Ask the processes of a usage file to swap their movable GPU memory out to host memory.
    SwapOut(SwapOutArgs),
    /// Serve Prometheus metrics of one or many usage files over HTTP.
    Exporter(ExporterArgs),
    /// Check that limits are really enforced here, and say what is wrong.
    Doctor(DoctorArgs),
    /// Show a CUDA workload refused past its memory limit (simulated driver without a GPU).
    Demo(DemoArgs),
    /// A tiny CUDA program driven by commands (init, alloc, free, ...), to try limits.
    ///
    /// It reaches the driver the way most CUDA programs do (dlopen of libcuda.so.1), so under
    /// `vgpu run` (or with the hook preloaded) it is limited like any program; `demo`,
    /// `doctor` and the tests use it. Commands come one per line on stdin, or separated by `;`
    /// in --script. Each gets one reply line: `ok <command> key=value...` or
    /// `err <command> ... msg=...`. Every command runs, even after one failed; the exit code is
    /// 0 when all succeeded, 1 when any failed (a refused allocation included).
    Workload(WorkloadArgs),
    /// Internal: removes the private directory of a `vgpu run` job when the job ends.
    #[command(hide = true)]
    JobCleanup(JobCleanupArgs),
}

/// `vgpu run`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  vgpu run --memory 4g -- python train.py\n  \
vgpu run --memory 8g --sm 50 --share team-a -- ./app --flag\n  \
vgpu run --driver simulated --memory 1g -- ./app      (no GPU needed)\n\n\
Usage table: each job gets its own private table unless --share NAME (or --cache PATH, or an \
inherited CUDA_DEVICE_MEMORY_SHARED_CACHE) joins a group. Joining a group whose live processes \
run under other limits is refused; a group nobody uses any more takes the new limits.\n\
Flags replace inherited variables of the same kind: any --memory clears inherited \
CUDA_DEVICE_MEMORY_LIMIT*, any --sm clears inherited CUDA_DEVICE_SM_LIMIT*."
)]
pub struct RunArgs {
    /// Memory limit: SIZE for every device, or DEVICE=SIZE for one (repeatable).
    #[arg(long = "memory", short = 'm', value_name = "[DEVICE=]SIZE", value_parser = MemoryFlag::parse)]
    pub memory: Vec<MemoryFlag>,
    /// SM (compute) limit in percent: PERCENT or DEVICE=PERCENT (repeatable; 0 or 100 = unlimited).
    #[arg(long = "sm", value_name = "[DEVICE=]PERCENT", value_parser = SmFlag::parse)]
    pub sm: Vec<SmFlag>,
    /// Join the group NAME: jobs run with the same NAME (by this user) share one usage table
    /// and one limit per device. Default: a private table for this job alone.
    #[arg(long, value_name = "NAME", conflicts_with = "cache", value_parser = usage_file::parse_share_name)]
    pub share: Option<String>,
    /// Usage file shared by all processes under one limit (CUDA_DEVICE_MEMORY_SHARED_CACHE).
    #[arg(long, value_name = "PATH")]
    pub cache: Option<PathBuf>,
    /// Create a missing --cache file writable by every user (mode 0666, as HAMi does), so
    /// other users' jobs can join it. Without it a new file is private to you (0600).
    #[arg(long, requires = "cache")]
    pub all_users: bool,
    /// Which CUDA driver the program gets: real, or simulated (libvgpusim.so, no GPU needed).
    #[arg(long, value_enum, default_value_t = RunDriver::Real)]
    pub driver: RunDriver,
    /// libvgpu.so to preload (default: $VGPU_LIB, next to vgpu, ../lib, /usr/local/vgpu).
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
    /// Print the environment and command instead of running it.
    #[arg(long)]
    pub dry_run: bool,
    /// The program and its arguments (after `--`, or from the first word that is not one of
    /// these flags: everything from there on is the program's). A flag before it that is not
    /// one of these is bad usage, not a program name.
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Which usage file a command reads: `--cache PATH` or `--share NAME` (the group's table).
#[derive(Debug, Args, Clone)]
pub struct UsageFileArgs {
    /// Usage file (default: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/cudevshr.cache).
    #[arg(long, value_name = "PATH")]
    pub cache: Option<PathBuf>,
    /// The usage table of the group NAME that `vgpu run --share NAME` jobs use.
    #[arg(long, value_name = "NAME", conflicts_with = "cache", value_parser = usage_file::parse_share_name)]
    pub share: Option<String>,
}

impl UsageFileArgs {
    /// The usage file these flags name: `--share NAME`'s group table, else `--cache`, else
    /// [`usage_file::default_cache_path`].
    pub fn path(&self) -> PathBuf {
        match (&self.share, &self.cache) {
            (Some(name), _) => usage_file::share_path(name),
            (None, Some(p)) => p.clone(),
            (None, None) => usage_file::default_cache_path(),
        }
    }
}

/// `vgpu status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub file: UsageFileArgs,
    /// Print JSON (schema `vgpu.status.v1`, see docs/cli.md).
    #[arg(long)]
    pub json: bool,
}

/// `vgpu watch`.
#[derive(Debug, Args)]
pub struct WatchArgs {
    #[command(flatten)]
    pub file: UsageFileArgs,
    /// Time between refreshes: 1s, 500ms, 2m, or seconds.
    #[arg(long, short = 'n', default_value = "1s", value_name = "DURATION", value_parser = parse_interval)]
    pub interval: std::time::Duration,
    /// Stop after N refreshes (default: until Ctrl-C on a terminal, 1 when stdout is not a terminal).
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
    /// Print one JSON object per refresh, one per line (NDJSON, schema `vgpu.watch.v1`).
    #[arg(long)]
    pub json: bool,
}

/// `vgpu set-limit`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("limit").required(true).multiple(true).args(["memory", "sm", "priority"])))]
#[command(
    after_help = "Examples:\n  vgpu set-limit --memory 8g\n  vgpu set-limit --device 1 --sm 40\n  \
vgpu set-limit --priority 0\n\n\
Running processes enforce the new value from their next allocation (SM limit and priority: \
from their next launch)."
)]
pub struct SetLimitArgs {
    /// Device index (default: every device in the file).
    #[arg(long, short = 'd', value_name = "N", value_parser = clap::value_parser!(u32).range(0..16))]
    pub device: Option<u32>,
    /// New memory limit (0 = unlimited).
    #[arg(long, short = 'm', value_name = "SIZE", value_parser = crate::limits::parse_memory_value)]
    pub memory: Option<u64>,
    /// New SM limit in percent (0 or 100 = unlimited; in share mode the guarantee).
    #[arg(long, value_name = "PERCENT", value_parser = crate::limits::parse_sm_value)]
    pub sm: Option<u8>,
    /// New `CUDA_TASK_PRIORITY` of the whole file (0 = high, 1 = low; honoured by share
    /// mode, `VGPU_SM_MODE=share`).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub priority: Option<i32>,
    #[command(flatten)]
    pub file: UsageFileArgs,
    /// Print the changes as JSON (schema `vgpu.set-limit.v1`).
    #[arg(long)]
    pub json: bool,
}

/// `vgpu swap-out`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  vgpu swap-out --share team-a\n  vgpu swap-out --cache /tmp/job.cache --json\n\n\
Only processes started with VGPU_IDLE_SWAP (a duration, or manual) act on the request; each \
swaps out what can move (docs/swap.md) when no call of its own is running, and brings it back \
on its next call that can touch GPU memory. `vgpu status` shows a swapped-out process as swapped."
)]
pub struct SwapOutArgs {
    #[command(flatten)]
    pub file: UsageFileArgs,
    /// Print the request as JSON (schema `vgpu.swap-out.v1`).
    #[arg(long)]
    pub json: bool,
}

/// `vgpu exporter`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  vgpu exporter --listen 0.0.0.0:9395 --cache '/usr/local/vgpu/containers/*/*.cache'   (HAMi)\n  \
vgpu exporter --listen 0.0.0.0:9395 --cache '/usr/local/vgpu/vgpu/containers/*/*.cache'   (Volcano)\n\n\
GLOB supports * ? [abc] and ** (the glob crate); files whose name contains libvgpu.so are skipped. \
Files under .../containers/<pod UID>_<container>/ get HAMi's families (hami_*) with namespace, \
pod and container labels; namespace and pod name come from the kubelet's /var/log/pods/<ns>_<pod>_<uid> \
directories, else pod is the pod UID and namespace is empty. Default port 9395: HAMi's monitor \
uses 9394, dcgm-exporter 9400."
)]
pub struct ExporterArgs {
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:9395", value_name = "ADDR")]
    pub listen: String,
    /// Usage file or glob of usage files (default: $CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/cudevshr.cache).
    #[arg(long, value_name = "GLOB")]
    pub cache: Option<String>,
    /// The kubelet's pod log directory, read for pod namespaces and names.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_POD_LOGS)]
    pub pod_logs: PathBuf,
    /// HAMi's DRA driver's checkpoint, read for the pod of each claim directory.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_DRA_CHECKPOINT)]
    pub dra_checkpoint: PathBuf,
    /// Also serve HAMi's pre-2.6 metric names (vGPU_device_memory_usage_in_bytes, ...), as HAMi's
    /// monitor does with the same flag.
    #[arg(long)]
    pub legacy_metrics: bool,
    /// Do not serve HAMi's hami_* families (when HAMi's own monitor serves them on this node).
    #[arg(long)]
    pub no_hami_metrics: bool,
    /// Serve one series per process (vgpu_process_*; many series on a busy node).
    #[arg(long)]
    pub per_process: bool,
}

/// `vgpu doctor`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// libvgpu.so to check (default: as `vgpu run` finds it).
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
    #[command(flatten)]
    pub file: UsageFileArgs,
    /// Skip the probe program (only inspect files and the environment).
    #[arg(long)]
    pub no_probe: bool,
    /// Check against the real driver, or the simulated one (as `vgpu run --driver simulated`).
    #[arg(long, value_enum, default_value_t = RunDriver::Real)]
    pub driver: RunDriver,
    /// Print the checks as JSON (schema `vgpu.doctor.v1`) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `vgpu demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Memory limit for the workload (default: 1g simulated, 2g on a real GPU).
    #[arg(long, value_name = "SIZE", value_parser = crate::limits::parse_nonzero_memory_value)]
    pub memory: Option<u64>,
    /// Size of each allocation the workload makes.
    #[arg(long, default_value = "256m", value_name = "SIZE", value_parser = crate::limits::parse_nonzero_memory_value)]
    pub step: u64,
    /// Which driver: auto (real GPU if present, else simulated), real, or simulated.
    #[arg(long, value_enum, default_value_t = DriverChoice::Auto)]
    pub driver: DriverChoice,
    /// libvgpu.so to use (default: as `vgpu run` finds it).
    #[arg(long, value_name = "PATH")]
    pub lib: Option<PathBuf>,
}

/// Which CUDA driver `vgpu demo` runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DriverChoice {
    /// The real driver when one with a device is present, else the simulated one.
    Auto,
    /// The real driver (fails without a GPU).
    Real,
    /// The simulated driver (libvgpusim.so next to the vgpu binary).
    Simulated,
}

/// Which CUDA driver `vgpu run` gives the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RunDriver {
    /// The system's libcuda.so.1 (what the program would load anyway).
    Real,
    /// The simulated driver (libvgpusim.so next to the vgpu binary, or $VGPU_SIM_LIB),
    /// served as libcuda.so.1 and libnvidia-ml.so.1: no GPU needed.
    Simulated,
}

/// `vgpu job-cleanup` (hidden): removes a job's private directory once the job has ended.
#[derive(Debug, Args)]
pub struct JobCleanupArgs {
    /// The job's process (the pid `vgpu run` execs into).
    #[arg(long)]
    pub pid: i32,
    /// The private directory to remove.
    #[arg(long)]
    pub dir: PathBuf,
    /// Internal: the first stage starts the second detached and exits at once.
    #[arg(long)]
    pub stage: u8,
}

/// `vgpu workload`.
#[derive(Debug, Args)]
#[command(after_help = "Commands:\n  \
init         cuInit, the device (--device) and its primary context\n  \
count        the number of devices\n  \
total        the device's total memory (the limit, under the hook)\n  \
info         free and total memory of the current context (cuMemGetInfo)\n  \
alloc SIZE   allocate SIZE (4g, 512m, bytes); the reply gives its ID\n  \
free ID      free the allocation ID\n  \
sleep MS     wait MS milliseconds (holding what is allocated)\n  \
pid          this process's pid\n  \
quit         stop here (allocations are left for process exit to release)\n\n\
Examples:\n  \
vgpu run --driver simulated --memory 1g -- vgpu workload --script 'init;total;alloc 768m;alloc 512m'\n  \
vgpu run --memory 4g -- vgpu workload --script 'init;alloc 1g;sleep 30000'")]
pub struct WorkloadArgs {
    /// Device ordinal to use.
    #[arg(long, default_value_t = 0)]
    pub device: i32,
    /// Run these commands (separated by `;`) instead of reading stdin.
    #[arg(long, value_name = "COMMANDS")]
    pub script: Option<String>,
}
