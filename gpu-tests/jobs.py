"""Framework workloads the acceptance tests run as child processes (under libvgpu.so or bare).

    python3 jobs.py torch_meminfo
    python3 jobs.py torch_oom CHUNK_MB
    python3 jobs.py torch_train STEPS [WIDTH]
    python3 jobs.py torch_hold MB            (holds until stdin closes or a line arrives)
    python3 jobs.py torch_matmuls N          (N matmuls, cuBLAS fp16/fp32, a reduction; then holds)
    python3 jobs.py torch_step_time STEPS    (benchmark: ms per training step)
    python3 jobs.py cupy_oom CHUNK_MB
    python3 jobs.py jax_alloc MB [MB ...]

Output: key=value lines.
"""
import sys
import time


def out(k, v):
    print(f"{k}={v}", flush=True)


def torch_meminfo():
    import torch

    free, total = torch.cuda.mem_get_info()
    out("free", free)
    out("total", total)
    out("device", torch.cuda.get_device_name(0))


def torch_oom(chunk_mb):
    import torch

    free0, total = torch.cuda.mem_get_info()
    out("total", total)
    out("free_start", free0)
    chunk = chunk_mb << 20
    held = []
    err = "none"
    try:
        while True:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        err = "OutOfMemoryError"
        out("message", str(e).splitlines()[0][:200])
    except Exception as e:  # noqa: BLE001 - reported, the test decides
        err = type(e).__name__
        out("message", str(e).splitlines()[0][:200])
    out("error", err)
    out("tensors", len(held))
    out("allocated", torch.cuda.memory_allocated())
    out("reserved", torch.cuda.memory_reserved())
    free1, _ = torch.cuda.mem_get_info()
    out("free_at_oom", free1)
    del held
    torch.cuda.empty_cache()
    free2, _ = torch.cuda.mem_get_info()
    out("free_after", free2)


def _model(width):
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    ).cuda()


def torch_train(steps, width=2048):
    import torch

    torch.manual_seed(0)
    model = _model(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(512, width, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    out("steps", steps)
    out("loss_first", f"{losses[0]:.4f}")
    out("loss_last", f"{losses[-1]:.4f}")
    out("seconds", f"{time.perf_counter() - t0:.3f}")
    out("max_reserved", torch.cuda.max_memory_reserved())
    free, total = torch.cuda.mem_get_info()
    out("free", free)
    out("total", total)


def torch_step_time(steps, width=4096):
    import torch

    torch.manual_seed(0)
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1024, width, device="cuda")
    y = torch.randint(0, 10, (1024,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    out("step_ms_median", f"{times[len(times) // 2] * 1e3:.4f}")
    out("step_ms_mean", f"{sum(times) / len(times) * 1e3:.4f}")


def torch_hold(mb):
    import torch

    t = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
    t.fill_(1)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out("held", mb)
    out("free", free)
    out("total", total)
    sys.stdin.readline()
    del t
    out("released", 1)


def torch_matmuls(n):
    """A few matmuls (cuBLAS, whose kernels load lazily), a half-precision GEMM and a
    reduction; then, after the hook's rate limit has passed, a memory view (which reconciles
    the accounting with NVML), and hold while the caller compares the two."""
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(n):
        a = torch.relu(a @ a) / 2048
    h = torch.randn(1024, 4096, device="cuda", dtype=torch.half)
    g = h @ h.T
    s = float(g.float().sum().item()) + float(a.sum().item())
    torch.cuda.synchronize()
    time.sleep(0.3)  # past VGPU_RECONCILE_MS (100 ms by default)
    free, total = torch.cuda.mem_get_info()
    out("checksum_finite", int(s == s))
    out("free", free)
    out("total", total)
    out("reserved", torch.cuda.memory_reserved())
    out("ready", 1)
    sys.stdin.readline()
    out("released", 1)


def cupy_oom(chunk_mb):
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    out("free", free)
    out("total", total)
    held = []
    err = "none"
    try:
        while True:
            held.append(cupy.empty(chunk_mb << 20, dtype=cupy.uint8))
    except cupy.cuda.memory.OutOfMemoryError:
        err = "OutOfMemoryError"
    except Exception as e:  # noqa: BLE001
        err = type(e).__name__
    out("error", err)
    out("arrays", len(held))
    out("allocated", len(held) * (chunk_mb << 20))
    a = cupy.arange(1000, dtype=cupy.float32)
    out("sum_ok", int(float(a.sum()) == 499500.0))


def jax_alloc(*mbs):
    import jax
    import jax.numpy as jnp

    out("devices", len(jax.devices()))
    stats = jax.devices()[0].memory_stats() or {}
    out("bytes_limit", stats.get("bytes_limit", -1))
    for mb in mbs:
        try:
            a = jnp.ones((mb << 20) // 4, dtype=jnp.float32)
            a.block_until_ready()
            out(f"alloc_{mb}", "ok")
            out(f"sum_{mb}", int(a[:1024].sum()))
            del a
        except Exception as e:  # noqa: BLE001
            out(f"alloc_{mb}", type(e).__name__)
            out(f"message_{mb}", str(e).splitlines()[0][:200])


def main():
    cmd, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    {
        "torch_meminfo": torch_meminfo,
        "torch_oom": torch_oom,
        "torch_train": torch_train,
        "torch_step_time": torch_step_time,
        "torch_hold": torch_hold,
        "torch_matmuls": torch_matmuls,
        "cupy_oom": cupy_oom,
        "jax_alloc": jax_alloc,
    }[cmd](*args)


if __name__ == "__main__":
    main()
