#!/usr/bin/env python3
"""Table of an A/B run (bench/ab.sh): per shape, the median over rounds of each side's time
(CUDA-graph per-call time where measured, else eager) and new / base. Writes OUTDIR/ab.json.

  bench/ab_table.py OUTDIR
"""
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402


def load(out, side):
    times = {}
    for path in sorted(glob.glob(os.path.join(out, f"{side}_r*.json"))):
        with open(path) as f:
            d = json.load(f)
        for s in d.get("shapes", []):
            if s.get("time_us"):
                times.setdefault(grid.shape_key(s), []).append((s["time_us"], s.get("time_source", "")))
    return times


def main():
    out = sys.argv[1]
    base, new = load(out, "base"), load(out, "new")
    rows = []
    print("| shape | base us | new us | new/base | timed as | rounds |")
    print("|---|---|---|---|---|---|")
    for k in sorted(set(base) & set(new)):
        b = statistics.median(t for t, _ in base[k])
        n = statistics.median(t for t, _ in new[k])
        rows.append({"shape": list(k), "base_us": b, "new_us": n, "ratio": n / b,
                     "source": new[k][0][1], "rounds": min(len(base[k]), len(new[k]))})
        print(f"| {grid.shape_str(k)} | {b:.2f} | {n:.2f} | {n / b:.3f} | {new[k][0][1]} | "
              f"{rows[-1]['rounds']} |")
    if rows:
        worst = max(rows, key=lambda r: r["ratio"])
        best = min(rows, key=lambda r: r["ratio"])
        ratios = [r["ratio"] for r in rows]
        print(f"\n{len(rows)} shapes: new/base median {statistics.median(ratios):.3f}, "
              f"best {best['ratio']:.3f} ({grid.shape_str(tuple(best['shape']))}), "
              f"worst {worst['ratio']:.3f} ({grid.shape_str(tuple(worst['shape']))}); "
              f"slower by more than 2%: {sum(r > 1.02 for r in ratios)}")
    with open(os.path.join(out, "ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
