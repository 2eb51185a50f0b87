#!/usr/bin/env python3
"""Runs bench_attention and sdpa_bench.py over the same grid and compares them side by side.

  compare.py --bin build/bench/bench_attention --outdir OUT [--quick] [--batch ..] [--ctx ..]
             [--heads ..] [--dim ..] [--m40-json F] [--sdpa-json F] [--skip-sdpa]

Writes OUT/m40llm.json, OUT/sdpa.json (raw), OUT/compare.json (both raw plus the merged rows)
and OUT/compare.md. --m40-json / --sdpa-json reuse existing results instead of running.

Targets, per shape (PASS when every one that applies holds):
  copy92  K/V >= 256 MiB: m40llm reaches >= 92% of the copy bandwidth (read+write) of its run
  faster  m40llm time <= the fastest PyTorch backend's time
  x1.5    where that backend is under 60% of copy bandwidth: PyTorch time / m40llm time >= 1.5
  graph   batch 1, ctx <= 2048: CUDA-graph per-call time <= bytes / copy bandwidth + 4 us
  check   m40llm's output check passed
m40llm time = its CUDA-graph per-call time where measured, else eager back-to-back calls;
PyTorch time = CUDA-graph replays. Shares use each side's own bytes (FP32 vs FP16 Q/out) over
bench_attention's copy bandwidth.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import grid  # noqa: E402

BIG = 256 << 20


def log(*a):
    print(*a, flush=True)


def run(cmd, timeout):
    log("compare: running " + " ".join(cmd))
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        log(f"compare: timed out after {timeout} s; using what was written so far")
        rc = "timeout"
    except OSError as e:
        log(f"compare: cannot run: {e}")
        rc = "oserror"
    log(f"compare: exit {rc} after {time.time() - t0:.0f} s")
    return rc


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        log(f"compare: cannot read {path}: {e}")
        return None


def fnum(x, fmt):
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def pct(x):
    return f"{100 * x:.0f}%" if isinstance(x, (int, float)) else "-"


def merge(m40, sdpa):
    copy = (m40 or {}).get("copy_gbps") or (sdpa or {}).get("copy_gbps")
    read = (m40 or {}).get("read_gbps")
    mrows = {grid.shape_key(d): d for d in (m40 or {}).get("shapes", [])}
    srows = {grid.shape_key(d): d for d in (sdpa or {}).get("shapes", [])}
    keys = list(mrows) + [k for k in srows if k not in mrows]
    rows = []
    for key in keys:
        m, s = mrows.get(key), srows.get(key)
        b, h, hkv, d, l = key
        kvb = grid.kv_bytes(key)
        row = {"batch": b, "n_heads": h, "n_kv_heads": hkv, "head_dim": d, "ctx": l, "kv_bytes": kvb,
               "m40_status": m["status"] if m else "missing", "m40_note": m.get("note", "") if m else "",
               "torch_status": s["status"] if s else "missing"}
        mt = m.get("time_us") if m and m.get("status") == "ok" else None
        if mt:
            row.update(m40_us=mt, m40_src=m.get("time_source"), m40_eager_us=m.get("eager_us"),
                       m40_graph_us=m.get("graph_us"), m40_bytes=m["bytes"], m40_check=m.get("check"),
                       m40_check_err=m.get("check_max_abs_err"),
                       m40_share_copy=m["bytes"] / (mt * 1e3) / copy if copy else None,
                       m40_share_read=m["bytes"] / (mt * 1e3) / read if read else None)
        tt = s.get("best_us") if s and s.get("status") == "ok" else None
        if tt:
            row.update(torch_backend=s["best_backend"], torch_us=tt, torch_gqa_mode=s.get("best_gqa_mode"),
                       torch_share_copy=s["bytes"] / (tt * 1e3) / copy if copy else None,
                       torch_all={n: r.get("time_us") for n, r in s.get("backends", {}).items() if r.get("ok")})
        if mt and tt:
            row["ratio"] = tt / mt

        # Targets.
        t = {}
        if mt:
            if kvb >= BIG:
                t["copy92"] = row["m40_share_copy"] is not None and row["m40_share_copy"] >= 0.92
            if tt:
                t["faster"] = mt <= tt
                if row["torch_share_copy"] is not None and row["torch_share_copy"] < 0.60:
                    t["x1.5"] = tt / mt >= 1.5
            if b == 1 and l <= 2048:
                g = m.get("graph_us")
                t["graph"] = bool(isinstance(g, (int, float)) and copy and g <= m["bytes"] / (copy * 1e3) + 4.0)
                row["graph_limit_us"] = m["bytes"] / (copy * 1e3) + 4.0 if copy else None
            t["check"] = m.get("check") in ("pass", "skipped")
            row["verdict"] = "PASS" if all(t.values()) else "MISS"
        else:
            row["verdict"] = "MISS" if m and m.get("status") == "error" else "n/a"
        row["targets"] = t
        rows.append(row)
    return rows, copy, read


def targets_str(t):
    return " ".join(("" if v else "!") + k for k, v in t.items())


def table(rows, copy, read, md=False):
    hdr = ["shape", "K/V MB", "m40llm us", "src", "%copy", "%read", "PyTorch best", "us", "%copy", "ratio",
           "verdict", "targets (! = missed)"]
    lines = []
    if md:
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "|".join(["---"] * len(hdr)) + "|")
    else:
        fmt = "{:>22} {:>9} {:>10} {:>5} {:>6} {:>6} {:>14} {:>10} {:>6} {:>6} {:>7}  {}"
        lines.append(fmt.format(*hdr))
    for r in rows:
        key = (r["batch"], r["n_heads"], r["n_kv_heads"], r["head_dim"], r["ctx"])
        tb = r.get("torch_backend")
        if tb and r.get("torch_gqa_mode") == "expanded":
            tb += "(x)"
        cells = [grid.shape_str(key), f"{r['kv_bytes'] / 1e6:.2f}",
                 fnum(r.get("m40_us"), ".2f") if r.get("m40_us") else r["m40_status"], r.get("m40_src") or "-",
                 pct(r.get("m40_share_copy")), pct(r.get("m40_share_read")), tb or r["torch_status"],
                 fnum(r.get("torch_us"), ".2f"), pct(r.get("torch_share_copy")), fnum(r.get("ratio"), ".2f"),
                 r["verdict"], targets_str(r["targets"]) or r.get("m40_note", "")]
        lines.append("| " + " | ".join(cells) + " |" if md else fmt.format(*cells))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="", help="bench_attention binary")
    p.add_argument("--outdir", default="bench_out")
    grid.add_filter_args(p)
    p.add_argument("--m40-json", default="", help="use this bench_attention JSON instead of running it")
    p.add_argument("--sdpa-json", default="", help="use this sdpa_bench JSON instead of running it")
    p.add_argument("--skip-sdpa", action="store_true")
    p.add_argument("--m40-timeout", type=int, default=240)
    p.add_argument("--sdpa-timeout", type=int, default=300)
    p.add_argument("--total-timeout", type=int, default=0,
                   help="seconds for both runs together: bench_attention gets at most 45%%, sdpa_bench the rest")
    p.add_argument("--m40-args", default="", help="extra arguments for bench_attention (one string)")
    args = p.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    t_start = time.time()
    if args.total_timeout:
        args.m40_timeout = min(args.m40_timeout, int(0.45 * args.total_timeout))
    filt = grid.filter_argv(args)

    m40_path = args.m40_json or os.path.join(args.outdir, "m40llm.json")
    if not args.m40_json:
        if not args.bin:
            sys.exit("compare: need --bin or --m40-json")
        if os.path.exists(m40_path):
            os.remove(m40_path)
        run([args.bin, "--json", m40_path] + filt + args.m40_args.split(), args.m40_timeout)
    m40 = load(m40_path)

    sdpa = None
    if not args.skip_sdpa:
        sdpa_path = args.sdpa_json or os.path.join(args.outdir, "sdpa.json")
        if not args.sdpa_json:
            if os.path.exists(sdpa_path):
                os.remove(sdpa_path)
            to = args.sdpa_timeout
            if args.total_timeout:
                to = max(30, int(args.total_timeout - (time.time() - t_start) - 10))
            run([sys.executable, os.path.join(HERE, "sdpa_bench.py"), "--json", sdpa_path,
                 "--rotations-from", m40_path] + filt, to)
        sdpa = load(sdpa_path)

    rows, copy, read = merge(m40, sdpa)
    dev = ((m40 or {}).get("device") or (sdpa or {}).get("device") or {}).get("name", "?")
    n_pass = sum(r["verdict"] == "PASS" for r in rows)
    n_miss = sum(r["verdict"] == "MISS" for r in rows)
    per_target = {}
    for r in rows:
        for k, v in r["targets"].items():
            a = per_target.setdefault(k, [0, 0])
            a[0 if v else 1] += 1
    floor = (m40 or {}).get("launch_floor_us") or {}
    head = (f"device: {dev}; copy {fnum(copy, '.0f')} GB/s (read+write), read sweep {fnum(read, '.0f')} GB/s; "
            f"launch floor in a CUDA graph {fnum(floor.get('one_kernel'), '.2f')} us per call of one empty "
            f"kernel, {fnum(floor.get('two_kernels'), '.2f')} of two; "
            f"m40llm {(m40 or {}).get('library_version', '?')}"
            + (f", torch {sdpa.get('torch')}" if sdpa else ""))
    summary = (f"{n_pass} PASS, {n_miss} MISS, {len(rows) - n_pass - n_miss} n/a of {len(rows)} shapes; per target "
               + ", ".join(f"{k} {a[0]}/{a[0] + a[1]}" for k, a in per_target.items()))
    log("")
    log(head)
    log(table(rows, copy, read))
    log(summary)
    for r in rows:
        if r["verdict"] == "MISS":
            key = (r["batch"], r["n_heads"], r["n_kv_heads"], r["head_dim"], r["ctx"])
            log(f"MISS {grid.shape_str(key)}: {targets_str(r['targets']) or r['m40_status'] + ' ' + r['m40_note']}")

    doc = {"device": dev, "copy_gbps": copy, "read_gbps": read, "summary": summary, "per_target": per_target,
           "rows": rows, "m40llm": m40, "sdpa": sdpa}
    with open(os.path.join(args.outdir, "compare.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.outdir, "compare.md"), "w") as f:
        f.write("# m40llm decode attention vs PyTorch SDPA\n\n" + head + "\n\n")
        f.write("m40llm: FP32 Q/out, FP16 K/V; time = CUDA-graph per-call where measured (src graph), else "
                "back-to-back eager calls. PyTorch: FP16, CUDA-graph replays, best of flash/efficient/cudnn/math "
                "((x) = K/V expanded for GQA). %copy = bytes moved / time over the copy bandwidth "
                "(read+write); %read over the read-only sweep. ratio = PyTorch us / m40llm us.\n\n")
        f.write(table(rows, copy, read, md=True) + "\n\n" + summary + "\n")
        if m40:
            f.write("\nm40llm method: " + m40.get("method", "") + "\n")
        if sdpa:
            f.write("\nPyTorch method: " + sdpa.get("method", "") + "\n")
    log(f"compare: wrote {args.outdir}/compare.json and compare.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
