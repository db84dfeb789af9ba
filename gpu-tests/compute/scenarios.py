"""What the compute bench runs: the workloads, the scenarios (tenants with their SM limits and
priorities), the modes (how a tenant's environment is set), the order of the runs, and their
estimated cost. Pure data and arithmetic: run.py applies it, test_compute_bench.py checks it.
"""
from dataclasses import dataclass, field

# ---- workloads: tenant.py's kind and options; a tenant's alone run is shared by its key --

WORKLOADS = {
    # Training. Small batches leave host gaps between kernels (launch-bound steps); large ones
    # keep the GPU busy. All end each step with loss.item().
    "resnet18-b16": ("train-resnet18", ("--batch", "16")),
    "resnet50-b64": ("train-resnet50", ("--batch", "64")),
    "resnet50-b8": ("train-resnet50", ("--batch", "8")),
    "vit-s-b256": ("train-vit", ("--batch", "256")),
    "vit-s-b16": ("train-vit", ("--batch", "16")),
    "gpt-8x768-b8": ("train-gpt", ("--layers", "8", "--width", "768", "--heads", "12", "--seq", "256",
                                   "--batch", "8")),
    "gpt-12x1024-b16": ("train-gpt", ("--layers", "12", "--width", "1024", "--heads", "16", "--seq", "512",
                                      "--batch", "16")),
    # Services: a request every 10 ms (Poisson, one seed for every mode) of a batch-1 GPT-2
    # forward pass, or batched ResNet-50 inference every 25 ms.
    "svc-gpt-b1": ("infer-gpt", ("--layers", "6", "--width", "512", "--heads", "8", "--seq", "128",
                                 "--batch", "1", "--interval-ms", "10", "--poisson", "--seed", "1")),
    "svc-resnet50-b8": ("infer-resnet", ("--batch", "8", "--interval-ms", "25", "--poisson", "--seed", "2")),
    # Synthetic loops (what the SM limiter was tuned on).
    "matmul-4096": ("matmul", ("--size", "4096")),
    "spin": ("spin", ("--iters", "800")),  # ~50 µs kernels on an H200 (its RESULT says)
    "triton-fma": ("triton", ("--iters", "2000")),
    "graph-2048": ("graph", ("--size", "2048")),
}


@dataclass(frozen=True)
class Tenant:
    workload: str
    sm: int = None  # CUDA_DEVICE_SM_LIMIT (cap, share) or None
    priority: int = None  # CUDA_TASK_PRIORITY in the priority mode (0 high) or None

    @property
    def kind(self):
        return WORKLOADS[self.workload][0]

    @property
    def args(self):
        return WORKLOADS[self.workload][1]

    @property
    def service(self):
        return self.kind.startswith("infer-")

    @property
    def label(self):
        s = self.workload + (f" @{self.sm}" if self.sm is not None else "")
        return s + (f" p{self.priority}" if self.priority is not None else "")


# ---- modes ------------------------------------------------------------------------------

ALONE = "alone"
# alone: each tenant by itself, no hook (the reference of every percentage).
# plain: together, no hook: the GPU time-slices.
# hami: HAMi-core's libvgpu.so, CUDA_DEVICE_SM_LIMIT per tenant, without HAMi's monitor.
# vgpu-cap: vgpu's cap mode; vgpu-share: VGPU_SM_MODE=share; vgpu-prio: share mode with
# CUDA_TASK_PRIORITY; vgpu-nolimit: vgpu's libvgpu.so with no SM limit (what the hook costs
# before the limiter: its launch path is then one relaxed load).
MODES = (ALONE, "plain", "hami", "vgpu-cap", "vgpu-share", "vgpu-prio", "vgpu-nolimit")
HOOKED = {"hami": "hami", "vgpu-cap": "vgpu", "vgpu-share": "vgpu", "vgpu-prio": "vgpu",
          "vgpu-nolimit": "vgpu"}

# Variables of the runner's own environment a tenant never inherits: each mode sets its own.
CLEARED = ("LD_PRELOAD", "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE",
           "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_TASK_PRIORITY", "GPU_CORE_UTILIZATION_POLICY",
           "CUDA_REDIRECT", "VGPU_SM_MODE", "VGPU_TURN_DIR", "VGPU_SM_CEILING", "LIBCUDA_LOG_LEVEL")


@dataclass(frozen=True)
class Libraries:
    vgpu: str = None  # vgpu's libvgpu.so
    hami: str = None  # HAMi-core's libvgpu.so


def tenant_env(base, mode, tenant, libs, cache, turn_dir, log_level=3):
    """The environment of `tenant` in `mode`: `base` (the runner's) less CLEARED, plus the
    mode's variables. `cache` is the tenant's own shared file (one per tenant: each tenant is a
    container), `turn_dir` the unit's fresh turn directory (shared by its tenants). vgpu's
    `log_level`: 3 says the limiter's counters at exit (kept in the JSON), 4 its heaviest
    identities with their samples as well."""
    env = {k: v for k, v in base.items() if k not in CLEARED}
    env["PYTHONUNBUFFERED"] = "1"
    # torch.cuda.is_available() through NVML, not cudaGetDeviceCount: no cuInit (where
    # HAMi-core creates its context) before run.py lets the tenant create its context.
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    env.setdefault("OMP_NUM_THREADS", "2")  # four tenants' CPU-side threads on 16 cores
    if mode in (ALONE, "plain"):
        return env
    if mode not in HOOKED:
        raise ValueError(f"unknown mode {mode!r}")
    lib = libs.hami if HOOKED[mode] == "hami" else libs.vgpu
    if not lib:
        raise ValueError(f"mode {mode} needs its library")
    env["LD_PRELOAD"] = lib
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = cache
    if tenant.sm is not None and mode != "vgpu-nolimit":
        env["CUDA_DEVICE_SM_LIMIT"] = str(tenant.sm)
    if mode == "hami":
        # HAMi-core without its monitor: FORCE makes get_utilization_switch() 1 whatever the
        # file says; recent_kernel keeps the file's initial 2 (only the monitor writes it), so
        # launches never block on it; the watcher refills tokens only once the host pid is
        # found (set_task_pid, at cuInit: run.py creates contexts one at a time for it).
        # CUDA_REDIRECT: HAMi's dlsym hook resolves cu* symbols in this library (by default
        # /usr/local/vgpu/libvgpu.so, where HAMi's device plugin mounts it).
        env["GPU_CORE_UTILIZATION_POLICY"] = "FORCE"
        env["CUDA_REDIRECT"] = lib
        return env
    env["VGPU_TURN_DIR"] = turn_dir
    env["LIBCUDA_LOG_LEVEL"] = str(log_level)
    if mode in ("vgpu-share", "vgpu-prio"):
        env["VGPU_SM_MODE"] = "share"
    if mode == "vgpu-prio" and tenant.priority is not None:
        env["CUDA_TASK_PRIORITY"] = str(tenant.priority)
    return env


# ---- scenarios ----------------------------------------------------------------------------

PAIR_MODES = (ALONE, "plain", "hami", "vgpu-cap", "vgpu-share")
PRIORITY_MODES = (ALONE, "plain", "hami", "vgpu-share", "vgpu-prio")
SOLO_MODES = (ALONE, "hami", "vgpu-cap")
# A cap above the tenant's demand: what the limited launch path costs against the hook alone.
ABOVE_DEMAND_MODES = (ALONE, "vgpu-nolimit", "vgpu-cap")


@dataclass(frozen=True)
class Scenario:
    name: str
    tenants: tuple
    modes: tuple = PAIR_MODES
    about: str = ""

    @property
    def priority(self):
        return "vgpu-prio" in self.modes


SCENARIOS = {s.name: s for s in (
    Scenario("train-resnet18-vit", (Tenant("resnet18-b16", 30), Tenant("vit-s-b256", 70)),
             about="a launch-bound convnet (batch 16) beside a busy vision transformer (batch 256)"),
    Scenario("train-gpt-resnet50", (Tenant("gpt-8x768-b8", 30), Tenant("resnet50-b64", 70)),
             about="a GPT-2 (8x768, batch 8) beside a ResNet-50 (batch 64)"),
    Scenario("prio-gpt-svc-vit", (Tenant("svc-gpt-b1", 50, 0), Tenant("vit-s-b256", 50, 1)),
             PRIORITY_MODES,
             about="a batch-1 GPT-2 service (Poisson, 10 ms mean gap), priority 0, beside a busy "
                   "vision transformer, priority 1"),
    Scenario("matmul-30-70", (Tenant("matmul-4096", 30), Tenant("matmul-4096", 70)),
             about="bf16 4096³ matmul loops"),
    Scenario("train-quartet", (Tenant("resnet18-b16", 10), Tenant("gpt-8x768-b8", 20),
                               Tenant("vit-s-b256", 30), Tenant("resnet50-b64", 40)),
             about="four training loops at 10/20/30/40"),
    # A capped tenant alone: its cap of GPU time with nothing else to blame.
    Scenario("solo-resnet18-20", (Tenant("resnet18-b16", 20),), SOLO_MODES,
             about="a launch-bound convnet capped at 20, alone on the GPU"),
    Scenario("solo-gpt-20", (Tenant("gpt-8x768-b8", 20),), SOLO_MODES,
             about="a GPT-2 training loop capped at 20, alone on the GPU"),
    # What the limited launch path costs a tenant it never holds (caps above its demand), and
    # what the larger tenant of a pair gets when it is not limited at all.
    Scenario("solo-resnet18-95", (Tenant("resnet18-b16", 95),), ABOVE_DEMAND_MODES,
             about="a launch-bound convnet capped at 95 (above its demand), alone"),
    Scenario("solo-gpt-95", (Tenant("gpt-8x768-b8", 95),), ABOVE_DEMAND_MODES,
             about="a GPT-2 training loop capped at 95 (above its demand), alone"),
    Scenario("solo-resnet50-95", (Tenant("resnet50-b64", 95),), ABOVE_DEMAND_MODES,
             about="a ResNet-50 (batch 64) capped at 95 (above its demand), alone"),
    Scenario("solo-resnet50-70", (Tenant("resnet50-b64", 70),), (ALONE, "vgpu-cap"),
             about="a ResNet-50 (batch 64) capped at 70 (about its demand), alone"),
    Scenario("train-gpt-resnet50-free", (Tenant("gpt-8x768-b8", 30), Tenant("resnet50-b64")),
             (ALONE, "vgpu-cap"),
             about="the GPT-2 at 30 beside an unlimited ResNet-50 (vgpu's fast path)"),
    # Beyond the core set.
    Scenario("train-small-batches", (Tenant("resnet50-b8", 30), Tenant("vit-s-b16", 70)),
             about="two launch-bound training loops (batches 8 and 16)"),
    Scenario("train-gpt-large", (Tenant("gpt-12x1024-b16", 30), Tenant("vit-s-b256", 70)),
             about="a larger GPT-2 (12x1024, batch 16, 512 tokens) beside a busy ViT"),
    Scenario("prio-gpt-svc-matmul", (Tenant("svc-gpt-b1", 50, 0), Tenant("matmul-4096", 50, 1)),
             PRIORITY_MODES, about="the batch-1 service beside a matmul loop (a deep queue)"),
    # Best effort with no guarantee (no SM limit: share mode's best effort), the other
    # priority rule (one kernel at a time while the service has work).
    Scenario("prio-gpt-svc-vit-noguarantee", (Tenant("svc-gpt-b1", None, 0), Tenant("vit-s-b256", None, 1)),
             PRIORITY_MODES,
             about="the batch-1 GPT-2 service (priority 0) beside the busy ViT (priority 1), "
                   "neither with an SM limit: best effort without a guarantee"),
    Scenario("prio-resnet-svc-gpt", (Tenant("svc-resnet50-b8", 50, 0), Tenant("gpt-8x768-b8", 50, 1)),
             PRIORITY_MODES, about="a batched ResNet-50 service beside GPT-2 training"),
    Scenario("spin-30-70", (Tenant("spin", 30), Tenant("spin", 70)), about="spin.cu's kernel"),
    Scenario("triton-30-70", (Tenant("triton-fma", 30), Tenant("triton-fma", 70)), about="a Triton kernel loop"),
    Scenario("graph-30-70", (Tenant("graph-2048", 30), Tenant("graph-2048", 70)), about="CUDA graph replays"),
    Scenario("synthetic-quartet", (Tenant("spin", 10), Tenant("matmul-4096", 20),
                                   Tenant("triton-fma", 30), Tenant("graph-2048", 40)),
             about="spin, matmul, Triton and graph loops at 10/20/30/40"),
)}

CORE = ("train-resnet18-vit", "train-gpt-resnet50", "prio-gpt-svc-vit", "matmul-30-70", "train-quartet")


def select(names):
    """Scenarios by comma-separated names; `core` and `all` name sets. Unknown names are an
    error, listing the known ones."""
    out = []
    for n in [x.strip() for x in names.split(",") if x.strip()]:
        group = CORE if n == "core" else tuple(SCENARIOS) if n == "all" else (n,)
        for g in group:
            if g not in SCENARIOS:
                raise ValueError(f"unknown scenario {g!r}; known: core, all, {', '.join(SCENARIOS)}")
            if SCENARIOS[g] not in out:
                out.append(SCENARIOS[g])
    if not out:
        raise ValueError("no scenario named")
    return out


# ---- the order of the runs ----------------------------------------------------------------

@dataclass
class Unit:
    """One start of processes: a scenario in one mode, or one workload alone."""

    round: int
    mode: str
    tenants: tuple
    scenario: str = None  # None: an alone run
    est_s: float = 0.0
    name: str = field(default="")

    def __post_init__(self):
        if not self.name:
            what = self.scenario if self.scenario else self.tenants[0].workload
            self.name = f"r{self.round} {what} {self.mode}"


def rotated(modes, k):
    if not modes:
        return ()
    k %= len(modes)
    return tuple(modes[k:]) + tuple(modes[:k])


def mode_order(modes, k):
    """The modes of one scenario in one round: the hooked and plain ones rotated by `k`, the
    alone runs at position k mod (their count + 1), so that from round to round each mode
    follows another one and the alone runs move through the round."""
    others = rotated([m for m in modes if m != ALONE], k) if len(modes) > 1 else ()
    if ALONE not in modes:
        return tuple(others)
    at = k % (len(others) + 1)
    return tuple(others[:at]) + (ALONE,) + tuple(others[at:])


def plan_units(scenarios, rounds, seconds, modes_allowed=MODES, first_round=1):
    """The runs in order: round by round, each scenario in turn, its modes in mode_order by
    the round and the scenario's position (so no mode always runs first or after the same
    one). A workload runs alone once per round, where the first scenario containing it
    reaches `alone`; later scenarios of the round share that run."""
    units = []
    for r in range(first_round, first_round + rounds):
        alone_done = set()
        for j, s in enumerate(scenarios):
            modes = [m for m in s.modes if m in modes_allowed]
            for mode in mode_order(modes, r - 1 + j):
                if mode == ALONE:
                    for t in s.tenants:
                        if t.workload not in alone_done:
                            alone_done.add(t.workload)
                            alone = Tenant(t.workload)
                            units.append(Unit(r, ALONE, (alone,), est_s=unit_cost((alone,), seconds)))
                else:
                    units.append(Unit(r, mode, s.tenants, s.name, est_s=unit_cost(s.tenants, seconds)))
    return units


# ---- cost ---------------------------------------------------------------------------------
# Seconds, estimated (run.py scales them by what the units so far took). The next unit's
# processes start while the current one runs and wait before creating their CUDA context,
# so a unit's imports are hidden behind the previous unit; only the first pays IMPORT_S.

IMPORT_S = {"train-resnet18": 5, "train-resnet50": 5, "train-vit": 7, "train-gpt": 8,
            "infer-gpt": 8, "infer-resnet": 5, "matmul": 4, "triton": 5, "graph": 4,
            "spin": 3, "fake": 0.2}
# Model to the GPU, the warm-up steps (cuBLAS/cuDNN start-up, lazy module loading, Triton's
# compile), overlapping the contexts created after this tenant's.
WARM_S = {"train-resnet18": 2, "train-resnet50": 2, "train-vit": 2, "train-gpt": 2,
          "infer-gpt": 1.5, "infer-resnet": 1.5, "matmul": 1, "triton": 3, "graph": 1.5,
          "spin": 1.5, "fake": 0.2}
CTX_S = 0.6  # one tenant's CUDA context, created one at a time
START_MARGIN_S = 0.3  # from the last tenant warm to the window's start
EXIT_S = 1.0  # the slowest tenant's end after the window


def unit_cost(tenants, seconds):
    kinds = [t.kind for t in tenants]
    return (CTX_S * len(tenants) + max(WARM_S.get(k, 3) for k in kinds) + START_MARGIN_S
            + seconds + EXIT_S)


def first_import_s(units):
    return max((IMPORT_S.get(t.kind, 8) for t in units[0].tenants), default=0) if units else 0


def plan_cost(units):
    return first_import_s(units) + sum(u.est_s for u in units)


def fit(scenarios, rounds, min_rounds, seconds, budget_s, modes_allowed=MODES, first_round=1):
    """What fits in `budget_s`: all scenarios with as many rounds as fit (from `rounds` down to
    `min_rounds`), else the longest leading run of scenarios at `min_rounds` that fits.
    Returns (units, kept scenarios, rounds, [what was left out and why])."""
    skipped = []
    for r in range(rounds, min_rounds - 1, -1):
        units = plan_units(scenarios, r, seconds, modes_allowed, first_round)
        if plan_cost(units) <= budget_s:
            break
    else:
        r = min_rounds
    if r < rounds:
        which = f"round {rounds}" if r + 1 == rounds else f"rounds {r + 1}-{rounds}"
        need = plan_cost(plan_units(scenarios, rounds, seconds, modes_allowed, first_round))
        skipped.append(f"{which}: all scenarios with {rounds} rounds need ~{need:.0f} s of the "
                       f"{budget_s:.0f} s budget")
    kept = list(scenarios)
    while kept:
        units = plan_units(kept, r, seconds, modes_allowed, first_round)
        if plan_cost(units) <= budget_s:
            break
        dropped = kept.pop()
        skipped.append(f"scenario {dropped.name}: does not fit the {budget_s:.0f} s budget "
                       f"with {r} round(s)")
        units = []
    return units, kept, r, skipped
