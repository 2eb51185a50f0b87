"""Issue 15 through the library itself: its tiered cache (kvcache options version 4) on the real
model, end to end, through ctypes and the CPU backend (the same front end and row ops the CUDA
backend runs; float64 attention).

    cmake -S . -B /tmp/m40so -DM40LLM_ENABLE_CUDA=OFF -DBUILD_SHARED_LIBS=ON && cmake --build /tmp/m40so
    python3 bench/fidelity/lib_tiers.py --library /tmp/m40so/libm40llm.so

Each run is one teacher-forced pass with the library's cache and attention in every layer,
scored as buckets.py scores (next-token KL and top-1 over the last --tail positions against the
FP16-cache reference). Runs:
- `uniform`: the library's uniform cache in each of --uniform's formats, for the bytes around;
- `age`: four tiers of the study's pairs (K8V8, K8V4, K4V3, K4V2; --shares of the rows that
  leave the window), placed as the library places them: a row takes the first tier with room
  when it leaves the window, so the oldest rows hold the most bits;
- `importance`: the same tiers and bytes, placed by a policy written with the public API (as a
  caller would): the importance export (m40llm_kvcache_attn_importance_ex) every --interval-th
  step, its running mean per position (ZipCache's normalized score, the largest over the K/V
  heads: a token's heads share its tier), and before the append that takes a row out of the
  window, the row's place is made: it goes to the first tier that has room or whose least
  important row is less important than it, and the rows below cascade one tier down each
  (m40llm_kvcache_tier_move, re-quantized from their values). Rows only ever go down;
- `recent`: the same cascade with the position as the score and no export: a row leaving the
  window takes the top tier, and the oldest row of each full tier moves one tier down;
- `library`: the library's own placement of that rule (kvcache options version 5,
  M40LLM_PLACE_IMPORTANCE), fed by m40llm_kvcache_attn_observe_ex every --interval-th step (the
  plain call on the others); its sums are float where `importance` sums in float64;
- `auto`: the same placement fed by the cache's own observe calls (options version 6,
  observe_interval = --interval): the plain call every step, as a decode loop makes it. The
  same observe calls as `library`'s, so the same result to the last bit; both run once for each
  of --margins (options version 7's demote_margin: a row displaces another only where its score
  passes that row's by the factor 1 + margin);
- `plan B ...` (--plan): the same four pairs with the rows m40llm_kvcache_plan_tiers gives
  them for B bits a value (two tiers adjacent in cost share the rows), run with each policy
  of --plan-runs.
Bits per value: m40llm_kvcache_tier_stats's (codes, parameters, the tiers' slot maps, the FP16
sinks and window) at the full context. Writes results/lib_tiers_<N>.json and prints a table.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import buckets as bk  # noqa: E402
import kvformats as kf  # noqa: E402
import lib_attn as la  # noqa: E402
import model as mdl  # noqa: E402

PAIRS = {"K8V8": ("Q8", "Q8"), "K8V4": ("Q8", "Q4"), "K4V3": ("Q4", "Q3"), "K4V2": ("Q4", "Q2")}
SINKS, WINDOW = 4, 128


def fmt_id(name):
    return kf.FORMAT_IDS[name]


class LibTiered:
    """kv_hook / attend for Model.forward over a tiered library cache; policy 'age' (the
    library's placement), 'importance' (the cascade above), 'recent' (the same cascade with
    the position as the score), 'library' or 'auto' (the library's placement by importance, fed
    by the caller's observe calls or the cache's own)."""

    def __init__(self, lib, m, N, tiers, policy, interval, margin=0.0):
        own = policy in ("library", "auto")
        self.c = lib.cache(m.L, m.H, m.G, m.D, N, rotation=la.ROTATE_AUTO, n_sinks=SINKS,
                           window=WINDOW, tiers=tiers,
                           placement=la.PLACE_IMPORTANCE if own else la.PLACE_FIRST_FREE,
                           observe_interval=interval if policy == "auto" else 0,
                           demote_margin=margin if own else 0.0)
        self.cap = [t[2] for t in tiers]
        self.policy, self.interval, self.G = policy, interval, m.G

    def kv_hook(self, layer, K, V):
        return K, V

    def attend(self, layer, q, K, V):
        if self.policy in ("age", "auto"):
            return self.c.decode_layer(layer, q, K, V)
        if self.policy == "library":
            out = np.empty_like(q)
            for t in range(q.shape[0]):
                self.c.append(layer, K[t:t + 1], V[t:t + 1])
                out[t] = (self.c.attn_observe(layer, q[t]) if t % self.interval == self.interval - 1
                          else self.c.attn_batch(layer, q[t][None], [0])[0])
            return out
        N = q.shape[0]
        out = np.empty_like(q)
        imp = np.zeros((self.G, N), np.float32)
        score_sum = np.zeros(N)
        samples = np.zeros(N)          # samples taken since each position was appended
        tier = np.full(N, -1, np.int64)  # the mirror of the library's placement
        count = [0] * len(self.cap)
        recency = np.arange(N, dtype=np.float64)
        for t in range(N):
            e = t - WINDOW  # the row this append takes out of the window
            if e >= SINKS:
                mean = (recency if self.policy == "recent" else
                        np.divide(score_sum, samples, out=np.zeros(N), where=samples > 0))
                dest = None
                for u in range(len(self.cap)):
                    if count[u] < self.cap[u]:
                        dest = u
                        break
                    rows = np.nonzero(tier == u)[0]
                    if mean[rows].min() < mean[e]:
                        dest = u
                        break
                free = next(u for u in range(dest, len(self.cap)) if count[u] < self.cap[u])
                for u in range(free - 1, dest - 1, -1):  # cascade, from the bottom up
                    rows = np.nonzero(tier == u)[0]
                    v = int(rows[np.argmin(mean[rows])])
                    self.c.tier_move(layer, v, v + 1, u + 1)
                    tier[v] = u + 1
                    count[u] -= 1
                    count[u + 1] += 1
                tier[e] = dest
                count[dest] += 1
            self.c.append(layer, K[t:t + 1], V[t:t + 1])
            if e >= SINKS and t < SINKS + WINDOW + 8:  # the library agrees with the mirror
                assert self.c.tier_of(layer, e) == tier[e], (layer, e)
            if self.policy == "importance" and t % self.interval == self.interval - 1:
                out[t] = self.c.attn_importance(layer, q[t], imp, 0.0)
                score_sum[:t + 1] += imp[:, :t + 1].max(axis=0)
                samples[:t + 1] += 1
            else:
                out[t] = self.c.attn_batch(layer, q[t][None], [0])[0]
        return out

    def close(self):
        self.c.close()


class LibUniform:
    def __init__(self, lib, m, N, k, v):
        self.c = lib.cache(m.L, m.H, m.G, m.D, N, fmt_id(k), fmt_id(v), rotation=la.ROTATE_AUTO,
                           n_sinks=SINKS, window=WINDOW)

    def kv_hook(self, layer, K, V):
        return K, V

    def attend(self, layer, q, K, V):
        return self.c.decode_layer(layer, q, K, V)

    def close(self):
        self.c.close()


def uniform_bits(k, v, N, D):
    """All bytes at the full context, as tier_stats counts them: codes and parameters of the
    quantized rows, FP16 for the sinks and the window."""
    bits = {"Q8": 8.5, "Q4": 5.0, "Q3": 4.0, "Q2": 3.0}
    P = SINKS + WINDOW
    return (16.0 * P + (N - P) * (bits[k] + bits[v]) / 2) / N


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", required=True)
    ap.add_argument("--gguf", default=mdl.DEFAULT_GGUF)
    ap.add_argument("--cache", default=mdl.DEFAULT_CACHE)
    ap.add_argument("--text", nargs="*", default=[p for p in mdl.DEFAULT_TEXTS if os.path.exists(p)])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=256)
    # The default: the tier mix that buckets.py's default policy (tiers per token) ends with at
    # 6 bits, 2K (results/buckets.md, section 7), as shares of the quantized rows.
    ap.add_argument("--shares", default="0.002,0.348,0.516,0.134",
                    help="each tier's share of the rows that leave the window (K8V8,K8V4,K4V3,K4V2)")
    ap.add_argument("--plan", default="",
                    help="targets in bits a value (e.g. 5.5,6,7): runs whose tiers' rows "
                         "m40llm_kvcache_plan_tiers gives for each, with the policies of "
                         "--plan-runs")
    ap.add_argument("--plan-runs", default="auto")
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--margins", default="0",
                    help="the library's placement's demote_margin (options version 7), each a "
                         "run of the library and auto policies (0: named as before)")
    ap.add_argument("--runs", default="uniform,age,recent,importance")
    ap.add_argument("--uniform", default="Q4/Q4,Q4/Q3,Q8/Q3")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    N = args.tokens
    lib = la.Library(args.library)
    m = mdl.Model(args.gguf)
    ids = m.tok.encode(mdl.read_text(args.text))[:N]
    ref = bk.reference(m, ids, args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"lib_tiers_{N}.json")
    res = bk.load(path) or dict(N=N, tail=args.tail, sinks=SINKS, window=WINDOW, runs={})
    q_rows = N - SINKS - WINDOW
    shares = [float(x) for x in args.shares.split(",")]
    rows = [int(round(s * q_rows)) for s in shares[:-1]]
    rows.append(q_rows - sum(rows))
    tiers = [(fmt_id(PAIRS[n][0]), fmt_id(PAIRS[n][1]), r) for n, r in zip(PAIRS, rows)]
    todo = []
    margins = [float(x) for x in args.margins.split(",")]

    def named(g):  # a policy's runs: (its name's suffix, margin)
        suffix = f" 1/{args.interval}" if g in ("importance", "library", "auto") else ""
        if g not in ("library", "auto"):
            return [(suffix, 0.0)]
        return [(suffix + (f" margin {mg:g}" if mg else ""), mg) for mg in margins]

    for g in args.runs.split(","):
        if g == "uniform":
            todo += [(f"uniform K{k[1]}/V{v[1]}", ("uniform", k, v))
                     for k, v in (x.split("/") for x in args.uniform.split(","))]
        else:
            todo += [(f"tiers {args.shares} {g}{sfx}", (g, None, mg)) for sfx, mg in named(g)]
    for b in (float(x) for x in args.plan.split(",") if x):
        planned = lib.plan_tiers(b, m.L, m.H, m.G, m.D, N, rotation=la.ROTATE_AUTO,
                                 n_sinks=SINKS, window=WINDOW,
                                 tiers=[(fmt_id(k), fmt_id(v), 0) for k, v in PAIRS.values()])
        for g in args.plan_runs.split(","):
            todo += [(f"plan {b:g} {g}{sfx}", (g, planned, mg)) for sfx, mg in named(g)]
    for name, spec in todo:
        if name in res["runs"]:
            continue
        t0 = time.time()
        if spec[0] == "uniform":
            cache = LibUniform(lib, m, N, spec[1], spec[2])
            bits = uniform_bits(spec[1], spec[2], N, m.D)
            extra = {}
        else:
            run_rows = spec[1] or rows
            run_tiers = [(t[0], t[1], r) for t, r in zip(tiers, run_rows)]
            cache = LibTiered(lib, m, N, run_tiers, spec[0], args.interval, spec[2])
        r = bk.score(m, ids, args, ref, cache)
        if spec[0] != "uniform":
            st = cache.c.tier_stats()
            bits = st["bits_per_value"]
            extra = dict(tier_rows=st["rows"], moved_rows=st["moved_rows"],
                         tiers=[n for n in PAIRS], capacity=run_rows)
            if spec[2]:
                extra.update(demote_margin=spec[2])
            if "observe_calls" in st:
                extra.update(demoted_rows=st["demoted_rows"], observe_calls=st["observe_calls"])
        cache.close()
        r.update(bits=bits, seconds=round(time.time() - t0, 1), **extra)
        res["runs"][name] = r
        bk.save(path, res)
        print(f"{name:44s} bits {bits:.2f}  KL {r['kl']:.3e}  top1 {100 * r['top1']:.1f}%  "
              f"({r['seconds']} s)", flush=True)
    print(f"\n| run | bits/value | KL | top-1 |\n|---|---|---|---|")
    for name, r in sorted(res["runs"].items(), key=lambda x: x[1]["bits"]):
        print(f"| {name} | {r['bits']:.2f} | {r['kl']:.2e} | {100 * r['top1']:.1f}% |")


if __name__ == "__main__":
    main()
