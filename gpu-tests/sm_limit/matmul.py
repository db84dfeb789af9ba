"""PyTorch matmul loop for the SM-limit benchmark.

usage: python3 matmul.py <n> <seconds>
Multiplies two random n×n bf16 matrices back to back for <seconds> after a warm-up of
$MATMUL_WARMUP_S seconds (default 0.5; the GPU's clock and the limiter's learned launch costs
settle in it) and prints "RESULT matmuls_per_s=<f> ms_per_matmul=<f> wall_s=<f>". With
$MATMUL_START_AT (a time.time() value) the timed loop starts then, so that two processes
measure the same window.
"""
import os
import sys
import time

import torch

n, seconds = int(sys.argv[1]), float(sys.argv[2])
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
# One timed matmul alone: the kernel's own duration.
torch.matmul(a, b, out=c)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
torch.matmul(a, b, out=c)
e.record()
e.synchronize()
one_ms = s.elapsed_time(e)
warmup = float(os.environ.get("MATMUL_WARMUP_S", "0.5"))
start_at = os.environ.get("MATMUL_START_AT")
t = time.monotonic()
while time.monotonic() - t < warmup or (start_at and time.time() < float(start_at)):
    torch.matmul(a, b, out=c)
torch.cuda.synchronize()
count = 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    torch.matmul(a, b, out=c)
    count += 1
torch.cuda.synchronize()
wall = time.monotonic() - t0
assert torch.isfinite(c.float()).all()
print(f"RESULT matmuls_per_s={count / wall:.3f} ms_per_matmul={one_ms:.3f} wall_s={wall:.3f}")
