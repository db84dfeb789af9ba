"""Acceptance of libvgpu.so on two real GPUs (issue 7; run through gpu-tests/run.sh).

Skips unless at least two NVIDIA GPUs are visible. Every test runs real programs under
LD_PRELOAD=libvgpu.so with a fresh shared file, as test_acceptance.py does (its helpers).
"""
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from test_acceptance import GIB, LIB, MIB, PROBE, SCRATCH, Container, record, slot_usage, wait_line


def _gpus():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split(", ")[1].strip() for line in out.strip().splitlines() if ", " in line]


UUIDS = _gpus()
pytestmark = pytest.mark.skipif(
    not (len(UUIDS) >= 2 and os.path.isfile(LIB) and os.path.isfile(PROBE)),
    reason="needs two NVIDIA GPUs, VGPU_LIB and VGPU_PROBE (run gpu-tests/run.sh on a two-GPU machine)",
)


def _has_torch():
    try:
        import torch  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        return False


torch_only = pytest.mark.skipif(not _has_torch(), reason="PyTorch not installed")


def compute_apps():
    """pid -> (gpu uuid, MiB) as nvidia-smi lists compute processes (outside the hook)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    apps = {}
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            apps.setdefault(int(parts[0]), []).append((parts[1], int(parts[2]) if parts[2].isdigit() else -1))
    return apps


def python(container, code, timeout=300, name=None):
    return container.run([sys.executable, "-c", textwrap.dedent(code)], timeout=timeout, name=name)


def test_each_devices_limit_is_enforced_on_its_own_device():
    c = Container(None, CUDA_DEVICE_MEMORY_LIMIT_0="3g", CUDA_DEVICE_MEMORY_LIMIT_1="5g")
    # 1 GiB on device 0 and 2 GiB on device 1 fit; 2.5 GiB and 5 GiB do not.
    ok = c.probe("devices", GIB)
    assert ok["count"] == "2", ok
    assert int(ok["dev0_total_mem"]) == 3 * GIB and int(ok["dev1_total_mem"]) == 5 * GIB, ok
    assert ok["dev0_alloc"] == "0" and ok["dev1_alloc"] == "0", ok
    assert int(ok["nvml0_total"]) == 3 * GIB and int(ok["nvml1_total"]) == 5 * GIB, ok
    assert int(ok["nvml1_used"]) > int(ok["nvml0_used"]) + GIB // 2, "device 1 holds 1 GiB more"
    over = c.probe("devices", 5 * GIB // 2)
    assert over["dev0_alloc"] == "2" and over["dev1_alloc"] == "2", over
    # Each device's limit alone: 2.5 GiB fits device 1's 5 GiB, not device 0's 3 GiB.
    d1 = Container(None, CUDA_DEVICE_MEMORY_LIMIT_0="3g", CUDA_DEVICE_MEMORY_LIMIT_1="8g").probe("devices", 5 * GIB // 2)
    assert d1["dev0_alloc"] == "2" and d1["dev1_alloc"] == "0", d1


@pytest.mark.parametrize("how", ["index", "uuid"])
def test_second_gpu_made_visible_alone_is_accounted_on_the_right_physical_device(how):
    # `_<i>` names the container's GPU i (NVML's), whatever CUDA_VISIBLE_DEVICES says: a
    # process that sees only GPU 1 gets `_1`'s limit on its device 0, and the file (which
    # it makes) lists both GPUs.
    visible = "1" if how == "index" else UUIDS[1]
    c = Container(None, CUDA_VISIBLE_DEVICES=visible, CUDA_DEVICE_MEMORY_LIMIT_0="5g",
                  CUDA_DEVICE_MEMORY_LIMIT_1="3g")
    d = c.probe("devices", 256 * MIB)
    assert d["count"] == "1" and int(d["dev0_total_mem"]) == 3 * GIB, d
    # NVML numbers devices physically whatever CUDA_VISIBLE_DEVICES says: the limit and the
    # usage show on physical GPU 1; GPU 0 shows its own limit.
    assert int(d["nvml1_total"]) == 3 * GIB and int(d["nvml1_used"]) == int(d["dev0_used"]), d
    assert int(d["nvml0_total"]) == 5 * GIB, d
    # Hold 1 GiB and look from outside: the process is on physical GPU 1, and the shared
    # file charges it to its device 1 (GPU 1's index in the file).
    p = c.spawn([PROBE, "hold", str(GIB)])
    try:
        assert wait_line(p, "hold=") == "hold=0"
        apps = compute_apps().get(p.pid, [])
        usage = slot_usage(c.cache, p.pid, dev=1)
        record(f"visible {how}", f"CUDA_VISIBLE_DEVICES={visible}: nvidia-smi {apps}, file {usage}")
        assert [u for u, _ in apps] == [UUIDS[1]], f"not on GPU 1 only: {apps}"
        assert usage is not None and usage[1] >= GIB, usage
        mib_nvml = apps[0][1]
        assert abs(usage[2] - mib_nvml * MIB) <= 128 * MIB, f"file {usage[2]} vs NVML {mib_nvml} MiB"
        assert file_uuids(c.cache) == UUIDS[:2], file_uuids(c.cache)
    finally:
        p.communicate("go\n", timeout=120)


def file_uuids(cache):
    """The first two GPUs the shared file lists (HAMi layout 1.2: `uuids[16][96]` at 64)."""
    with open(cache, "rb") as f:
        b = f.read(64 + 96 * 16)
    return [b[64 + 96 * i:64 + 96 * (i + 1)].split(b"\0")[0].decode() for i in range(2)]


def test_a_first_worker_given_one_gpu_lists_the_containers_gpus():
    # A Ray-style launcher: nothing in the container saw both GPUs before its workers, each
    # given one. The first, on GPU 1, makes the file: both GPUs are listed, each under its
    # own `_<i>`, and the worker on GPU 0 is charged there, not refused.
    env = dict(CUDA_DEVICE_MEMORY_LIMIT_0="3g", CUDA_DEVICE_MEMORY_LIMIT_1="5g")
    first = Container(None, CUDA_VISIBLE_DEVICES="1", **env)
    assert int(first.probe("info")["dev0_total_mem"]) == 5 * GIB
    assert file_uuids(first.cache) == UUIDS[:2], file_uuids(first.cache)
    second = Container(None, CUDA_VISIBLE_DEVICES="0", **env)
    second.cache = first.cache
    assert second.probe("try", GIB)["alloc"] == "0"
    assert int(second.probe("info")["dev0_total_mem"]) == 3 * GIB
    assert second.probe("try", 4 * GIB)["alloc"] == "2", "GPU 0's limit is 3 GiB"


def test_processes_seeing_different_gpus_are_charged_on_their_own_gpu():
    # Issue 12 defect 2: one container (one file) whose processes set CUDA_VISIBLE_DEVICES per
    # rank (Ray, MPI launchers). The container's own view (both GPUs) makes the file; each
    # rank's device 0 must be charged, limited and shown as the GPU it really is.
    c = Container(None, CUDA_DEVICE_MEMORY_LIMIT_0="3g", CUDA_DEVICE_MEMORY_LIMIT_1="5g")
    assert c.probe("try", MIB)["alloc"] == "0"
    ranks = []
    for gpu, size in ((0, GIB), (1, 2 * GIB)):
        r = Container(None, CUDA_DEVICE_MEMORY_LIMIT_0="3g", CUDA_DEVICE_MEMORY_LIMIT_1="5g",
                      CUDA_VISIBLE_DEVICES=str(gpu))
        r.cache = c.cache
        ranks.append((gpu, size, r, r.spawn([PROBE, "hold", str(size)])))
    try:
        for gpu, size, r, p in ranks:
            assert wait_line(p, "hold=") == "hold=0", f"rank on GPU {gpu}"
        uuids = file_uuids(c.cache)
        assert uuids == UUIDS[:2], f"file uuids {uuids} vs NVML {UUIDS[:2]}"
        apps = compute_apps()
        for gpu, size, r, p in ranks:
            usage = slot_usage(c.cache, p.pid, dev=gpu)
            other = slot_usage(c.cache, p.pid, dev=1 - gpu)
            record(f"rank on GPU {gpu}", f"file dev{gpu} {usage}, dev{1 - gpu} {other}, nvidia-smi {apps.get(p.pid)}")
            assert usage is not None and usage[1] >= size, f"GPU {gpu}: {usage}"
            assert other is not None and other[2] == 0, f"charged on the other GPU: {other}"
            assert [u for u, _ in apps.get(p.pid, [])] == [UUIDS[gpu]], apps.get(p.pid)
        # Each rank's device 0 has its own GPU's limit, and sees that GPU's usage.
        for gpu, limit, held in ((0, 3 * GIB, GIB), (1, 5 * GIB, 2 * GIB)):
            r = Container(None, CUDA_DEVICE_MEMORY_LIMIT_0="3g", CUDA_DEVICE_MEMORY_LIMIT_1="5g",
                          CUDA_VISIBLE_DEVICES=str(gpu))
            r.cache = c.cache
            d = r.probe("info")
            assert int(d["dev0_total_mem"]) == limit, d
            assert int(d["dev0_free"]) <= limit - held, d
        both = c.probe("info")
        assert int(both["nvml0_used"]) >= GIB and int(both["nvml1_used"]) >= 2 * GIB, both
    finally:
        for _, _, _, p in ranks:
            p.communicate("go\n", timeout=120)


@torch_only
def test_torch_job_on_both_gpus_sees_and_respects_each_limit():
    c = Container(None, CUDA_DEVICE_MEMORY_LIMIT_0="4g", CUDA_DEVICE_MEMORY_LIMIT_1="6g")
    d = python(c, """
        import torch
        assert torch.cuda.device_count() == 2
        for i in range(2):
            free, total = torch.cuda.mem_get_info(i)
            print(f"total{i}={total}")
        a = torch.ones(1 << 28, device="cuda:0")   # 1 GiB
        b = torch.ones(1 << 29, device="cuda:1")   # 2 GiB
        c = (a.sum() + b.to("cuda:0").sum()).item()
        print(f"sum={int(c)}")
        for i, gib in ((0, 4), (1, 6)):
            try:
                x = torch.empty(gib << 30, dtype=torch.uint8, device=f"cuda:{i}")
                print(f"oom{i}=0")
            except torch.OutOfMemoryError:
                print(f"oom{i}=1")
    """, name="torch two gpus")
    assert int(d["total0"]) == 4 * GIB and int(d["total1"]) == 6 * GIB, d
    assert d["sum"] == str((1 << 28) + (1 << 29)), d
    assert d["oom0"] == "1" and d["oom1"] == "1", d


NCCL_RANK = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
x = torch.full((64 << 20,), float(rank + 1), device="cuda")  # 256 MiB of float32
dist.all_reduce(x)
torch.cuda.synchronize()
ok = bool((x == 3.0).all().item())
print(f"ok={int(ok)}", flush=True)
print(f"reserved={torch.cuda.memory_reserved()}", flush=True)
print(f"pid={os.getpid()}", flush=True)
print("ready=1", flush=True)
sys.stdin.readline()
dist.destroy_process_group()
"""


@torch_only
def test_nccl_all_reduce_across_the_two_gpus_is_counted():
    # One container, one process per GPU; VGPU_RECONCILE_MS=off so that what the file charges
    # is what the hook intercepted (NCCL's cuMemCreate buffers included), not NVML's figure.
    c = Container(None, CUDA_DEVICE_MEMORY_LIMIT="16g", NCCL_NVLS_ENABLE="0", VGPU_RECONCILE_MS="off")
    store = tempfile.mktemp(prefix="nccl-", dir=SCRATCH)
    script = os.path.join(SCRATCH, "nccl_rank.py")
    with open(script, "w") as f:
        f.write(NCCL_RANK)
    procs = [c.spawn([sys.executable, script, str(r), store]) for r in range(2)]
    try:
        lines = [{}, {}]
        for r, p in enumerate(procs):
            while True:
                line = wait_line(p, "", timeout=240)
                k, _, v = line.partition("=")
                lines[r][k] = v
                if k == "ready":
                    break
        time.sleep(0.2)
        apps = compute_apps()
        rows = []
        for r, p in enumerate(procs):
            d = lines[r]
            assert d.get("ok") == "1", (r, d)
            usage = slot_usage(c.cache, p.pid, dev=r)
            rows.append((r, p.pid, usage, int(d["reserved"]), apps.get(p.pid)))
            assert usage is not None, f"rank {r} not in the file on device {r}"
            # Accounted data beyond PyTorch's own caching allocator: NCCL's buffers.
            assert usage[1] > int(d["reserved"]) + MIB, (r, usage, d)
            assert [u for u, _ in apps.get(p.pid, [])] == [UUIDS[r]], (r, apps.get(p.pid))
        record("nccl all-reduce", "\n".join(
            f"rank {r} pid {pid}: file (context, data, total) {u}, torch reserved {res}, nvidia-smi {a}"
            for r, pid, u, res, a in rows))
    finally:
        for p in procs:
            try:
                p.communicate("go\n", timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()


MATMUL = """
import os, sys, time, torch
dev, secs = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.set_device(dev)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
c = torch.empty_like(a)
t = time.monotonic()
while time.monotonic() - t < float(os.environ.get("WARMUP_S", "3")):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize()
n, t0 = 0, time.monotonic()
while time.monotonic() - t0 < secs:
    torch.matmul(a, b, out=c)
    n += 1
torch.cuda.synchronize()
print(f"rate={n / (time.monotonic() - t0):.2f}")
"""


@torch_only
def test_sm_limit_per_device_and_one_board_per_gpu():
    script = os.path.join(SCRATCH, "matmul_dev.py")
    with open(script, "w") as f:
        f.write(MATMUL)
    board = tempfile.mkdtemp(prefix="board-", dir=SCRATCH)
    base = [float(Container(None).run([sys.executable, script, str(d), "3"], name=f"matmul dev{d} unlimited")["rate"])
            for d in range(2)]
    # Two containers, one per GPU, both capped at 70%, sharing the board directory: each GPU
    # has its own board (a file per GPU UUID), so each container holds its cap on its GPU
    # (on one GPU their caps, 140% together, could not both be met).
    env = dict(CUDA_DEVICE_SM_LIMIT_0="70", CUDA_DEVICE_SM_LIMIT_1="70", VGPU_TURN_DIR=board)
    cs = [Container(None, **env) for _ in range(2)]
    ps = [cs[d].spawn([sys.executable, script, str(d), "3"]) for d in range(2)]
    got = []
    for d, p in enumerate(ps):
        out, err = p.communicate(timeout=180)
        record(f"matmul dev{d} at 70 beside the other GPU's container", out + err[-1500:])
        rate = float([line for line in out.splitlines() if line.startswith("rate=")][0][5:])
        got.append(100 * rate / base[d])
    boards = sorted(os.listdir(board))
    record("sm per device", f"unlimited {base}, at 70/70 on separate GPUs: {got}, boards {boards}")
    assert len(boards) == 2, f"one board per GPU expected: {boards}"
    for d in range(2):
        assert abs(got[d] - 70) <= 5, f"GPU {d} at {got[d]:.1f}% for a 70% limit (counted with the other GPU's container?)"
    # One process, a different limit per device.
    c = Container(None, CUDA_DEVICE_SM_LIMIT_0="25", CUDA_DEVICE_SM_LIMIT_1="75")
    per = [100 * float(c.run([sys.executable, script, str(d), "3"], name=f"matmul dev{d} limits 25/75")["rate"]) / base[d]
           for d in range(2)]
    record("sm per device 25/75", f"{per}")
    assert abs(per[0] - 25) <= 5 and abs(per[1] - 75) <= 5, per
