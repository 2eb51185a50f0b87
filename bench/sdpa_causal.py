#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention on bench_causal's shapes (issue 17's side by side).

One sequence: Q [1, 32, T, D] (T new rows) against K/V [1, 8, P + T, D], the rows aligned to the
bottom right (row i sees positions 0 .. P + i, torch.nn.attention.bias.causal_lower_right), GQA
through enable_gqa=True. Run in fp16 (what a model would hand PyTorch: its tensor-core flash /
cuDNN kernels) and in fp32 (the precision of m40llm's FP32 causal kernel), with PyTorch's own
choice of backend. Time: CUDA events around REPS calls after a warm-up, the median of 5 such runs,
per call; FLOP/s as bench_causal counts them (4 x head_dim per query head and visible position).
When --m40llm names bench_causal's JSON, the table puts m40llm's time beside PyTorch's.

Usage: sdpa_causal.py OUT.json [--m40llm bench_causal.json]"""
import argparse
import json
import statistics

HEADS, KV_HEADS = 32, 8
PREFILL_T, PREFILL_P = [512, 1024, 2048, 4096, 8192], [0, 4096, 32768]
SPEC_T, SPEC_P = [2, 4, 16], [4096, 32768]
SHORT_T, SHORT_P = [32, 64, 128, 256], [4096]


def shapes():
    for dim in (128, 64, 256):  # bench_causal's shapes
        for p in PREFILL_P:
            for t in PREFILL_T:
                if not (p == 32768 and t > 2048 and dim != 128):
                    yield "prefill", dim, t, p
        for p in SPEC_P:
            for t in SPEC_T:
                yield "spec", dim, t, p
        for p in SHORT_P:
            for t in SHORT_T:
                yield "short", dim, t, p


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--m40llm", default="")
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    ours = {}
    if a.m40llm:
        with open(a.m40llm) as f:
            for r in json.load(f)["rows"]:
                ours[(r["kind"], r["head_dim"], r["T"], r["P"])] = r["us"]
    dev = torch.device("cuda")
    rows = []
    print(f"{'kind':8} {'D':>4} {'T':>5} {'P':>6} {'fp16 us':>10} {'fp32 us':>10} "
          f"{'m40llm us':>10} {'m40/fp32':>9}")
    for kind, dim, t, p in shapes():
        flops = HEADS * 4.0 * dim * (t * p + t * (t + 1) / 2.0)
        row = {"kind": kind, "head_dim": dim, "T": t, "P": p, "flops": flops}
        for dtype, name in ((torch.float16, "fp16"), (torch.float32, "fp32")):
            q = torch.randn(1, HEADS, t, dim, device=dev, dtype=dtype)
            k = torch.randn(1, KV_HEADS, p + t, dim, device=dev, dtype=dtype)
            v = torch.randn_like(k)
            mask = causal_lower_right(t, p + t)
            call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            try:
                try:
                    call()
                except Exception:  # this torch's causal bias without GQA: K/V expanded, untimed
                    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    call = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    row["gqa"] = "expanded"
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                call()
                e1.record()
                torch.cuda.synchronize()
                reps = max(1, min(200, int(20.0 / max(e0.elapsed_time(e1), 1e-3))))
                times = []
                for _ in range(5):
                    e0.record()
                    for _ in range(reps):
                        call()
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3 / reps)
                row[name + "_us"] = statistics.median(times)
            except Exception as e:  # a shape a backend refuses: say so in the row
                row[name + "_us"] = None
                row[name + "_error"] = str(e)[:200]
            del q, k, v
            torch.cuda.empty_cache()
        m = ours.get((kind, dim, t, p))
        row["m40llm_us"] = m
        fmt = lambda x: f"{x:10.1f}" if x else f"{'-':>10}"
        ratio = f"{m / row['fp32_us']:9.2f}" if m and row.get("fp32_us") else f"{'-':>9}"
        print(f"{kind:8} {dim:4} {t:5} {p:6} {fmt(row.get('fp16_us'))} {fmt(row.get('fp32_us'))} "
              f"{fmt(m)} {ratio}", flush=True)
        rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
