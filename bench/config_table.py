#!/usr/bin/env python3
"""Table of a run of several builds or settings over the same shapes, each in rounds: per shape,
the first setting's time (the faster round; CUDA-graph per-call time where measured, else eager)
and each other's over it. Every check must have passed.

  bench/config_table.py PATTERN [FIRST]

PATTERN names one setting's JSON of one round, with {r} for the round and {cfg} for the
setting, e.g. 'bench/results_l2/h200/variants/r{r}_{cfg}.json'; the settings are those of round
1, FIRST (default: base) first.
"""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402


def times(pattern, cfg):
    out, r = {}, 1
    while os.path.exists(pattern.format(r=r, cfg=cfg)):
        with open(pattern.format(r=r, cfg=cfg)) as f:
            for s in json.load(f)["shapes"]:
                assert s["check"] == "pass", (cfg, r, grid.shape_key(s))
                k = grid.shape_key(s)
                out[k] = min(out.get(k, float("inf")), s["time_us"])
        r += 1
    return out


def main():
    pattern, first = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "base"
    head, tail = pattern.format(r=1, cfg="\0").split("\0")
    paths = glob.glob(pattern.format(r=1, cfg="*"))
    cfgs = sorted((p[len(head):len(p) - len(tail)] for p in paths), key=lambda c: (c != first, c))
    t = {c: times(pattern, c) for c in cfgs}
    print(f"| shape | {first} µs | " + " | ".join(cfgs[1:]) + " |")
    print("|---" * (len(cfgs) + 1) + "|")
    for k, base in t[first].items():
        print(f"| {grid.shape_str(k)} | {base:.2f} | " +
              " | ".join(f"{t[c][k] / base:.3f}" for c in cfgs[1:]) + " |")


if __name__ == "__main__":
    main()
