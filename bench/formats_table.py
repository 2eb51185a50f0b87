#!/usr/bin/env python3
"""Table of a bench/formats.sh run: per shape and format, µs per call, K/V bytes, % of the copy
bandwidth, speed-up over F16 and the byte ratio it would reach at the same bandwidth.

  bench/formats_table.py OUTDIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402

# Quantized formats run with the library's defaults (rotated, 4 sinks + 128 window in FP16);
# "-norot" without the rotation, "-plain" without either.
FORMATS = ["F16", "Q8", "Q4", "Q8Q4", "Q4Q3", "Q4Q2", "Q8-norot", "Q4-norot", "Q8-plain", "Q4-plain"]


def main():
    out = sys.argv[1]
    runs = grid.load_runs(out, FORMATS)
    if "F16" not in runs:
        print("formats: no F16 run")
        return 1
    dev = runs["F16"].get("device", {}).get("name", "?")
    print(f"K/V formats on {dev}, copy {runs['F16'].get('copy_gbps', 0):.0f} GB/s")
    print("| shape | format | us | K/V MB | % copy | vs F16 | bytes ratio | check |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    base = {grid.shape_key(s): s for s in runs["F16"]["shapes"] if s.get("time_us")}
    for k in base:
        for f in FORMATS:
            s = grid.shape_in(runs.get(f, {}), k)
            if not s or not s.get("time_us"):
                continue
            b = base[k]
            speed = b["time_us"] / s["time_us"]
            ratio = b["kv_bytes"] / s["kv_bytes"]
            rows.append({"shape": list(k), "format": f, "time_us": s["time_us"],
                         "kv_bytes": s["kv_bytes"], "share_copy": s.get("share_copy"),
                         "speedup": speed, "byte_ratio": ratio, "check": s.get("check")})
            print(f"| {grid.shape_str(k)} | {f} | {s['time_us']:.2f} | {s['kv_bytes'] / 1e6:.1f} | "
                  f"{100 * (s.get('share_copy') or 0):.0f}% | {speed:.2f}x | {ratio:.2f}x | "
                  f"{s.get('check')} |")
    with open(os.path.join(out, "formats.json"), "w") as fh:
        json.dump({"device": dev, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
