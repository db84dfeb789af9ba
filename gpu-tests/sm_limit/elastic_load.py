"""One tenant of the share-mode benchmark (gpu-tests/sm_limit/elastic.py runs several).

usage: python3 elastic_load.py <kind> <seconds> [--start-at T] [--idle A:B ...] [--bin S]
kind: matmul (4096³ bf16 back to back), infer (batch-1 forward passes of a small GPT-2
built from a config, no download, one request every --think seconds), train (a best-effort
training loop of a larger GPT-2 from a config, AdamW, bf16 autocast).
The timed part starts at the wall-clock time --start-at (time.time(); warm-up until then)
and lasts <seconds>; during each --idle A:B (seconds from the start) the tenant launches
nothing. Prints one JSON line: "RESULT {...}" with the rate (per second), the per-bin rates
(launch times on the host, bins of --bin seconds: under the hook a launch returns when it
is admitted, so the host's rate follows the GPU's within the depth of the tenant's queue), and for infer the
latencies (ms); with --stamps also every step's start time and latency, so that phases of
one run can be compared (a request's latency is charged to the phase it started in), and
for infer each request's launch time on the host (`host_ms`: its latency less the wait for
the GPU).
"""
import argparse
import json
import time

import torch


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["matmul", "infer", "train"])
    p.add_argument("seconds", type=float)
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--idle", action="append", default=[])
    p.add_argument("--bin", type=float, default=0.05)
    p.add_argument("--think", type=float, default=0.010)
    p.add_argument("--stamps", action="store_true", help="also print each step's start (s) and latency (ms)")
    return p.parse_args()


HOST_MS = []  # infer: each request's launch time on the host, ms


def gpt2(layers, width, heads, positions):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        n_positions=positions,
        vocab_size=8192,
    )
    return GPT2LMHeadModel(cfg).cuda()


def setup(kind):
    """Returns step() -> None (one unit of work, launched), and whether step() waits."""
    if kind == "matmul":
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
        return (lambda: torch.matmul(a, b, out=c)), False
    if kind == "infer":
        model = gpt2(6, 512, 8, 256).to(torch.bfloat16).eval()
        ids = torch.randint(0, 8192, (1, 128), device="cuda")

        def request():
            t = time.time()
            with torch.no_grad():
                model(ids)
            # How long the host took to launch the request's kernels: what the host side
            # (Python, the hook, the driver) costs, apart from waiting for the GPU.
            HOST_MS.append((time.time() - t) * 1e3)
            torch.cuda.synchronize()

        return request, True
    model = gpt2(8, 768, 12, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (8, 256), device="cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return train_step, False


def main():
    args = parse()
    idle = [tuple(float(x) for x in s.split(":")) for s in args.idle]
    step, waits = setup(args.kind)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    while time.time() < args.start_at:
        step()
        if waits:
            time.sleep(args.think)
    torch.cuda.synchronize()
    t0 = time.time()
    stamps, latencies = [], []
    while True:
        now = time.time()
        rel = now - t0
        if rel >= args.seconds:
            break
        gap = next((b for a, b in idle if a <= rel < b), None)
        if gap is not None:
            torch.cuda.synchronize()
            time.sleep(max(0.0, t0 + gap - time.time()))
            continue
        step()
        stamps.append(rel)
        if waits:
            latencies.append((time.time() - now) * 1e3)
            time.sleep(args.think)
    torch.cuda.synchronize()
    wall = time.time() - t0
    nbins = int(args.seconds / args.bin + 0.5)
    bins = [0] * nbins
    for s in stamps:
        bins[min(int(s / args.bin), nbins - 1)] += 1
    busy = args.seconds - sum(b - a for a, b in idle)
    out = {
        "kind": args.kind,
        "rate": len(stamps) / max(busy, 1e-9),
        "count": len(stamps),
        "wall_s": wall,
        "bin_s": args.bin,
        "bins": [n / args.bin for n in bins],
    }
    if args.stamps:
        out["stamps"] = [round(x, 4) for x in stamps]
        out["lat"] = [round(x, 3) for x in latencies]
        if HOST_MS:
            out["host_ms"] = [round(x, 3) for x in HOST_MS[-len(latencies):]]
    if latencies:
        lat = sorted(latencies)
        out["p50_ms"] = lat[len(lat) // 2]
        out["p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
