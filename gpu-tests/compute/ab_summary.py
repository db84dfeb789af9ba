"""Summarizes ab.sh's runs: for each build (a folder of OUT), scenario, mode and tenant, the
median over rounds of thr % (against that invocation's own alone run) and GPU % (a), with
every round's value, as one markdown table.

usage: python3 ab_summary.py <out>      (reads <out>/<build>/r<N>/compute.json)
"""
import glob
import json
import os
import statistics
import sys


def rows(out):
    """(build, scenario, mode, tenant index, round, thr %, GPU %) for every tenant result."""
    found = []
    for path in sorted(glob.glob(os.path.join(out, "*", "r*", "compute.json"))):
        build = path.split(os.sep)[-3]
        rnd = int(path.split(os.sep)[-2][1:])
        with open(path) as f:
            summary = json.load(f).get("summary", {})
        for scenario, modes in summary.items():
            for mode, row in modes.items():
                for i, t in enumerate(row.get("tenants", [])):
                    if t.get("thr_pct") is None:
                        continue
                    found.append((build, scenario, mode, i, rnd, t["thr_pct"], t.get("share_a")))
    return found


def table(found):
    groups = {}
    for build, scenario, mode, i, rnd, thr, gpu in found:
        groups.setdefault((scenario, mode, i, build), []).append((rnd, thr, gpu))
    lines = ["| scenario | mode | tenant | build | rounds | median thr % | median GPU % | thr % by round |",
             "|---|---|---|---|---|---|---|---|"]
    for (scenario, mode, i, build), vals in sorted(groups.items()):
        vals.sort()
        thr = statistics.median(v[1] for v in vals)
        gpus = [v[2] for v in vals if v[2] is not None]
        gpu = f"{statistics.median(gpus):.1f}" if gpus else "-"
        by_round = ", ".join(f"r{r} {t:.1f}" for r, t, _ in vals)
        lines.append(f"| {scenario} | {mode} | {i} | {build} | {len(vals)} | {thr:.1f} | {gpu} | {by_round} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = rows(argv[1])
    if not found:
        print(f"no compute.json under {argv[1]}/<build>/r<N>/", file=sys.stderr)
        return 1
    print(table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
