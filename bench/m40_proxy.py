#!/usr/bin/env python3
"""The M40 proxy grid (issue 20): the FP32 kernel, built as compute_52 PTX only (the M40's exact
code, JIT-compiled by the driver), on the GPU at hand, against that GPU's copy bandwidth.

  python3 bench/m40_proxy.py --bin BENCH52 OUTDIR [--base BASE_BENCH52] [--rounds N] [--shape ...]

BENCH52 (and BASE_BENCH52, e.g. the previous main's) are bench_attention binaries built for
52-virtual only (scripts/build_carry.sh: .gpu-carry/bench52/bench_attention). With a base, both
run over the same shapes in alternating rounds (an A/B) and the table shows both. OUTDIR gets
m40_proxy.md, m40_proxy.json and each run's JSON and log.

The grid: the shapes of issue 20's targets (K/V >= 256 MB, or >= 64 MB at batch 1), MHA and
groups 4 and 8 at head_dim 64 and 128, group 16 at 128, and head_dim 256 at groups 1 to 16. An
H100's FP32 issue rate per byte of bandwidth is close to the M40's, so the share of copy
bandwidth reached here is the proxy for the share of its 288 GB/s the M40 reaches.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

# (batch, heads, kv heads, head_dim, context)
SHAPES = [
    (1, 32, 32, 128, 32768), (8, 32, 32, 128, 8192), (32, 32, 32, 128, 2048),
    (1, 32, 8, 128, 32768), (1, 32, 8, 128, 131072), (8, 32, 8, 128, 32768),
    (32, 32, 8, 128, 8192), (32, 32, 8, 64, 8192), (64, 32, 8, 64, 2048),
    (1, 64, 8, 128, 32768), (8, 64, 8, 128, 32768), (64, 64, 8, 128, 2048),
    (8, 16, 16, 256, 8192), (8, 16, 8, 256, 8192), (8, 16, 4, 256, 16384),
    (1, 8, 1, 256, 131072), (32, 8, 1, 256, 32768), (32, 16, 1, 256, 32768),
    (1, 16, 1, 256, 131072), (8, 128, 8, 128, 8192),
]


def target(shape, kv_mb):
    """Issue 20's mark for a shape (share of copy), or None where it sets none."""
    b, h, hkv, d, _ = shape
    if kv_mb < (64 if b == 1 else 256):
        return None
    g = h // hkv
    if d == 256:
        return 0.80
    return 0.95 if g == 1 else 0.90 if g <= 4 else 0.85 if g <= 8 else None


def run(bin_path, shapes, out_json, log):
    args = [bin_path, "--json", out_json]
    for s in shapes:
        args += ["--shape", ",".join(map(str, s))]
    with open(log, "w") as f:
        rc = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT).returncode
    if not os.path.exists(out_json):
        return rc, {}, None
    d = json.load(open(out_json))
    rows = {}
    for r in d["shapes"]:
        key = (r["batch"], r["n_heads"], r["n_kv_heads"], r["head_dim"], r["ctx"])
        rows[key] = r
    return rc, rows, d.get("copy_gbps")


def name(s):
    b, h, hkv, d, l = s
    ctx = f"{l // 1024}K" if l % 1024 == 0 else str(l)
    return f"B{b} {h}/{hkv} D{d} L{ctx}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--bin", required=True, help="bench_attention built for 52-virtual")
    ap.add_argument("--base", help="the same, of the previous main (A/B)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shape", action="append", help="B,H,Hkv,D,L instead of the grid (repeatable)")
    ap.add_argument("--work", help="where each run's JSON and log go (default: OUTDIR)")
    a = ap.parse_args()
    work = a.work or a.outdir
    os.makedirs(a.outdir, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    shapes = [tuple(map(int, s.split(","))) for s in a.shape] if a.shape else SHAPES
    sides = [("new", a.bin)] + ([("base", a.base)] if a.base else [])
    times = {side: {s: [] for s in shapes} for side, _ in sides}
    info, copies, failed = {}, [], []
    for r in range(a.rounds):
        for side, path in (sides if r % 2 == 0 else sides[::-1]):
            js = os.path.join(work, f"{side}_r{r + 1}.json")
            rc, rows, copy = run(path, shapes, js, os.path.join(work, f"{side}_r{r + 1}.txt"))
            if rc != 0:
                failed.append(f"{side} round {r + 1}: exit {rc}")
            if copy:
                copies.append(copy)
            for s in shapes:
                row = rows.get(s)
                if row and row.get("status") == "ok" and row.get("time_us"):
                    times[side][s].append(row["time_us"])
                    info[s] = row
                    if row.get("check") not in ("ok", "pass", "skipped", ""):
                        failed.append(f"{side} {name(s)}: check {row.get('check')} {row.get('check_msg')}")
                elif row:
                    failed.append(f"{side} {name(s)}: {row.get('status')} {row.get('note')}")
    copy = statistics.median(copies) if copies else float("nan")
    L = [f"# M40 proxy grid: the FP32 kernel as compute_52 PTX on this GPU\n",
         f"Copy bandwidth {copy:.0f} GB/s (median of the runs' measurements); times are eager medians "
         f"(or CUDA-graph medians where a call is under 100 µs; µs), {a.rounds} round(s){', A/B alternating' if a.base else ''}. Share = bytes / time / copy. "
         "Targets (issue 20): MHA 95%, group 4 90%, group 8 85%, head_dim 256 80%, at K/V >= 256 MB "
         "(>= 64 MB at batch 1).\n"]
    hdr = "| shape | group | K/V MB |" + (" base µs | base share |" if a.base else "") + \
          " µs | share |" + (" new/base |" if a.base else "") + " target | met |"
    L += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    out_rows = []
    for s in shapes:
        if s not in info:
            L.append(f"| {name(s)} | {s[1] // s[2]} | - | no result |")
            continue
        r = info[s]
        kv_mb = r["kv_bytes"] / 1e6
        med = {side: statistics.median(t) if t else float("nan") for side, t in ((k, times[k][s]) for k, _ in sides)}
        share = {side: r["bytes"] / (med[side] * 1e-6) / (copy * 1e9) for side in med}
        tgt = target(s, kv_mb)
        met = "" if tgt is None else ("yes" if share["new"] >= tgt else "no")
        line = f"| {name(s)} | {s[1] // s[2]} | {kv_mb:.0f} |"
        if a.base:
            line += f" {med['base']:.1f} | {share['base']:.0%} |"
        line += f" {med['new']:.1f} | {share['new']:.0%} |"
        if a.base:
            line += f" {med['new'] / med['base']:.3f} |"
        line += f" {'-' if tgt is None else f'{tgt:.0%}'} | {met} |"
        L.append(line)
        out_rows.append(dict(shape=s, group=s[1] // s[2], kv_mb=kv_mb, us=med, share=share, target=tgt, met=met))
    if failed:
        L.append("\nProblems:\n" + "\n".join(f"- {f}" for f in failed))
    text = "\n".join(L) + "\n"
    open(os.path.join(a.outdir, "m40_proxy.md"), "w").write(text)
    json.dump(dict(copy_gbps=copy, rounds=a.rounds, rows=out_rows, problems=failed),
              open(os.path.join(a.outdir, "m40_proxy.json"), "w"), indent=1)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
