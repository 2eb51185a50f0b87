#!/usr/bin/env python3
"""What the attention weights cost (m40llm_kvcache_attn_weights_ex), or the importance
(m40llm_kvcache_attn_importance_ex, --mode importance): bench_attention over the same shapes with
and without --weights (--importance), alternating rounds in one run, per K/V format. Prints a
table (and writes OUT/MODE.md and OUT/MODE.json): the plain call's time, the call with the
export, their ratio, and the cost amortized over a step interval (every 4th step, the bucket
policy's default: (with - plain) / (4 x plain)).

    python3 bench/weights_cost.py OUT --bin build/bench/bench_attention [--rounds 2]
        [--formats F16,Q4] [--shape B,H,Hkv,D,L ...] [--interval 4] [--mode importance]
        [--tiers Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25]

--tiers adds a tiered cache of those tiers (bench_attention --tiers) as the format "tiers".
--list-shapes prints the default shapes.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

SHAPES = ["1,32,8,128,8192", "1,32,8,128,32768", "8,32,8,128,8192", "32,32,8,128,2048",
          "1,32,32,128,32768", "8,64,8,128,8192", "1,9,3,64,2048", "8,9,3,64,8192",
          "1,16,8,256,8192"]


def run(binary, fmt, shapes, mode, path, tiers=None):
    cmd = [binary, "--json", path, "--budget-ms", "150", "--no-check"]
    cmd += ["--tiers", tiers] if fmt == "tiers" else ["--format", fmt]
    for s in shapes:
        cmd += ["--shape", s]
    if mode:
        cmd.append("--" + mode)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        d = json.load(f)
    return {tuple(s[k] for k in ("batch", "n_heads", "n_kv_heads", "head_dim", "ctx")): s
            for s in d["shapes"] if s.get("time_us")}


def main():
    if sys.argv[1:] == ["--list-shapes"]:  # for scripts/gpu_check.sh's abexport
        print(" ".join(SHAPES))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bin", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", default="F16,Q4")
    ap.add_argument("--shape", action="append")
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--mode", choices=["weights", "importance"], default="weights")
    ap.add_argument("--tiers")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    shapes = a.shape or SHAPES
    rows, table = [], []
    for fmt in a.formats.split(",") + (["tiers"] if a.tiers else []):
        times = {False: {}, True: {}}
        for r in range(a.rounds):
            for w in (False, True):
                res = run(a.bin, fmt, shapes, a.mode if w else None,
                          os.path.join(a.out, f"{a.mode}_{fmt}_{int(w)}_{r}.json"), a.tiers)
                for k, s in res.items():
                    times[w].setdefault(k, []).append(s["time_us"])
        for k in sorted(times[False], key=lambda k: shapes.index(",".join(map(str, k)))):
            if k not in times[True]:
                continue
            p, w = statistics.median(times[False][k]), statistics.median(times[True][k])
            row = {"format": fmt, "shape": list(k), "plain_us": p, "weights_us": w,
                   "ratio": w / p, "amortized": (w - p) / (a.interval * p)}
            rows.append(row)
            b, h, hk, d, l = k
            table.append(f"| {fmt} | B{b} {h}/{hk} D{d} L{l} | {p:.1f} | {w:.1f} | {w / p:.3f} | "
                         f"{100 * row['amortized']:+.1f}% |")
    head = [f"| format | shape | plain us | with {a.mode} us | ratio | "
            f"amortized at 1 in {a.interval} |", "|---|---|---|---|---|---|"]
    text = "\n".join(head + table)
    print(text)
    with open(os.path.join(a.out, f"{a.mode}.md"), "w") as f:
        f.write(f"bench_attention {a.bin}, medians of {a.rounds} alternating rounds\n\n{text}\n")
    with open(os.path.join(a.out, f"{a.mode}.json"), "w") as f:
        json.dump({"binary": a.bin, "mode": a.mode, "rounds": a.rounds, "interval": a.interval,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
