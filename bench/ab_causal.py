#!/usr/bin/env python3
"""A/B of the causal-attention kernel: runs two bench_causal binaries (the previous main's and
this tree's, e.g. both compute_52 PTX builds) alternately, ROUNDS times each, in one run on one
GPU, and writes a table of each shape's best time per side and the ratio (new / base).

    bench/ab_causal.py OUTDIR --base BIN --new BIN [--rounds N]

OUTDIR gets ab_causal.md and ab_causal.json (rewritten after every round, so a run cut short
keeps its finished rounds), and every run's JSON."""
import argparse
import json
import os
import subprocess
import sys


def write(out, device, rounds, best):
    """The table of the rounds so far (best time a side per shape), as markdown and JSON."""
    rows = []
    for key in sorted(best["new"]):
        b, n = best["base"].get(key), best["new"][key]
        rows.append({"kind": key[0], "head_dim": key[1], "T": key[2], "P": key[3],
                     "base_us": b, "new_us": n, "ratio": n / b if b else None})
    with open(os.path.join(out, "ab_causal.json"), "w") as f:
        json.dump({"device": device, "rounds": rounds, "rows": rows}, f, indent=1)
    lines = [f"# Causal A/B on {device} (best of {rounds} alternating rounds a side)", "",
             "| kind | head_dim | T | P | base µs | new µs | new/base |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        base = f"{r['base_us']:.1f}" if r["base_us"] else "-"
        lines.append(f"| {r['kind']} | {r['head_dim']} | {r['T']} | {r['P']} | {base} | "
                     f"{r['new_us']:.1f} | {ratio} |")
    worst = max((r["ratio"] for r in rows if r["ratio"]), default=None)
    if worst is not None:
        lines += ["", f"Slowest ratio: {worst:.3f}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "ab_causal.md"), "w") as f:
        f.write(text)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--base", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    best = {"base": {}, "new": {}}
    device = ""
    text = write(a.out, device, 0, best)  # an empty table: none left from an earlier run
    for r in range(a.rounds):
        for side, binary in (("base", a.base), ("new", a.new)):
            path = os.path.join(a.out, f"causal_{side}_{r}.json")
            subprocess.run([binary, path], check=True, stdout=subprocess.DEVNULL)
            with open(path) as f:
                run = json.load(f)
            device = run["device"]
            for row in run["rows"]:
                key = (row["kind"], row["head_dim"], row["T"], row["P"])
                best[side][key] = min(best[side].get(key, float("inf")), row["us"])
        text = write(a.out, device, r + 1, best)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
