"""Joins the compute.json of several device calls of one bench (the later ones run with
--first-round after the earlier ones' rounds, so the alternation goes on) into one compute.json
and compute.md: the medians then cover every call's rounds.

    python3 gpu-tests/compute/merge.py <out-dir> <compute.json> [<compute.json> ...]

The calls must have measured the same build (the vgpu library's SHA-256, or its path in runs
that did not record one) and must
not repeat a round number; the scenarios are those of the first file that any call ran.
"""
import json
import os
import sys

import measure
import scenarios as sc
from run import summary_json


def merge(paths):
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    # The same build: by content where the runs recorded it, else by path.
    libs = {d["meta"].get("libs", {}).get("vgpu_sha256") or d["meta"].get("libs", {}).get("vgpu")
            for d in docs}
    if len(libs) > 1:
        raise ValueError(f"the calls measured different vgpu libraries: {sorted(map(str, libs))}")
    runs, seen = [], {}
    for p, d in zip(paths, docs):
        for r in {run["round"] for run in d["runs"]}:
            if r in seen:
                raise ValueError(f"round {r} is in both {seen[r]} and {p}: run the later call with --first-round")
            seen[r] = p
        runs += d["runs"]
    names = []
    for d in docs:
        names += [n for n in d["meta"]["scenarios"] if n not in names]
    kept = [sc.SCENARIOS[n] for n in names]
    meta = dict(docs[0]["meta"])
    meta["rounds"] = len(seen)
    meta["merged_from"] = [{"path": p, "date": d["meta"].get("date"), "rounds": sorted({r["round"] for r in d["runs"]})}
                           for p, d in zip(paths, docs)]
    for key in ("failures", "warnings", "skipped"):
        meta[key] = [x for d in docs for x in d["meta"].get(key, [])]
    return meta, runs, kept


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        raise SystemExit(__doc__)
    out, paths = argv[0], argv[1:]
    try:
        meta, runs, kept = merge(paths)
    except (ValueError, KeyError, OSError) as e:
        raise SystemExit(f"merge.py: {e}")
    summary = measure.summarize(runs, kept)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compute.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary_json(summary), "runs": runs}, f, indent=1)
    with open(os.path.join(out, "compute.md"), "w") as f:
        f.write(measure.report(summary, kept, meta))
    print(f"merged {len(paths)} call(s), rounds {sorted({r['round'] for r in runs})}: {out}/compute.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
