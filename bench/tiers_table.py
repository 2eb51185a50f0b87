#!/usr/bin/env python3
"""Table of a bench/tiers.sh run: per shape, each uniform format and tiered cache's µs per call,
K/V bytes, bandwidth as a share of the copy bandwidth, and the tier kernels against the tuned
uniform kernel over the same bytes (one tier of Q4Q3 against uniform Q4Q3).

  bench/tiers_table.py OUTDIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402

RUNS = ["Q8", "Q4Q3", "Q4Q2", "tier-Q4Q3", "tiers-4"]


def main():
    out = sys.argv[1]
    runs = grid.load_runs(out, RUNS)
    if "Q4Q3" not in runs:
        print("tiers: no Q4Q3 run")
        return 1
    dev = runs["Q4Q3"].get("device", {}).get("name", "?")
    print(f"Tiered caches on {dev}, copy {runs['Q4Q3'].get('copy_gbps', 0):.0f} GB/s")
    print("| shape | cache | us | K/V MB | % copy | time / uniform Q4Q3's, per byte | check |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    base = {grid.shape_key(s): s for s in runs["Q4Q3"]["shapes"] if s.get("time_us")}
    for k, b in base.items():
        for name in RUNS:
            s = grid.shape_in(runs.get(name, {}), k)
            if not s or not s.get("time_us"):
                continue
            per_byte = (s["time_us"] / s["kv_bytes"]) / (b["time_us"] / b["kv_bytes"])
            rows.append({"shape": list(k), "cache": name, "time_us": s["time_us"],
                         "kv_bytes": s["kv_bytes"], "share_copy": s.get("share_copy"),
                         "per_byte_vs_uniform": per_byte, "check": s.get("check")})
            print(f"| {grid.shape_str(k)} | {name} | {s['time_us']:.2f} | "
                  f"{s['kv_bytes'] / 1e6:.1f} | {100 * (s.get('share_copy') or 0):.0f}% | "
                  f"{per_byte:.2f}x | {s.get('check')} |")
    with open(os.path.join(out, "tiers.json"), "w") as fh:
        json.dump({"device": dev, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
