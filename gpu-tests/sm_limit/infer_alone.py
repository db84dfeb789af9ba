"""Batch-1 inference alone, one process: the p50/p90 latency of N requests 10 ms apart (GPT-2 6x512 from a
config, 128 tokens). Run bare and under the hook one after the other to see the hook's cost on a launch-bound
service and how much the same run moves between repeats (`elastic.py --hook-cost` alternates them instead).

usage: TAG=name [LD_PRELOAD=... env] python3 gpu-tests/sm_limit/infer_alone.py [N]
"""
import os, sys, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=256, vocab_size=8192)
model = GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).eval()
ids = torch.randint(0, 8192, (1, 128), device="cuda")
def req():
    with torch.no_grad():
        model(ids)
    torch.cuda.synchronize()
for _ in range(20): req()
lat = []
for _ in range(n):
    t = time.perf_counter(); req(); lat.append((time.perf_counter() - t) * 1e3); time.sleep(0.01)
lat.sort()
print(f"RESULT {os.environ.get('TAG','?')}: p50 {lat[len(lat)//2]:.3f} ms p90 {lat[int(len(lat)*.9)]:.3f}")
