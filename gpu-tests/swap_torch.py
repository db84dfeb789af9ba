#!/usr/bin/env python3
"""Swapping a PyTorch process out and back on a real GPU (docs/swap.md; issue 27). Runnable
alone:

    python3 gpu-tests/swap_torch.py --lib PATH/libvgpu.so --vgpu PATH/vgpu [--gib 16] [--out DIR]

An "engine" (a child process under the hook, VGPU_IDLE_SWAP=manual, VGPU_SWAP_MOVABLE=1, so
its plain allocations of 2 MiB and more are movable) allocates GIB of tensors of 1 GiB, fills
each with its own value, synchronizes and waits. The runner then:

1. asks it to swap out (`vgpu swap-out --cache FILE`) and times until `vgpu status` shows it
   swapped; NVML's used memory of the GPU before and after (the memory must go back to the
   node: at least 90% of GIB);
2. lets it touch its memory (a sum over every tensor): the first call brings everything back,
   timed inside the engine (the first operation, then the whole check), and the sums must be
   what was written;
3. the same again (`--cycles`, default 3), then the engine exits. The first swap-out stages
   in pageable memory (nothing is pinned yet; docs/swap.md, "Pageable staging"), and the
   hook pins it in the background while the engine stays out; with `--settle S` the runner
   leaves it out S seconds before the touch, so the swap-in finds it pinned and keeps it
   (`VGPU_SWAP_KEEP_HOST`), and later cycles copy at link speed. Without it, the first touch
   brings the staged bytes back from pageable memory.

`--pair` instead runs the turn-taking scenario of issue 27: a bare filler leaves `--room` GiB
of the GPU free; two engines of 60% of that room each, under `VGPU_IDLE_SWAP=1s` (`--idle`), take turns
(one touches its memory, then idles until it is swapped out; then the other), so neither
fits beside the other. Each turn's line: the wake (the first call's time, which brings the
memory back), the data, and NVML's used memory once the engine idled out.

`--checkpoint`: the same engine without the hook, checkpointed and restored by the driver's
checkpoint API (`cuCheckpointProcess*`, driver 570 and later), for the comparison the issue
asks for in the same run.

`--priority`: a less urgent engine (`CUDA_TASK_PRIORITY=1`) holds 60% of the room and idles;
an urgent one (priority 0) allocates 60% of it too: its allocations wait for the idle one to
swap out (docs/swap.md, "For a more urgent container"), then succeed; the idle one comes back
intact once the urgent one has exited.

`--exits`: the engine exits while its host memory is pinned ahead, while a swap-out is under
way, and while swapped out; each must end by itself with status 0 and leave the GPU's memory
as it found it (the hook never hangs or kills its program).

Each direction's rate is GIB over its time. The engine goes through the CUDA runtime, which
resolves every driver function at start: without the hook's slots for the functions its list
does not name (src/swap/unlisted.rs) it is refused, and the runner says so (FAIL, with the
hook's line). With `--expandable` the engines (of the first scenario and of `--pair`) use
PyTorch's expandable segments (`cuMemCreate` mappings of their own), which move as the
program's own VMM handles (docs/swap.md); the same checks hold.

Prints one line per check and writes DIR/swap_torch.json; exit status 0 only if every check
passed (0 with SKIP without a GPU or PyTorch).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

GIB = 1 << 30


def engine(gib):
    """The child: GIB tensors of 1 GiB, each filled with its index + 1; then commands on stdin."""
    import torch
    n = 1 << 28  # float32 elements in 1 GiB
    tensors = [torch.full((n,), float(i + 1), device="cuda") for i in range(gib)]
    torch.cuda.synchronize()
    want = [float(i + 1) * n for i in range(gib)]
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "touch":
            t0 = time.perf_counter()
            first = tensors[0].sum().item()  # the first call that can touch device memory
            t1 = time.perf_counter()
            got = [first] + [t.sum().item() for t in tensors[1:]]
            t2 = time.perf_counter()
            print(json.dumps({"first_s": t1 - t0, "all_s": t2 - t0,
                              "intact": all(abs(g - w) <= 1e-6 * w for g, w in zip(got, want))}),
                  flush=True)
        elif cmd == "exit":
            break
    return 0


def send(p, cmd):
    """A command to an engine child."""
    p.stdin.write(cmd + "\n")
    p.stdin.flush()


def touch(p):
    """An engine child touches its memory: its answer (first_s, all_s, intact)."""
    send(p, "touch")
    return json.loads(p.stdout.readline())


def gpu_used_bytes():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * (1 << 20)


def status(vgpu, cache):
    out = subprocess.run([vgpu, "status", "--cache", cache, "--json"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def swapped(vgpu, cache, pid):
    for p in status(vgpu, cache).get("processes", []):
        if p.get("pid") == pid:
            return p.get("state") == "swapped"
    return False


def run(args):
    result = {"gib": args.gib, "expandable": args.expandable, "cycles": [], "checks": {}}
    work = tempfile.mkdtemp(prefix="swap-torch-")
    cache = os.path.join(work, "engine.cache")
    log = os.path.join(work, "engine.log")
    env = dict(os.environ, LD_PRELOAD=os.path.abspath(args.lib), CUDA_DEVICE_MEMORY_SHARED_CACHE=cache,
               VGPU_IDLE_SWAP="manual", VGPU_SWAP_MOVABLE="1", LIBCUDA_LOG_LEVEL="3")
    if args.expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "engine",
                              "--gib", str(args.gib)], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        ready = json.loads(p.stdout.readline())
        pid = ready["pid"]
        for cycle in range(1, args.cycles + 1):
            before = gpu_used_bytes()
            t0 = time.perf_counter()
            subprocess.run([args.vgpu, "swap-out", "--cache", cache], check=True, capture_output=True)
            out_s = None
            while time.perf_counter() - t0 < args.timeout:
                if swapped(args.vgpu, cache, pid):
                    out_s = time.perf_counter() - t0
                    break
                time.sleep(0.01)
            after = gpu_used_bytes()
            settled = None
            if args.settle and out_s:
                # Staged bytes (docs/swap.md, "Pageable staging") are pinned in the background
                # while the engine stays out: the touch after --settle seconds times that.
                time.sleep(args.settle)
                with open(log) as f:
                    settled = sum("staged bytes into pinned host memory" in l for l in f)
            touched = touch(p)
            c = {"cycle": cycle, "out_s": out_s, "released_bytes": before - after,
                 "in_first_s": touched["first_s"], "in_all_s": touched["all_s"],
                 "intact": touched["intact"], "settled_allocations": settled}
            if out_s:
                c["out_gb_s"] = args.gib * GIB / out_s / 1e9
                c["in_gb_s"] = args.gib * GIB / touched["first_s"] / 1e9
            result["cycles"].append(c)
        send(p, "exit")
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    with open(log) as f:
        result["hook_lines"] = [l.strip() for l in f if "swap" in l or "staged" in l][-10:]
    return result


def filler(room_gib):
    """A bare process that holds all of the GPU but `room_gib` GiB, until stdin closes."""
    import torch
    free, _ = torch.cuda.mem_get_info()
    hold = torch.empty(max(free - room_gib * GIB, 0), dtype=torch.uint8, device="cuda")
    print(json.dumps({"held": hold.numel()}), flush=True)
    sys.stdin.read()
    return 0


def engine_env(args, cache, trigger):
    env = dict(os.environ, LD_PRELOAD=os.path.abspath(args.lib),
               CUDA_DEVICE_MEMORY_SHARED_CACHE=cache, VGPU_IDLE_SWAP=trigger,
               VGPU_SWAP_MOVABLE="1", LIBCUDA_LOG_LEVEL="3")
    if getattr(args, "expandable", False):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def wait_until(check, timeout):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if check():
            return time.perf_counter() - t0
        time.sleep(0.02)
    return None


def start_filler(args, procs):
    """A bare filler that leaves `--room` GiB of the GPU free (added to `procs`): it and the
    bytes it holds."""
    fill = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "filler", "--room",
                             str(args.room)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs.append(fill)
    return fill, json.loads(fill.stdout.readline())["held"]


def run_pair(args):
    """Two engines of 60% of the room take turns; see the docstring."""
    gib = max(1, int(args.room * 0.6))
    result = {"pair": True, "room_gib": args.room, "gib": gib, "idle": args.idle, "turns": []}
    work = tempfile.mkdtemp(prefix="swap-pair-")
    me = os.path.abspath(__file__)
    procs = []
    try:
        fill, result["filler_bytes"] = start_filler(args, procs)
        engines = []
        for name in ("a", "b"):
            cache = os.path.join(work, f"{name}.cache")
            engines.append({"name": name, "cache": cache, "log": os.path.join(work, f"{name}.log"),
                            "proc": None, "pid": None})
        for turn in range(args.turns):
            me_, other = engines[turn % 2], engines[(turn + 1) % 2]
            t = {"turn": turn + 1, "engine": me_["name"]}
            if other["proc"] is not None:
                # The other one idles out first: only then is there room for this one.
                t["other_out_s"] = wait_until(
                    lambda: swapped(args.vgpu, other["cache"], other["pid"]), args.timeout)
            if me_["proc"] is None:
                with open(me_["log"], "w") as err:
                    p = subprocess.Popen([sys.executable, me, "--role", "engine", "--gib", str(gib)],
                                         env=engine_env(args, me_["cache"], args.idle),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True)
                procs.append(p)
                line = p.stdout.readline()
                t["started"] = bool(line)
                if not line:
                    result["turns"].append(t)
                    break
                me_["proc"], me_["pid"] = p, json.loads(line)["pid"]
            p = me_["proc"]
            send(p, "touch")
            line = p.stdout.readline()
            if not line:
                t["touched"] = False
                result["turns"].append(t)
                break
            touched = json.loads(line)
            t.update(touched=True, wake_s=touched["first_s"], intact=touched["intact"])
            before = gpu_used_bytes()
            t["idle_out_s"] = wait_until(lambda: swapped(args.vgpu, me_["cache"], me_["pid"]),
                                         args.timeout)
            t["released_bytes"] = before - gpu_used_bytes()
            result["turns"].append(t)
        for e in engines:
            if e["proc"] is not None and e["proc"].poll() is None:
                send(e["proc"], "exit")
                e["proc"].wait(timeout=60)
        fill.stdin.close()
        fill.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    result["hook_lines"] = []
    for name in ("a", "b"):
        path = os.path.join(work, f"{name}.log")
        if os.path.exists(path):
            with open(path) as f:
                result["hook_lines"] += [f"{name}: {l.strip()}" for l in f
                                         if "swap" in l or "pinned" in l][-8:]
    return result


def run_exits(args):
    """An engine (GIB) exits at three moments of a swap: while its host memory is pinned ahead
    (`VGPU_IDLE_SWAP=4s`, after the hook's first "pinned" line), while a `vgpu swap-out` is
    under way (150 ms after asking: the hook's tick is 100 ms, the move takes seconds), and
    while swapped out. Each must exit by itself, status 0, within 10 s, and NVML's used
    memory must come back to what it was before the engine."""
    result = {"exits": True, "gib": args.gib, "cases": []}
    work = tempfile.mkdtemp(prefix="swap-exit-")
    me = os.path.abspath(__file__)
    for case in ("pinning ahead", "swapping out", "swapped out"):
        cache = os.path.join(work, case.replace(" ", "-") + ".cache")
        log = cache + ".log"
        base = gpu_used_bytes()
        trigger = "4s" if case == "pinning ahead" else "manual"
        c = {"case": case}
        with open(log, "w") as err:
            p = subprocess.Popen([sys.executable, me, "--role", "engine", "--gib", str(args.gib)],
                                 env=engine_env(args, cache, trigger), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            pid = json.loads(p.stdout.readline())["pid"]
            if case == "pinning ahead":
                def pinning():
                    with open(log) as f:
                        return "ahead of a swap-out" in f.read()
                c["reached"] = wait_until(pinning, 20) is not None
            else:
                subprocess.run([args.vgpu, "swap-out", "--cache", cache], check=True,
                               capture_output=True)
                if case == "swapping out":
                    time.sleep(0.15)
                    c["reached"] = not swapped(args.vgpu, cache, pid)
                else:
                    c["reached"] = wait_until(lambda: swapped(args.vgpu, cache, pid),
                                              args.timeout) is not None
            t0 = time.perf_counter()
            send(p, "exit")
            try:
                c["status"] = p.wait(timeout=10)
                c["exit_s"] = time.perf_counter() - t0
            except subprocess.TimeoutExpired:
                c["status"], c["exit_s"] = None, None
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        time.sleep(0.5)
        c["left_on_gpu"] = gpu_used_bytes() - base
        with open(log) as f:
            c["hook_lines"] = [l.strip() for l in f if "[vgpu" in l][-4:]
        result["cases"].append(c)
    return result


def run_checkpoint(args):
    """The driver's own way, for the comparison in the same run: the same engine without the
    hook, checkpointed by the driver's checkpoint API from this process (lock, checkpoint:
    device memory to host memory and the GPU released; restore, unlock), each step timed,
    NVML's used memory before and after the checkpoint, then the engine's touch."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    result = {"checkpoint": True, "gib": args.gib, "steps": {}}
    if cuda.cuInit(0) != 0 or not hasattr(cuda, "cuCheckpointProcessCheckpoint"):
        result["error"] = "no cuCheckpointProcess* in this driver"
        return result

    class LockArgs(ctypes.Structure):
        _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                    ("reserved1", ctypes.c_uint64 * 7)]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "engine", "--gib",
                          str(args.gib)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        pid = json.loads(p.stdout.readline())["pid"]
        before = gpu_used_bytes()
        lock = LockArgs(timeoutMs=10000)
        for name, call in (("lock", lambda: cuda.cuCheckpointProcessLock(pid, ctypes.byref(lock))),
                           ("checkpoint", lambda: cuda.cuCheckpointProcessCheckpoint(pid, None)),
                           ("restore", lambda: cuda.cuCheckpointProcessRestore(pid, None)),
                           ("unlock", lambda: cuda.cuCheckpointProcessUnlock(pid, None))):
            t0 = time.perf_counter()
            rc = call()
            result["steps"][name] = {"rc": rc, "s": time.perf_counter() - t0}
            if name == "checkpoint":
                result["released_bytes"] = before - gpu_used_bytes()
            if rc != 0:
                break
        if all(v["rc"] == 0 for v in result["steps"].values()) and len(result["steps"]) == 4:
            result["touched"] = touch(p)
        send(p, "exit")
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return result


def run_priority(args):
    """Swap for a more urgent container: a bare filler leaves `--room` GiB; a less urgent
    engine (CUDA_TASK_PRIORITY=1, VGPU_IDLE_SWAP=manual: it swaps only when asked) holds 60% of
    it and idles; an urgent one (priority 0, no swapping of its own) then allocates 60% of the
    room too. Its allocations past the free room must wait for the idle one to swap out, then
    succeed; the idle one, once the urgent one has exited, must come back intact."""
    gib = max(1, int(args.room * 0.6))
    result = {"priority": True, "room_gib": args.room, "gib": gib}
    work = tempfile.mkdtemp(prefix="swap-priority-")
    turns = os.path.join(work, "turns")
    os.makedirs(turns)
    me = os.path.abspath(__file__)
    procs = []
    try:
        fill, _ = start_filler(args, procs)
        caches = {n: os.path.join(work, f"{n}.cache") for n in ("idle", "urgent")}
        logs = {n: open(os.path.join(work, f"{n}.log"), "w") for n in caches}
        env = engine_env(args, caches["idle"], "manual")
        env.update(CUDA_TASK_PRIORITY="1", VGPU_TURN_DIR=turns)
        idle = subprocess.Popen([sys.executable, me, "--role", "engine", "--gib", str(gib)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs["idle"],
                                text=True)
        procs.append(idle)
        idle_pid = json.loads(idle.stdout.readline())["pid"]
        time.sleep(2.5)  # its first offers are on the board (one a second)
        env = engine_env(args, caches["urgent"], "off")
        env.update(CUDA_TASK_PRIORITY="0", VGPU_TURN_DIR=turns, VGPU_SWAP_MOVABLE="0")
        t0 = time.perf_counter()
        urgent = subprocess.Popen([sys.executable, me, "--role", "engine", "--gib", str(gib)],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=logs["urgent"], text=True)
        procs.append(urgent)
        line = urgent.stdout.readline()
        result["urgent_ready"] = bool(line)
        result["urgent_ready_s"] = time.perf_counter() - t0
        # The giver frees the device an allocation at a time, so the urgent one can be ready
        # before the last of the giver's memory has moved (it is marked swapped at the end).
        deadline = time.perf_counter() + args.timeout
        while not swapped(args.vgpu, caches["idle"], idle_pid) and time.perf_counter() < deadline:
            time.sleep(0.1)
        result["idle_swapped"] = swapped(args.vgpu, caches["idle"], idle_pid)
        result["idle_swapped_s"] = time.perf_counter() - t0
        if line:
            result["urgent_touch"] = touch(urgent)
            send(urgent, "exit")
            urgent.wait(timeout=60)
        time.sleep(0.5)
        result["idle_touch"] = touch(idle)
        send(idle, "exit")
        idle.wait(timeout=60)
        fill.stdin.close()
        fill.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for n in ("idle", "urgent"):
        with open(os.path.join(work, f"{n}.log")) as f:
            result[f"{n}_lines"] = [l.strip() for l in f if "room" in l or "swapped out" in l][-4:]
    return result


def judge_priority(result):
    u, i = result.get("urgent_touch", {}), result.get("idle_touch", {})
    ok = bool(result.get("urgent_ready")) and result.get("idle_swapped") and u.get("intact") \
        and i.get("intact")
    lines = [f"{'PASS' if ok else 'FAIL'} swap for a more urgent container ({result['gib']} GiB each in "
             f"{result['room_gib']} GiB of room): urgent engine ready in "
             f"{result.get('urgent_ready_s', 0):.2f} s, the idle one swapped: "
             f"{result.get('idle_swapped')}, urgent data {'intact' if u.get('intact') else 'WRONG/none'}, "
             f"idle back in {i.get('first_s', 0):.2f} s, {'intact' if i.get('intact') else 'WRONG/none'}"]
    lines += [f"  hook: {l}" for l in result.get("idle_lines", []) + result.get("urgent_lines", [])]
    return ok, lines


def judge_checkpoint(result):
    steps, t = result["steps"], result.get("touched", {})
    ok = len(steps) == 4 and all(v["rc"] == 0 for v in steps.values()) and t.get("intact", False)
    rate = lambda s: f"{result['gib'] * GIB / s / 1e9:.1f} GB/s"  # noqa: E731
    if ok:
        line = (f"PASS driver checkpoint of {result['gib']} GiB: out {steps['checkpoint']['s']:.2f} s "
                f"({rate(steps['checkpoint']['s'])}), restore {steps['restore']['s']:.2f} s "
                f"({rate(steps['restore']['s'])}), first touch {t['first_s']:.2f} s; NVML released "
                f"{result.get('released_bytes', 0) / GIB:.1f} GiB; data intact")
    else:
        line = f"FAIL driver checkpoint: {result.get('error') or steps} {t}"
    return ok, [line]


def judge_exits(result):
    lines, ok = [], True
    for c in result["cases"]:
        good = c["status"] == 0 and c["left_on_gpu"] < 256 << 20
        ok &= good
        lines.append(f"{'PASS' if good else 'FAIL'} exit while {c['case']} (moment reached: "
                     f"{c.get('reached')}): status {c['status']}, exited in "
                     f"{c['exit_s'] if c['exit_s'] is None else round(c['exit_s'], 2)} s, "
                     f"{c['left_on_gpu'] / GIB:.2f} GiB left on the GPU")
        if not good:
            lines += [f"  hook: {l}" for l in c["hook_lines"]]
    return ok, lines


def judge_pair(result):
    """PASS/FAIL per turn: the engine ran (no OOM), its data intact, its memory released when
    it idled out; the wake's time as seconds per 16 GiB."""
    lines, ok = [], len(result["turns"]) > 0
    for t in result["turns"]:
        good = bool(t.get("touched")) and t.get("intact") and t.get("idle_out_s") is not None \
            and t.get("released_bytes", 0) >= 0.9 * result["gib"] * GIB
        ok &= good
        wake = t.get("wake_s")
        per16 = f"{wake * 16 / result['gib']:.2f} s per 16 GiB" if wake is not None else "-"
        lines.append(f"{'PASS' if good else 'FAIL'} turn {t['turn']} (engine {t['engine']}, "
                     f"{result['gib']} GiB): wake {wake if wake is None else round(wake, 3)} s "
                     f"({per16}); data {'intact' if t.get('intact') else 'WRONG/none'}; "
                     f"idled out after {t.get('idle_out_s')} s, NVML released "
                     f"{t.get('released_bytes', 0) / GIB:.1f} GiB")
    shown = result["hook_lines"] if not ok else \
        [l for l in result["hook_lines"] if "swapped out" in l or "pinned" in l]
    lines += [f"  hook: {l}" for l in shown]
    return ok, lines


def judge(result):
    """PASS/FAIL lines: swapped out, memory back to the node, data intact."""
    lines, ok = [], True
    for c in result["cycles"]:
        swapped_out = c["out_s"] is not None
        released = c["released_bytes"] >= 0.9 * result["gib"] * GIB
        good = swapped_out and released and c["intact"]
        ok &= good
        rate = (f"out {c['out_s']:.2f} s ({c['out_gb_s']:.1f} GB/s), in {c['in_first_s']:.2f} s "
                f"({c['in_gb_s']:.1f} GB/s)" if swapped_out else "never swapped out")
        lines.append(f"{'PASS' if good else 'FAIL'} cycle {c['cycle']}: {rate}; NVML released "
                     f"{c['released_bytes'] / GIB:.1f} GiB of {result['gib']}; data "
                     f"{'intact' if c['intact'] else 'WRONG'}")
    if not ok:
        lines += [f"  hook: {l}" for l in result["hook_lines"]]
    return ok, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="runner", choices=("runner", "engine", "filler"))
    ap.add_argument("--lib", help="libvgpu.so")
    ap.add_argument("--vgpu", help="the vgpu CLI")
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--expandable", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a swap-out")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to leave the engine swapped out before its touch (the background "
                         "pinning of staged bytes runs meanwhile)")
    ap.add_argument("--pair", action="store_true", help="two engines taking turns")
    ap.add_argument("--room", type=int, default=40, help="--pair: GiB the filler leaves free")
    ap.add_argument("--turns", type=int, default=6, help="--pair: turns in all")
    ap.add_argument("--idle", default="1s", help="--pair: the engines' VGPU_IDLE_SWAP")
    ap.add_argument("--priority", action="store_true",
                    help="an urgent engine gets the room an idle, less urgent one gives")
    ap.add_argument("--checkpoint", action="store_true",
                    help="the driver's checkpoint API on the same engine without the hook")
    ap.add_argument("--exits", action="store_true",
                    help="exit while pinning ahead, while swapping out, while swapped out")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/swap-torch"))
    args = ap.parse_args()
    if args.role == "engine":
        return engine(args.gib)
    if args.role == "filler":
        return filler(args.room)
    try:
        import torch  # noqa: F401
        have_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except (ImportError, FileNotFoundError):
        have_gpu = False
    if not have_gpu:
        print("SKIP: needs PyTorch and an NVIDIA GPU")
        return 0
    if not args.checkpoint and not (args.lib and args.vgpu):
        ap.error("--lib and --vgpu are needed")
    run_it, judge_it = (run_pair, judge_pair) if args.pair else \
        (run_exits, judge_exits) if args.exits else \
        (run_checkpoint, judge_checkpoint) if args.checkpoint else \
        (run_priority, judge_priority) if args.priority else (run, judge)
    result = run_it(args)
    ok, lines = judge_it(result)
    for line in lines:
        print(line)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "swap_torch.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
