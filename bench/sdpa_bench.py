#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention decode baseline over the bench_attention grid.

fp16 Q [B, H, 1, D] against fp16 K/V [B, Hkv, L, D], every SDPA backend that accepts the shape
(FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH via torch.nn.attention.sdpa_kernel;
failures are caught per backend). GQA uses enable_gqa=True; a backend that refuses it is run on
K/V expanded to H heads beforehand (gqa_mode "expanded"; the expansion is not timed, and bytes
are still counted as the unexpanded K/V).

Timing: CUDA graph replays. R distinct K/V/Q sets (R from bench_attention's JSON when given with
--rotations-from, else the same rule: R * KV >= max(4 * L2, 256 MiB), capped); one graph holds
G >= R calls cycling through them; per-call time = replay time (cudaEvents) / G; median over
replays. bytes = KV + Q + out (fp16).

Usage: sdpa_bench.py --json out.json [--quick] [--batch ..] [--ctx ..] [--heads ..] [--dim ..]
                     [--rotations-from m40llm.json] [--backends flash,efficient,cudnn,math]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grid  # noqa: E402

BACKEND_NAMES = ["flash", "efficient", "cudnn", "math"]


def log(*a):
    print(*a, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="", help="output JSON (rewritten after every shape)")
    grid.add_filter_args(p)
    p.add_argument("--rotations-from", default="", help="bench_attention JSON: reuse its rotation per shape")
    p.add_argument("--backends", default=",".join(BACKEND_NAMES))
    p.add_argument("--rot-cap", type=int, default=2048)
    p.add_argument("--sample-ms", type=float, default=0.1, help="shortest graph replay")
    p.add_argument("--budget-ms", type=float, default=150.0, help="measured time per shape and backend")
    p.add_argument("--list", action="store_true", help="print the selected shapes and exit")
    args = p.parse_args()

    shapes = grid.select(args)
    if args.list:
        for s in shapes:
            print(*s)
        return 0

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    warnings.filterwarnings("ignore")
    backend_enum = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in backend_enum:
            sys.exit(f"sdpa_bench: unknown backend {b}")

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))

    rot_from = {}
    if args.rotations_from and os.path.exists(args.rotations_from):
        try:
            with open(args.rotations_from) as f:
                for d in json.load(f).get("shapes", []):
                    if d.get("rotation"):
                        rot_from[grid.shape_key(d)] = int(d["rotation"])
        except (OSError, ValueError) as e:
            log(f"sdpa_bench: cannot read {args.rotations_from}: {e}")

    # Does this torch take enable_gqa?
    try:
        qq = torch.zeros(1, 4, 1, 64, device=dev, dtype=torch.float16)
        kk = torch.zeros(1, 2, 8, 64, device=dev, dtype=torch.float16)
        F.scaled_dot_product_attention(qq, kk, kk, enable_gqa=True)
        has_gqa = True
    except TypeError:
        has_gqa = False
    except RuntimeError:
        has_gqa = True  # the keyword exists; the default backend choice failed

    def events(n):
        return [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    # Copy bandwidth, same method as bench_attention (bytes read + written).
    def copy_bw():
        free, _ = torch.cuda.mem_get_info()
        n = 4 << 30
        while n > (64 << 20) and 2 * n + (512 << 20) > free:
            n //= 2
        src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        ev = events(11)
        ev[0].record()
        for i in range(10):
            dst.copy_(src)
            ev[i + 1].record()
        torch.cuda.synchronize()
        r = statistics.median(2 * n / (ev[i].elapsed_time(ev[i + 1]) * 1e6) for i in range(10))
        del src, dst
        torch.cuda.empty_cache()
        return r

    copy_gbps = copy_bw()
    log(f"sdpa_bench: torch {torch.__version__} on {props.name}, L2 {l2 / 1e6:.1f} MB, "
        f"copy {copy_gbps:.0f} GB/s, enable_gqa {'yes' if has_gqa else 'no'}, {len(shapes)} shapes")

    out = {"tool": "sdpa_bench", "torch": torch.__version__, "device": {"name": props.name, "l2_bytes": l2,
           "sms": props.multi_processor_count, "total_memory": props.total_memory},
           "copy_gbps": copy_gbps, "has_enable_gqa": has_gqa,
           "method": "CUDA graph replays: median over replays of a graph of G>=R calls cycling R distinct "
                     "K/V/Q sets, divided by G; fp16 Q/K/V/out; bytes = KV + Q + out (fp16).",
           "complete": False, "shapes": []}

    def write():
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, args.json)

    log(f"{'shape':>24} {'KV MB':>9} {'R':>4} " + " ".join(f"{b + ' us':>14}" for b in backends) + "  best")
    for shape in shapes:
        b, h, hkv, d, l = shape
        kvb = grid.kv_bytes(shape)
        byts = kvb + 2 * 2 * b * h * d
        rec = {"batch": b, "n_heads": h, "n_kv_heads": hkv, "head_dim": d, "ctx": l, "kv_bytes": kvb,
               "bytes": byts, "status": "ok", "note": "", "backends": {}}
        R = rot_from.get(shape) or grid.rotation(shape, l2, args.rot_cap)
        free, _ = torch.cuda.mem_get_info()
        margin = (512 << 20) + free // 50
        while R > 1 and R * kvb + margin > free:
            R //= 2
        if R * kvb + margin > free:
            rec["status"] = "skipped"
            rec["note"] = f"needs {(kvb + margin) / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
            out["shapes"].append(rec)
            write()
            log(f"{grid.shape_str(shape):>24} {kvb / 1e6:9.2f}    - skipped: {rec['note']}")
            continue
        rec["rotation"] = R
        t0 = time.time()
        try:
            k = torch.empty((R, b, hkv, l, d), dtype=torch.float16, device=dev).uniform_(-1, 1)
            v = torch.empty_like(k).uniform_(-1, 1)
            q = torch.empty((R, b, h, 1, d), dtype=torch.float16, device=dev).uniform_(-1, 1)
        except torch.OutOfMemoryError as e:
            rec["status"] = "skipped"
            rec["note"] = "out of memory allocating K/V: " + str(e).splitlines()[0]
            out["shapes"].append(rec)
            write()
            torch.cuda.empty_cache()
            continue
        expanded = {}

        def kv_for(mode):
            if mode != "expanded":
                return k, v
            if "kv" not in expanded:
                g = h // hkv
                free2, _ = torch.cuda.mem_get_info()
                if 2 * R * kvb * g + margin > free2:
                    raise MemoryError(f"expanded K/V needs {2 * R * kvb * g / 1e9:.1f} GB")
                expanded["kv"] = (k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2))
            return expanded["kv"]

        for bname in backends:
            res = {"ok": False}
            rec["backends"][bname] = res
            modes = ["mha"] if h == hkv else (["native", "expanded"] if has_gqa else ["expanded"])
            reasons = []
            fn = None
            for mode in modes:
                caught = []
                try:
                    kk, vv = kv_for(mode)
                    kw = {"enable_gqa": True} if mode == "native" else {}

                    def fn(i, kk=kk, vv=vv, kw=kw):
                        j = i % R
                        return F.scaled_dot_product_attention(q[j], kk[j], vv[j], **kw)

                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        with sdpa_kernel([backend_enum[bname]]):
                            fn(0)
                        torch.cuda.synchronize()
                    res["gqa_mode"] = mode
                    break
                except Exception as e:  # noqa: BLE001 - any failure means "backend refuses this"
                    msg = (str(e).splitlines() or [type(e).__name__])[0][:200]
                    warn = [str(w.message).splitlines()[0][:200] for w in caught if str(w.message)]
                    reasons.append(f"{mode}: {msg}" + (f" ({warn[0]})" if warn else ""))
                    fn = None
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            if fn is None:
                res["error"] = "; ".join(reasons)
                continue
            try:
                with sdpa_kernel([backend_enum[bname]]):
                    # Rough per-call estimate (includes Python dispatch, so it errs high).
                    ev = events(2)
                    ev[0].record()
                    for i in range(3):
                        fn(i)
                    ev[1].record()
                    torch.cuda.synchronize()
                    est_ms = max(ev[0].elapsed_time(ev[1]) / 3, 1e-4)
                    G = R * max(1, math.ceil(args.sample_ms / (R * est_ms)))
                    G = min(G, max(R, 4096))
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        for i in range(2):
                            fn(i)
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        outs = [fn(i) for i in range(G)]
                for _ in range(2):
                    g.replay()
                ev = events(2)
                ev[0].record()
                g.replay()
                ev[1].record()
                torch.cuda.synchronize()
                rep_ms = max(ev[0].elapsed_time(ev[1]), 1e-3)
                reps = int(min(301, max(5, args.budget_ms / rep_ms)))
                ev = events(reps + 1)
                ev[0].record()
                for i in range(reps):
                    g.replay()
                    ev[i + 1].record()
                torch.cuda.synchronize()
                per_call = [ev[i].elapsed_time(ev[i + 1]) * 1e3 / G for i in range(reps)]
                t = statistics.median(per_call)
                res.update(ok=True, time_us=t, time_us_min=min(per_call), graph_calls=G, replays=reps,
                           gbps=byts / (t * 1e3), share_copy=byts / (t * 1e3) / copy_gbps)
                del g, outs
            except Exception as e:  # noqa: BLE001
                res["error"] = "timing: " + (str(e).splitlines() or [type(e).__name__])[0][:200]
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
            torch.cuda.empty_cache()
        del k, v, q
        expanded.clear()
        torch.cuda.empty_cache()
        ok = {n: r for n, r in rec["backends"].items() if r.get("ok")}
        if ok:
            best = min(ok, key=lambda n: ok[n]["time_us"])
            rec.update(best_backend=best, best_us=ok[best]["time_us"], best_share_copy=ok[best]["share_copy"],
                       best_gqa_mode=ok[best].get("gqa_mode"))
        else:
            rec["status"] = "error"
            rec["note"] = "no backend ran"
        rec["wall_s"] = time.time() - t0
        out["shapes"].append(rec)
        write()
        cells = []
        for bname in backends:
            r = rec["backends"][bname]
            cells.append(f"{r['time_us']:10.2f}{'x' if r.get('gqa_mode') == 'expanded' else ' '}"
                         f"{100 * r['share_copy']:3.0f}%" if r.get("ok") else f"{'-':>14}")
        log(f"{grid.shape_str(shape):>24} {kvb / 1e6:9.2f} {R:4d} " + " ".join(cells) + "  "
            + (rec.get("best_backend") or "-"))
    out["complete"] = True
    write()
    log("sdpa_bench: done ('x' marks K/V expanded for GQA; % is share of copy bandwidth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
