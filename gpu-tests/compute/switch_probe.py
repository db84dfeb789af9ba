"""Summarise switch_probe.sh's JSON lines: per label, each process's share of the GPU (its
kernels × the kernel's alone time / the window) and their sum; the loss is 1 - the sum, the
alone deep run of the same kernel being the reference (its own share, ~1)."""
import json
import sys
from collections import defaultdict


def summary(lines):
    runs = defaultdict(list)
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            runs[r["label"]].append(r)
    out = ["| run | kernel µs | shares | sum | loss % |", "|---|---|---|---|---|"]
    for label, rs in runs.items():
        shares = [r["gpu_s"] / r["wall_s"] for r in sorted(rs, key=lambda r: r["role"])]
        total = sum(shares)
        out.append(f"| {label} | {rs[0]['kernel_us']:.1f} | {' / '.join(f'{s:.3f}' for s in shares)} "
                   f"| {total:.3f} | {100 * (1 - total):.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summary(f))
