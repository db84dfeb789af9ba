#!/usr/bin/env python3
"""Oversubscription on a real GPU (Issue 16; docs/oversubscription.md). Runnable alone:

    python3 gpu-tests/oversubscription.py [--lib PATH/libvgpu.so] [--out DIR] [--left-gib 16]

Three checks in one run (about 3 minutes on an H200), never filling the card: a reserve of
8 GiB stays free throughout, and no managed memory is used.

1. Physical exhaustion: a plain cuMemAlloc filler (no hook) holds all but LEFT + 8 GiB of
   the GPU; a container with CUDA_OVERSUBSCRIBE=true (and VGPU_DEVICE_RESERVE=8g) allocates
   1.5 x LEFT: no error, data intact, and NVML never shows its device usage above LEFT nor
   the GPU's free memory below the reserve.
2. Bandwidth: a kernel streaming over host-backed memory (torch.sum over a tensor the hook
   placed in host memory) against the bare pinned host-to-device copy bandwidth measured in
   the same process: at least 80%.
3. Training: a PyTorch loop whose working set is 1.25x the device room of its container
   (a container-mate holds part of the limit), under VGPU_HOST_SPILL, runs to completion; its
   step time against the same loop alone (fitting); after the container-mate exits, its
   memory moves back (at torch.cuda.synchronize) and the step time is within 5% of the
   fitting run.

Prints one line per check and writes DIR/oversubscription.json; exit status 0 only if every
check passed (0 with SKIP and nothing run without a GPU; checks 2 and 3 need PyTorch and say
SKIP without it).
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

GIB = 1 << 30
MIB = 1 << 20
RESERVE = 8 * GIB
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --- roles run as child processes -------------------------------------------------------

def cuda():
    lib = ctypes.CDLL("libcuda.so.1")
    def check(r, what):
        if r != 0:
            raise RuntimeError(f"{what} = {r}")
    check(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return lib, check


def role_filler(nbytes):
    """Holds `nbytes` of device memory (1 GiB allocations) until stdin closes. No hook."""
    lib, check = cuda()
    ptrs, left = [], nbytes
    while left > 0:
        p = ctypes.c_uint64()
        n = min(GIB, left)
        check(lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc_v2")
        check(lib.cuMemsetD8_v2(p, 0, ctypes.c_size_t(n)), "cuMemsetD8_v2")
        ptrs.append(p)
        left -= n
    print("held", flush=True)
    sys.stdin.read()


def role_allocate(nbytes):
    """Allocates `nbytes` in 1 GiB pieces (under the hook), writes and checks a pattern in
    each, prints the outcome and holds until stdin closes."""
    lib, check = cuda()
    ptrs, errors, left, i = [], 0, nbytes, 0
    while left > 0:
        n = min(GIB, left)
        p = ctypes.c_uint64()
        r = lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n))
        if r != 0:
            errors += 1
            print(f"alloc_error={r}", flush=True)
            break
        check(lib.cuMemsetD32_v2(p, ctypes.c_uint(i + 1), ctypes.c_size_t(n // 4)), "memset")
        ptrs.append((p, n, i + 1))
        left -= n
        i += 1
    check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
    bad = 0
    probe = (ctypes.c_uint32 * (1 << 20))()
    for p, n, v in ptrs:
        for off in (0, n - 4 * len(probe)):
            check(lib.cuMemcpyDtoH_v2(probe, ctypes.c_uint64(p.value + off), ctypes.sizeof(probe)), "copy")
            bad += sum(1 for w in probe[:4096] if w != v)
    print(f"allocated={len(ptrs)}\nerrors={errors}\nbad_words={bad}", flush=True)
    print("held", flush=True)
    sys.stdin.read()


def role_bandwidth():
    """In one hooked process: pinned host-to-device copy bandwidth, and a kernel (sum)
    streaming over a tensor larger than the container's limit (host-backed)."""
    import torch
    n = 4 * GIB
    pinned = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 5 * GIB / (time.perf_counter() - t)
    del dev
    spilled = torch.ones(n // 4, dtype=torch.float32, device="cuda")  # past the limit: host
    torch.cuda.synchronize()
    spilled.sum()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        spilled.sum()
    torch.cuda.synchronize()
    stream = 5 * n / (time.perf_counter() - t)
    print(f"h2d_gbps={h2d / 1e9:.2f}\nstream_gbps={stream / 1e9:.2f}", flush=True)


def role_train(working_set, steps, wait_for_mate):
    """A training loop over `working_set` bytes of parameters and gradients (Linear layers of
    8192 x 8192 fp32, SGD). Prints each step's time; with `wait_for_mate`, after `steps`
    steps it says so and waits for a line on stdin (the container-mate's exit), then runs
    `steps` more."""
    import torch
    layer = 8192 * 8192 * 4
    k = max(1, int(working_set // (2 * layer)))
    # Made on the device: initializing 2 G parameters on the CPU would take most of the budget.
    model = torch.nn.Sequential(
        *[torch.nn.Linear(8192, 8192, bias=False, device="cuda") for _ in range(k)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(256, 8192, device="cuda")

    def step():
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()  # also where host-backed memory moves back
        return time.perf_counter() - t

    for _ in range(3):
        step()
    times = [step() for _ in range(steps)]
    host = status_host_bytes(os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    print(f"layers={k}\nphase1={json.dumps(times)}\nhost_phase1={host}", flush=True)
    if wait_for_mate:
        print("waiting", flush=True)
        sys.stdin.readline()
        for _ in range(3):
            step()  # the first synchronizations move memory back
        times = [step() for _ in range(steps)]
        print(f"phase2={json.dumps(times)}", flush=True)
    print("done", flush=True)


def role_hold(nbytes):
    """A container-mate: holds `nbytes` through the hook until stdin closes."""
    import torch
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    print("held", flush=True)
    sys.stdin.read()


# --- the driver of the run --------------------------------------------------------------

def smi(query, fields):
    out = subprocess.run(["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=60).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_free_total():
    free, total = smi("gpu", "memory.free,memory.total")[0]
    return int(free) * MIB, int(total) * MIB


class Sampler(threading.Thread):
    """NVML every ~100 ms: the GPU's free memory and the device usage of `pids`."""

    def __init__(self):
        super().__init__(daemon=True)
        self.pids, self.min_free, self.max_used, self.stop = set(), None, 0, False

    def run(self):
        while not self.stop:
            try:
                free, _ = gpu_free_total()
                self.min_free = free if self.min_free is None else min(self.min_free, free)
                used = sum(int(u) * MIB for p, u in smi("compute-apps", "pid,used_memory") if int(p) in self.pids)
                self.max_used = max(self.max_used, used)
            except Exception:  # noqa: BLE001 - a failed sample is skipped
                pass
            time.sleep(0.1)


def child(role, args, env=None, hooked=None):
    e = dict(os.environ)
    for k in ("LD_PRELOAD", "CUDA_OVERSUBSCRIBE", "VGPU_HOST_SPILL", "VGPU_DEVICE_RESERVE",
              "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_VISIBLE_DEVICES"):
        e.pop(k, None)
    e["CUDA_VISIBLE_DEVICES"] = "0"
    if hooked:
        e["LD_PRELOAD"] = hooked
    e.update(env or {})
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role, *map(str, args)],
                            env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read_until(p, marker, timeout=240):
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.strip() == marker:
            return lines
    raise RuntimeError(f"no `{marker}` from {p.args}: {lines}")


def kv(lines):
    return dict(line.split("=", 1) for line in lines if "=" in line)


def finish(p):
    try:
        p.stdin.close()
    except OSError:
        pass
    p.wait(timeout=120)


def check_exhaustion(lib, scratch, left, results):
    free, total = gpu_free_total()
    filler_bytes = free - left - RESERVE
    if filler_bytes < GIB:
        results["exhaustion"] = {"skipped": f"only {free} bytes free"}
        return True
    filler = child("filler", [filler_bytes])
    read_until(filler, "held")
    free_before, _ = gpu_free_total()
    room = free_before - RESERVE  # what is left for the container
    want = int(1.5 * room) // GIB * GIB
    env = {"CUDA_OVERSUBSCRIBE": "true", "VGPU_DEVICE_RESERVE": f"{RESERVE // MIB}m",
           "CUDA_DEVICE_MEMORY_LIMIT": f"{(want + 4 * GIB) // MIB}m",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": os.path.join(scratch, "exhaustion.cache")}
    sampler = Sampler()
    sampler.start()
    c = child("allocate", [want], env=env, hooked=lib)
    sampler.pids.add(c.pid)
    out = kv(read_until(c, "held"))
    time.sleep(0.5)
    sampler.stop = True
    sampler.join()
    finish(c)
    finish(filler)
    ok = (out.get("errors") == "0" and out.get("bad_words") == "0"
          and sampler.max_used <= room and (sampler.min_free or 0) >= RESERVE - 512 * MIB)
    results["exhaustion"] = {"ok": ok, "gpu_total": total, "free_for_container": room,
                             "allocated": want, "container_device_max": sampler.max_used,
                             "gpu_free_min": sampler.min_free, **out}
    print(f"{'PASS' if ok else 'FAIL'} exhaustion: {want / GIB:.0f} GiB allocated with "
          f"{room / GIB:.1f} GiB free for it; device usage max {sampler.max_used / GIB:.1f} GiB; "
          f"GPU free min {(sampler.min_free or 0) / GIB:.1f} GiB; {out}")
    return ok


def check_bandwidth(lib, scratch, results):
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "2g", "VGPU_HOST_SPILL": "6g",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": os.path.join(scratch, "bandwidth.cache")}
    c = child("bandwidth", [], env=env, hooked=lib)
    out, _ = c.communicate(timeout=240)
    v = kv(out.splitlines())
    h2d, stream = float(v.get("h2d_gbps", 0)), float(v.get("stream_gbps", 0))
    ok = c.returncode == 0 and h2d > 0 and stream >= 0.8 * h2d
    results["bandwidth"] = {"ok": ok, "h2d_gbps": h2d, "stream_gbps": stream,
                            "ratio": stream / h2d if h2d else 0}
    print(f"{'PASS' if ok else 'FAIL'} bandwidth: kernel over host-backed memory {stream:.1f} GB/s, "
          f"pinned host-to-device copy {h2d:.1f} GB/s ({100 * stream / h2d if h2d else 0:.0f}%, goal >= 80%)")
    return ok


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def check_training(lib, scratch, results):
    # One container (one usage file) with a 20 GiB limit; a container-mate holds 8 GiB of it
    # (plus its context), leaving the trainer about 11 GiB; its working set is 1.25x that.
    limit, mate = 20 * GIB, 8 * GIB
    working_set = int(1.25 * (limit - mate - GIB))
    steps = 20
    base = {"CUDA_DEVICE_MEMORY_LIMIT": f"{limit // MIB}m", "VGPU_HOST_SPILL": "16g"}
    # The same loop alone in a container of the same limit: it fits.
    fit = child("train", [working_set, steps, 0], hooked=lib,
                env={**base, "CUDA_DEVICE_MEMORY_SHARED_CACHE": os.path.join(scratch, "fit.cache")})
    out, _ = fit.communicate(timeout=240)
    fit_out = kv(out.splitlines())
    fit_steps = json.loads(fit_out["phase1"])
    fit_host = int(fit_out["host_phase1"])  # 0: the fitting run really fits
    shared = {**base, "CUDA_DEVICE_MEMORY_SHARED_CACHE": os.path.join(scratch, "shared.cache")}
    holder = child("hold", [mate], env=shared, hooked=lib)
    read_until(holder, "held")
    train = child("train", [working_set, steps, 1], env=shared, hooked=lib)
    lines = read_until(train, "waiting")
    spilled = json.loads(kv(lines)["phase1"])
    host_bytes = status_host_bytes(shared["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
    finish(holder)  # the container-mate exits
    train.stdin.write("go\n")
    train.stdin.flush()
    lines = read_until(train, "done")
    back = json.loads(kv(lines)["phase2"])
    host_after = status_host_bytes(shared["CUDA_DEVICE_MEMORY_SHARED_CACHE"])  # moved back
    finish(train)
    t_fit, t_spill, t_back = median(fit_steps), median(spilled), median(back)
    ok = (fit.returncode == 0 and train.returncode == 0 and fit_host == 0 and host_bytes > 0
          and host_after == 0 and t_back <= 1.05 * t_fit)
    results["training"] = {"ok": ok, "working_set": working_set, "step_fit_s": t_fit,
                           "step_spilled_s": t_spill, "step_after_move_back_s": t_back,
                           "host_backed_fitting_run": fit_host,
                           "host_backed_while_mate_ran": host_bytes, "host_backed_at_end": host_after}
    print(f"{'PASS' if ok else 'FAIL'} training: working set {working_set / GIB:.1f} GiB in "
          f"{(limit - mate) / GIB:.0f} GiB of room, {host_bytes / GIB:.1f} GiB host-backed; step "
          f"{t_fit * 1e3:.1f} ms fitting, {t_spill * 1e3:.1f} ms spilled ({t_spill / t_fit:.2f}x), "
          f"{t_back * 1e3:.1f} ms after the move back ({t_back / t_fit:.3f}x, goal <= 1.05)")
    return ok


# Where device 0's host-backed total lies in a usage file (docs/shm-protocol.md: the vgpu
# extension at 2,008,960, its 64-byte header, then one 64-byte record per device whose third
# word is host_total).
HOST_TOTAL_0 = 2_008_960 + 64 + 16


def status_host_bytes(cache):
    """Host-backed bytes of device 0 in the usage file `cache`, now."""
    with open(cache, "rb") as f:
        f.seek(HOST_TOTAL_0)
        return int.from_bytes(f.read(8), "little")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--lib", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    ap.add_argument("--left-gib", type=int, default=16)
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    if a.role:
        r = [int(x) for x in a.rest]
        {"filler": lambda: role_filler(r[0]), "allocate": lambda: role_allocate(r[0]),
         "bandwidth": role_bandwidth, "train": lambda: role_train(r[0], r[1], r[2]),
         "hold": lambda: role_hold(r[0])}[a.role]()
        return 0
    try:
        have_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        have_gpu = False
    if not have_gpu:
        print("SKIP: no NVIDIA GPU here (nvidia-smi -L failed); nothing to test")
        return 0
    lib = a.lib or next((p for p in (os.path.join(ROOT, ".carry/libvgpu.so"),
                                     os.path.join(ROOT, "target/release/libvgpu.so")) if os.path.isfile(p)), "")
    if not os.path.isfile(lib):
        print("ERROR: libvgpu.so not found (--lib PATH; cargo build --release -p vgpu-hook)")
        return 2
    lib = os.path.abspath(lib)
    os.makedirs(a.out, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="vgpu-oversub-")
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "lib": lib}
    t0 = time.time()

    def run(name, check, *args):
        try:
            return check(lib, scratch, *args, results)
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check
            results[name] = {"ok": False, "error": repr(e)}
            print(f"FAIL {name}: {e!r}")
            return False

    ok = run("exhaustion", check_exhaustion, a.left_gib * GIB)
    try:
        import torch  # noqa: F401
        have_torch = True
    except Exception:  # noqa: BLE001
        have_torch = False
        print("SKIP bandwidth, training: no PyTorch")
    if have_torch:
        ok = run("bandwidth", check_bandwidth) and ok
        ok = run("training", check_training) and ok
    results["seconds"] = time.time() - t0
    with open(os.path.join(a.out, "oversubscription.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'PASS' if ok else 'FAIL'} ({results['seconds']:.0f} s); {os.path.join(a.out, 'oversubscription.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
