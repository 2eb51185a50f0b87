"""How well does past attention predict future attention? (issue 15's importance signal)

    python3 bench/fidelity/importance_recall.py [--tokens 2048 8192]

On the FP16 run's captured q/K of fidelity.py (layers 0, 2, 8, 15, 22, 29), at t0 = N - tail:
rows 4..t0-129 (the rows that hold a tier then) are ranked by
- online: the buckets' signal (cachesim.BucketCache): every `interval`-th query's attention,
  EMA (half-life in positions), max over the query heads of the KV head, queries < t0 only;
- sampled mean: the same samples, their plain mean (no EMA);
- cumulative: ZipCache's normalized score over all queries < t0 (every one, not sampled);
- future: the attention the rows get from the tail queries t0..N-1 themselves (the ideal order).
For each order, the share of the tail queries' attention mass (summed over the KV head's query
heads) that lands on the top 10 / 25 / 50% of rows; a random order gets 10 / 25 / 50%.
Results: results/importance_recall.json and a table printed (copied into buckets.md).
"""
import argparse
import glob
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cachesim as cs  # noqa: E402
import model as mdl  # noqa: E402

FRACS = (0.1, 0.25, 0.5)


def layer_recall(q, K, V, tail, interval, halflife, sinks=4, window=128):
    N, H, _ = q.shape
    G = K.shape[1]
    r = H // G
    t0 = N - tail
    Kf = K.astype(np.float16).astype(np.float32)
    Vf = V.astype(np.float16).astype(np.float32)
    e = np.zeros(N, np.int64)
    beta = 0.5 ** (interval / halflife)
    ema = np.zeros((H, N))
    ssum = np.zeros((H, N))
    nsam = np.zeros(N)
    seen = np.zeros(N, bool)
    cum = np.zeros((H, N))
    fut = np.zeros((H, N))
    for a in range(0, N, interval):
        b = min(N, a + interval)
        _, ps = cs.attend_chunk(q[a:b], a, Kf, Vf, Kf, Vf, e, p_sum=True)
        _, pl = cs.attend_chunk(q[b - 1:b], b - 1, Kf, Vf, Kf, Vf, e)
        if b <= t0:
            cum[:, :b] += ps
            ema[:, :b] = np.where(seen[:b], beta * ema[:, :b] + (1 - beta) * pl, pl)
            seen[:b] = True
            ssum[:, :b] += pl
            nsam[:b] += 1
        else:
            fut[:, :b] += ps
    rows = np.arange(sinks, t0 - window)
    cum_n = cum / np.maximum(t0 - np.arange(N), 1)[None, :]
    smean = ssum / np.maximum(nsam, 1)[None, :]
    out = {}
    for name, sc in (("online", ema), ("sampled mean", smean), ("cumulative", cum_n),
                     ("future", fut)):
        shares = {f: [] for f in FRACS}
        for g in range(G):
            s = sc[g * r:(g + 1) * r, rows].max(axis=0)
            mass = fut[g * r:(g + 1) * r, rows].sum(axis=0)
            order = np.argsort(-s, kind="stable")
            c = np.cumsum(mass[order]) / mass.sum()
            for f in FRACS:
                shares[f].append(float(c[int(f * rows.size) - 1]))
        out[name] = {str(f): float(np.mean(v)) for f, v in shares.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.join(mdl.DEFAULT_CACHE, "fidelity"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--halflife", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "importance_recall.json"))
    args = ap.parse_args()
    res = {}
    for N in args.tokens:
        qs = sorted(glob.glob(os.path.join(args.cache, f"*_N{N}_L*_q.npy")))
        if not qs:
            print(f"N={N}: no captures (run fidelity.py --tokens {N} first)", file=sys.stderr)
            continue
        per = {}
        for qp in qs:
            li = int(qp.rsplit("_L", 1)[1].split("_")[0])
            q, K, V = (np.load(qp[:-5] + x + ".npy") for x in "qkv")
            per[li] = layer_recall(q, K, V, args.tail, args.interval, args.halflife)
            print(f"N={N} layer {li}: " + "; ".join(
                f"{k} " + "/".join(f"{v[str(f)] * 100:.0f}" for f in FRACS) for k, v in per[li].items()),
                file=sys.stderr)
        res[str(N)] = dict(layers=dict(sorted(per.items())), interval=args.interval,
                           halflife=args.halflife, tail=args.tail)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("| N | layer | online (sampled 1/16, EMA) top 10/25/50% | sampled mean | cumulative (every query) | future (ideal) |")
    print("|---|---|---|---|---|---|")
    for N, r in res.items():
        for li, v in r["layers"].items():
            print(f"| {N} | {li} | " + " | ".join(
                "/".join(f"{v[k][str(f)] * 100:.0f}%" for f in FRACS) for k in ("online", "sampled mean", "cumulative", "future"))
                + " |")


if __name__ == "__main__":
    main()
