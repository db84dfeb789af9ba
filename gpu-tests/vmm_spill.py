#!/usr/bin/env python3
"""The VMM path of oversubscription and the move rule on a real GPU (issues 26 and 27;
docs/oversubscription.md). Runnable alone:

    python3 gpu-tests/vmm_spill.py --lib PATH/libvgpu.so [--out DIR] [--left-gib 20]

About two minutes on an H200. It never fills the card (LEFT GiB stay free of the filler, and
the container keeps VGPU_DEVICE_RESERVE=2g of them free) and uses no managed memory.

0. Driver facts (no hook; printed as INFO, they decide nothing): whether the GPU supports the
   GPUDirect RDMA flag with cuMemCreate (attribute 110) and POSIX fd handles (103); what
   cuMemCreate of 2 MiB at the host location answers with no extra property, with POSIX fd
   handles, with the GPUDirect RDMA flag (PyTorch's expandable segments set it wherever 110
   says yes), with both; and how long cuMemUnmap of an idle mapping takes while another
   context has a 1 s kernel queued (about 1 s: the unmap waits for it; about 0: it does not,
   as the H200 with driver 580 answered and the simulated driver models).
1. vmm_spill (needs PyTorch): a bare cuMemAlloc filler (no hook) holds all but LEFT GiB of
   the GPU; a PyTorch process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
   CUDA_OVERSUBSCRIBE=true, VGPU_DEVICE_RESERVE=2g and a 3 x LEFT GiB limit allocates
   1.5 x LEFT GiB in 1 GiB tensors, each filled with its own value: every tensor allocated,
   every value intact, host-backed bytes in the usage file, and the GPU's free memory (NVML,
   sampled) never below 1.5 GiB. With LIBCUDA_LOG_LEVEL=3 each host-backed segment is a
   log line (counted); other vgpu lines are shown. async_spill: the same with
   PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (the stream-ordered pool path).
2. move_rule (no PyTorch): two contexts of one hooked process (limit 4g, VGPU_HOST_SPILL=4g):
   A fills the container's device room, B's 512 MiB buffer is host-backed; B queues
   spin(200 ms) and a fill of the buffer; A frees room and synchronizes. The buffer must
   stay host-backed, B's fill must land (0 unwritten words), and once A is destroyed B's
   synchronize moves it onto the device, intact.

Prints one line per check and writes DIR/vmm_spill.json; exit status 0 only if checks 1 and 2
passed, and async_spill (0 with SKIP and nothing run without a GPU).
"""
import argparse
import array
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import oversubscription as o  # noqa: E402 - the shared helpers of the oversubscription run

GIB, MIB = o.GIB, o.MIB
RESERVE = 2 * GIB
BUFFER = 512 * MIB


# --- the driver through ctypes ----------------------------------------------------------

class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):
    """CUmemAllocationProp: type, requestedHandleTypes, location, win32HandleMetaData,
    allocFlags {compressionType, gpuDirectRDMACapable, usage, reserved[4]}."""
    _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("loc", Loc),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class Access(ctypes.Structure):
    _fields_ = [("loc", Loc), ("flags", ctypes.c_uint)]


def driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    for name in ("cuCtxSetCurrent", "cuCtxDestroy_v2"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    lib.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    lib.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    lib.cuMemMap.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                             ctypes.c_ulonglong]
    lib.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(Access),
                                   ctypes.c_size_t]
    lib.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    lib.cuMemRelease.argtypes = [ctypes.c_uint64]
    lib.cuStreamQuery.argtypes = [ctypes.c_void_p]

    def check(r, what):
        if r != 0:
            raise RuntimeError(f"{what} = {r}")
    check(lib.cuInit(0), "cuInit")
    return lib, check


def test_ptx():
    """The PTX of tests/programs/cuda_min.h (spin, fill), which both drivers load."""
    with open(os.path.join(ROOT, "crates/vgpu-hook/tests/programs/cuda_min.h")) as f:
        text = f.read()
    body = text.split("VGPU_TEST_PTX[] =", 1)[1].split(";\n", 1)[0]
    return "".join(bytes(s, "ascii").decode("unicode_escape") for s in re.findall(r'"((?:[^"\\]|\\.)*)"', body))


def kernels(lib, check):
    mod, spin, fill = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(test_ptx().encode())), "cuModuleLoadData")
    check(lib.cuModuleGetFunction(ctypes.byref(spin), mod, b"spin"), "spin")
    check(lib.cuModuleGetFunction(ctypes.byref(fill), mod, b"fill"), "fill")
    return spin, fill


def launch(lib, check, f, grid, block, *args):
    """Launches `f` on the current context's default stream with `args` (ctypes values)."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    check(lib.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, None, params, None), "cuLaunchKernel")


def context(lib, check):
    ctx = ctypes.c_void_p()
    check(lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0), "cuCtxCreate_v2")
    return ctx


# --- roles run as child processes -------------------------------------------------------

def role_probe():
    """Driver facts, no hook."""
    lib, check = driver()
    dev = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    for attr, name in ((110, "rdma_with_vmm"), (103, "posix_fd_handles")):
        v = ctypes.c_int()
        check(lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev), f"attribute {attr}")
        print(f"{name}={v.value}")
    a = context(lib, check)
    for name, handles, rdma in (("plain", 0, 0), ("posix_fd", 1, 0), ("rdma", 0, 1), ("both", 1, 1)):
        prop = Prop(type=1, handles=handles, loc=Loc(2, 0))
        prop.flags[1] = rdma
        gran, h = ctypes.c_size_t(), ctypes.c_uint64()
        r = lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0)
        size = gran.value if r == 0 and gran.value else 2 * MIB
        r = lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
        if r == 0:
            check(lib.cuMemRelease(h.value), "cuMemRelease")
        print(f"host_create_{name}={r}")
    # cuMemUnmap of an idle mapping in A while B has a 1 s kernel queued.
    b = context(lib, check)
    spin, _ = kernels(lib, check)
    launch(lib, check, spin, 1, 1, ctypes.c_uint64(1_000_000_000))
    check(lib.cuCtxSetCurrent(a), "cuCtxSetCurrent")
    prop = Prop(type=1, handles=0, loc=Loc(1, 0))
    h, va = ctypes.c_uint64(), ctypes.c_uint64()
    check(lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(2 * MIB), ctypes.byref(prop), ctypes.c_ulonglong(0)), "cuMemCreate")
    check(lib.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(2 * MIB), ctypes.c_size_t(0),
                                  ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
    check(lib.cuMemMap(va.value, 2 * MIB, 0, h.value, 0), "cuMemMap")
    acc = Access(Loc(1, 0), 3)
    check(lib.cuMemSetAccess(va.value, 2 * MIB, ctypes.byref(acc), 1), "cuMemSetAccess")
    t = time.perf_counter()
    check(lib.cuMemUnmap(va.value, 2 * MIB), "cuMemUnmap")
    print(f"unmap_s_with_other_context_busy={time.perf_counter() - t:.3f}")
    check(lib.cuMemRelease(h.value), "cuMemRelease")
    check(lib.cuMemAddressFree(va.value, 2 * MIB), "cuMemAddressFree")
    check(lib.cuCtxDestroy_v2(b), "cuCtxDestroy_v2")
    check(lib.cuCtxDestroy_v2(a), "cuCtxDestroy_v2")
    print("end", flush=True)


def role_torch(nbytes):
    """Under the hook, expandable segments: `nbytes` in 1 GiB tensors, each filled with its
    index + 1, checked; prints the outcome and holds until stdin closes."""
    import torch
    tensors, error = [], ""
    for i in range(nbytes // GIB):
        try:
            tensors.append(torch.full((GIB // 4,), float(i + 1), dtype=torch.float32, device="cuda"))
        except torch.cuda.OutOfMemoryError as e:
            error = str(e).splitlines()[0]
            break
    torch.cuda.synchronize()
    bad = sum(1 for i, t in enumerate(tensors) if not bool((t == float(i + 1)).all()))
    print(f"allocated={len(tensors)}\nwanted={nbytes // GIB}\nbad_tensors={bad}\nerror={error}", flush=True)
    print("held", flush=True)
    sys.stdin.read()


def role_move_rule():
    """Under the hook (limit 4g, VGPU_HOST_SPILL=4g): the two-context scenario."""
    lib, check = driver()
    cache = os.environ["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    a = context(lib, check)
    b = context(lib, check)
    check(lib.cuCtxSetCurrent(a), "cuCtxSetCurrent")
    fillers, free, total = [], ctypes.c_size_t(), ctypes.c_size_t()
    while True:  # A takes the container's device room, in BUFFER pieces
        check(lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2")
        if free.value < BUFFER:
            break
        p = ctypes.c_uint64()
        check(lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(BUFFER)), "cuMemAlloc_v2")
        fillers.append(p)
    check(lib.cuCtxSetCurrent(b), "cuCtxSetCurrent")
    spin, fill = kernels(lib, check)
    x = ctypes.c_uint64()
    check(lib.cuMemAlloc_v2(ctypes.byref(x), ctypes.c_size_t(BUFFER)), "cuMemAlloc_v2")
    words = BUFFER // 4
    check(lib.cuMemsetD32_v2(x.value, 1, words), "cuMemsetD32_v2")
    check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
    print(f"host_placed={o.status_host_bytes(cache)}")
    launch(lib, check, spin, 1, 1, ctypes.c_uint64(200_000_000))
    launch(lib, check, fill, 1024, 256, ctypes.c_uint64(x.value), ctypes.c_uint(7), ctypes.c_uint64(words))
    check(lib.cuCtxSetCurrent(a), "cuCtxSetCurrent")
    check(lib.cuMemFree_v2(fillers[0].value), "cuMemFree_v2")
    print(f"sync_a={lib.cuCtxSynchronize()}")
    print(f"host_after_a_sync={o.status_host_bytes(cache)}")
    check(lib.cuCtxSetCurrent(b), "cuCtxSetCurrent")
    print(f"sync_b={lib.cuCtxSynchronize()}")
    out = (ctypes.c_uint32 * words)()

    def unwritten():
        if lib.cuMemcpyDtoH_v2(ctypes.addressof(out), x.value, BUFFER):
            return -1
        seen = array.array("I")
        seen.frombytes(memoryview(out).cast("B"))
        return words - seen.count(7)
    print(f"unwritten={unwritten()}")
    check(lib.cuCtxDestroy_v2(a), "cuCtxDestroy_v2")
    check(lib.cuCtxSetCurrent(b), "cuCtxSetCurrent")
    print(f"sync_b_alone={lib.cuCtxSynchronize()}")
    print(f"host_at_end={o.status_host_bytes(cache)}")
    print(f"unwritten_after_move={unwritten()}")
    print("end", flush=True)


# --- the driver of the run --------------------------------------------------------------

def child(role, args, env=None, hooked=None, stderr=None):
    e = dict(os.environ)
    for k in ("LD_PRELOAD", "CUDA_OVERSUBSCRIBE", "VGPU_HOST_SPILL", "VGPU_DEVICE_RESERVE",
              "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_VISIBLE_DEVICES",
              "PYTORCH_CUDA_ALLOC_CONF", "LIBCUDA_LOG_LEVEL"):
        e.pop(k, None)
    e["CUDA_VISIBLE_DEVICES"] = "0"
    if hooked:
        e["LD_PRELOAD"] = hooked
    e.update(env or {})
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", role, *map(str, args)],
                            env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)


def check_probe(lib, scratch, results):
    c = child("probe", [])
    out, _ = c.communicate(timeout=120)
    facts = o.kv(out.splitlines())
    results["driver"] = facts
    print(f"INFO driver: {facts}")
    return True


def check_vmm_spill(lib, scratch, left, name, conf, results):
    free, total = o.gpu_free_total()
    filler_bytes = free - left
    if filler_bytes < GIB or left < 4 * GIB:
        results[name] = {"ok": False, "error": f"only {free} bytes free for a {left}-byte room"}
        print(f"FAIL {name}: {free / GIB:.1f} GiB free, cannot leave {left / GIB:.0f} GiB")
        return False
    filler = o.child("filler", [filler_bytes])  # bare cuMemAlloc, no hook
    o.read_until(filler, "held")
    room, _ = o.gpu_free_total()
    want = int(1.5 * room) // GIB * GIB
    cache = os.path.join(scratch, f"{name}.cache")
    env = {"CUDA_OVERSUBSCRIBE": "true", "VGPU_DEVICE_RESERVE": f"{RESERVE // MIB}m",
           "CUDA_DEVICE_MEMORY_LIMIT": f"{3 * room // MIB}m",
           "PYTORCH_CUDA_ALLOC_CONF": conf, "LIBCUDA_LOG_LEVEL": "3",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": cache}
    log_path = os.path.join(scratch, f"{name}.stderr")
    sampler = o.Sampler()
    sampler.start()
    with open(log_path, "w") as log:
        c = child("torch", [want], env=env, hooked=lib, stderr=log)
        sampler.pids.add(c.pid)
        out = o.kv(o.read_until(c, "held"))
        host = o.status_host_bytes(cache)
        time.sleep(0.5)
        sampler.stop = True
        sampler.join()
        o.finish(c)
    o.finish(filler)
    with open(log_path) as f:
        vgpu_lines = [line.rstrip() for line in f if "[vgpu" in line]
    def spill(line):
        return "is full for this container" in line and "host memory" in line
    spills = sum(1 for line in vgpu_lines if spill(line))
    vgpu_lines = [line for line in vgpu_lines if not spill(line)]
    min_free = sampler.min_free or 0
    ok = (out.get("allocated") == out.get("wanted") and out.get("bad_tensors") == "0"
          and host > 0 and min_free >= RESERVE - GIB // 2)
    results[name] = {"ok": ok, "conf": conf, "gpu_total": total, "room": room, "wanted": want,
                            "host_backed_bytes": host, "gpu_free_min": min_free,
                            "host_backed_segments_logged": spills, "vgpu_log": vgpu_lines[:20], **out}
    print(f"{'PASS' if ok else 'FAIL'} {name}: {out.get('allocated')} of {out.get('wanted')} GiB with "
          f"{conf} in {room / GIB:.1f} GiB of room, {host / GIB:.1f} GiB host-backed, "
          f"bad tensors {out.get('bad_tensors')}, GPU free min {min_free / GIB:.2f} GiB "
          f"(reserve {RESERVE / GIB:.0f} GiB); error: {out.get('error') or 'none'}; "
          f"{spills} segments logged as host-backed, {len(vgpu_lines)} other vgpu lines "
          f"(first: {vgpu_lines[:1]})")
    return ok


def check_move_rule(lib, scratch, results):
    cache = os.path.join(scratch, "move.cache")
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "4g", "VGPU_HOST_SPILL": "4g",
           "CUDA_DEVICE_MEMORY_SHARED_CACHE": cache}
    c = child("move_rule", [], env=env, hooked=lib)
    out, _ = c.communicate(timeout=180)
    v = o.kv(out.splitlines())
    ok = (c.returncode == 0 and v.get("host_placed") == str(BUFFER) and v.get("sync_a") == "0"
          and v.get("host_after_a_sync") == str(BUFFER) and v.get("sync_b") == "0"
          and v.get("unwritten") == "0" and v.get("sync_b_alone") == "0"
          and v.get("host_at_end") == "0" and v.get("unwritten_after_move") == "0")
    results["move_rule"] = {"ok": ok, "returncode": c.returncode, **v}
    print(f"{'PASS' if ok else 'FAIL'} move_rule: {v}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--lib", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    ap.add_argument("--left-gib", type=int, default=20)
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    if a.role:
        r = [int(x) for x in a.rest]
        {"probe": role_probe, "torch": lambda: role_torch(r[0]), "move_rule": role_move_rule}[a.role]()
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
    scratch = tempfile.mkdtemp(prefix="vgpu-vmm-")
    results = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "lib": lib}
    t0 = time.time()

    def run(name, check, *args):
        try:
            return check(lib, scratch, *args, results)
        except Exception as e:  # noqa: BLE001 - a check that breaks is a failed check
            results[name] = {"ok": False, "error": repr(e)}
            print(f"FAIL {name}: {e!r}")
            return False

    run("driver", check_probe)
    try:
        import torch  # noqa: F401
        ok = run("vmm_spill", check_vmm_spill, a.left_gib * GIB, "vmm_spill",
                 "expandable_segments:True")
        ok = run("async_spill", check_vmm_spill, a.left_gib * GIB, "async_spill",
                 "backend:cudaMallocAsync") and ok
    except ImportError:
        print("FAIL vmm_spill: needs PyTorch")
        ok = False
    ok = run("move_rule", check_move_rule) and ok
    results["seconds"] = time.time() - t0
    with open(os.path.join(a.out, "vmm_spill.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"{'PASS' if ok else 'FAIL'} ({results['seconds']:.0f} s); {os.path.join(a.out, 'vmm_spill.json')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
