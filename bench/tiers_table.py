#!/usr/bin/env python3
"""Table of a bench/tiers.sh run: per shape, each uniform format and tiered cache's µs per call,
K/V bytes, bandwidth as a share of the copy bandwidth, and each tiered cache against the uniform
caches: per byte against uniform Q4Q3, and against its tiers' uniform formats (the uniform calls'
times weighted by each tier's share of the rows: what the same rows cost in caches of one format
each; one tier of Q4Q3 against uniform Q4Q3).

  bench/tiers_table.py OUTDIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402

UNIFORM = ["Q8", "Q8Q4", "Q4Q3", "Q4Q2"]
# Each tiered run's tiers as bench/tiers.sh makes them: the uniform run of each tier's formats
# and its share of the quantized rows (OUTDIR/mixes.txt where tiers.sh wrote one).
MIXES = {"tier-Q4Q3": {"Q4Q3": 1.0},
         "tiers-4": {"Q8": 0.25, "Q8Q4": 0.25, "Q4Q3": 0.25, "Q4Q2": 0.25}}


def read_mixes(out):
    path = os.path.join(out, "mixes.txt")
    if not os.path.exists(path):
        return MIXES
    mixes = {}
    for line in open(path):
        if line.strip():
            name, spec = line.split()
            mixes[name] = {("Q8" if f == "Q8Q8" else f): float(w)
                           for f, w in (part.split(":") for part in spec.split(","))}
    return mixes


def main():
    out = sys.argv[1]
    mixes = read_mixes(out)
    RUNS = UNIFORM + list(mixes)
    runs = grid.load_runs(out, RUNS)
    if "Q4Q3" not in runs:
        print("tiers: no Q4Q3 run")
        return 1
    dev = runs["Q4Q3"].get("device", {}).get("name", "?")
    print(f"Tiered caches on {dev}, copy {runs['Q4Q3'].get('copy_gbps', 0):.0f} GB/s")
    print("| shape | cache | us | K/V MB | % copy | time / uniform Q4Q3's, per byte | "
          "time / its tiers' uniform formats' | check |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    base = {grid.shape_key(s): s for s in runs["Q4Q3"]["shapes"] if s.get("time_us")}
    for k, b in base.items():
        for name in RUNS:
            s = grid.shape_in(runs.get(name, {}), k)
            if not s or not s.get("time_us"):
                continue
            per_byte = (s["time_us"] / s["kv_bytes"]) / (b["time_us"] / b["kv_bytes"])
            mix = None
            if name in mixes:
                parts = [(grid.shape_in(runs.get(u, {}), k), w) for u, w in mixes[name].items()]
                if all(u and u.get("time_us") for u, _ in parts):
                    mix = s["time_us"] / sum(u["time_us"] * w for u, w in parts)
            rows.append({"shape": list(k), "cache": name, "time_us": s["time_us"],
                         "kv_bytes": s["kv_bytes"], "share_copy": s.get("share_copy"),
                         "per_byte_vs_uniform": per_byte, "vs_tier_formats": mix,
                         "check": s.get("check")})
            print(f"| {grid.shape_str(k)} | {name} | {s['time_us']:.2f} | "
                  f"{s['kv_bytes'] / 1e6:.1f} | {100 * (s.get('share_copy') or 0):.0f}% | "
                  f"{per_byte:.2f}x | {f'{mix:.2f}x' if mix else ''} | {s.get('check')} |")
    with open(os.path.join(out, "tiers.json"), "w") as fh:
        json.dump({"device": dev, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
