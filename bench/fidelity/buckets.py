"""Issue 15's study: can mixed-precision KV buckets beat uniform formats of the same bytes on a
real model (SmolLM2-135M, the fidelity harness's text and metrics)?

    python3 bench/fidelity/buckets.py --tokens 2048 --runs uniform,buckets
    python3 bench/fidelity/buckets.py --report-only

Every run is one teacher-forced pass of the model with the cache in every layer (the decode
computation, cachesim.py), scored over the last --tail positions against the same harness's
FP16-cache run: mean next-token KL(P_F16 || P), top-1 agreement, perplexity, and the attention
output's relative L2 error (Frobenius over the tail positions and heads, mean over layers).
Bits per value count all bytes at the full context: codes, FP16 parameters, the FP16 sinks and
window (and KIVI's incomplete block), FP16 outlier channels, buckets' slot maps.
Results: results/buckets_<N>.json (merged run by run), results/buckets_tables.md,
results/buckets_curve.png; the written findings are results/buckets.md.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cachesim as cs  # noqa: E402
import kvformats as kf  # noqa: E402
import lowbit as lb  # noqa: E402
import model as mdl  # noqa: E402
from cachesim import Buckets, Uniform  # noqa: E402


def uniform_specs():
    u = [Uniform("Q8 +rot", "Q8", "Q8"), Uniform("Q4 +rot", "Q4", "Q4"),
         Uniform("Q4", "Q4", "Q4", rot=False), Uniform("Q4g16 +rot", "Q4g16", "Q4g16")]
    for b in (3, 2):
        for g in ("", "g16"):
            u.append(Uniform(f"Q{b}{g} +rot", f"Q{b}{g}", f"Q{b}{g}"))
            u.append(Uniform(f"Q{b}{g}", f"Q{b}{g}", f"Q{b}{g}", rot=False))
    u += [Uniform("K3/V2 +rot", "Q3", "Q2"), Uniform("K2/V3 +rot", "Q2", "Q3"),
          Uniform("K4/V3 +rot", "Q4", "Q3"), Uniform("K3g16/V2g16 +rot", "Q3g16", "Q2g16"),
          Uniform("K4/V2 +rot", "Q4", "Q2"), Uniform("K4/V2g16 +rot", "Q4", "Q2g16"),
          Uniform("K8/V4 +rot", "Q8", "Q4"), Uniform("K8/V3 +rot", "Q8", "Q3"),
          Uniform("K8/V2 +rot", "Q8", "Q2"),
          Uniform("Q2 KIVI-K T32, V rot", "Q2", "Q2", kivi=32),
          Uniform("Q3 KIVI-K T32, V rot", "Q3", "Q3", kivi=32),
          Uniform("K3 KIVI-T32/V2 +rot", "Q3", "Q2", kivi=32),
          Uniform("K4 KIVI-T32/V2 +rot", "Q4", "Q2", kivi=32),
          Uniform("Q2 KIVI-K T16, V g16 rot", "Q2", "Q2g16", kivi=16),
          Uniform("Q2 +2 K outlier ch.", "Q2", "Q2", rot=False, k_out=2),
          Uniform("Q3 +2 K outlier ch.", "Q3", "Q3", rot=False, k_out=2),
          Uniform("Q2 +2 K,V outlier ch.", "Q2", "Q2", rot=False, k_out=2, v_out=2)]
    return u


LONG_UNIFORM = ["Q4 +rot", "Q3 +rot", "K4/V2 +rot", "K4/V3 +rot", "Q8 +rot", "K8/V4 +rot",
                "K3/V2 +rot", "Q2 +rot", "K8/V3 +rot"]

FULL = ("F16", "Q8", "Q4", "Q3", "Q2")  # same format for K and V
NO2 = ("F16", "Q8", "Q4", "Q3")
KV = ("Q8", "Q8/Q4", "Q4", "Q4/Q3", "Q4/Q2")  # K keeps 4 bits or more, V goes lower


def bucket_specs(N):
    """The bucket policies of the study, by group. Targets are bits per value at N, all bytes;
    a target under a tier set's floor (every row in its lowest tier) is skipped."""
    B = {}

    def add(grp, *specs):
        B.setdefault(grp, []).extend(specs)

    for t in (5.25, 5.5, 6.0, 7.0, 8.0, 9.0):
        add("buckets", Buckets(f"F16/Q8/Q4/Q3 online @{t}", NO2, t))
    for t in (4.75, 5.0, 5.5, 6.0, 7.0, 8.0):
        add("buckets", Buckets(f"KV-pairs online @{t}", KV, t))
    for t in (4.5, 5.5):
        add("buckets", Buckets(f"F16/Q8/Q4/Q3/Q2 online @{t}", FULL, t))
    for t in (5.5, 6.0, 7.0):
        add("buckets", Buckets(f"F16/Q8/Q4/Q3 oracle @{t}", NO2, t, importance="oracle"),
            Buckets(f"F16/Q8/Q4/Q3 random @{t}", NO2, t, importance="random"),
            Buckets(f"KV-pairs oracle @{t}", KV, t, importance="oracle"),
            Buckets(f"KV-pairs random @{t}", KV, t, importance="random"))
    add("buckets", Buckets("F16/Q8/Q4/Q3/Q2 oracle @5.0", FULL, 5.0, importance="oracle"))
    # adjacent-tier mixes, by importance and by random order
    for tiers, nm, ts in ((("Q4", "Q3"), "Q4/Q3", (5.25, 5.5)), (("Q3", "Q2"), "Q3/Q2", (4.25, 4.5)),
                          (("Q8", "Q4"), "Q8/Q4", (6.0, 7.0, 8.0)),
                          (("Q4/Q3", "Q4/Q2"), "K4: V3/V2", (5.0,))):
        for t in ts:
            add("mixes", Buckets(f"{nm} online @{t}", tiers, t),
                Buckets(f"{nm} random @{t}", tiers, t, importance="random"))
    # policy knobs at one point
    t = 6.0
    base = f"KV-pairs online @{t}"
    add("knobs",
        Buckets(f"{base} interval 64", KV, t, interval=64),
        Buckets(f"{base} interval 4", KV, t, interval=4),
        Buckets(f"{base} hyst 1, margin 0", KV, t, hyst_count=1, hyst_margin=0.0),
        Buckets(f"{base} hyst 4", KV, t, hyst_count=4),
        Buckets(f"{base} EMA 512", KV, t, ema_halflife=512),
        Buckets(f"{base} EMA 2048", KV, t, ema_halflife=2048),
        Buckets(f"{base} all queries", KV, t, sample="all"),
        Buckets(f"{base} alpha 2", KV, t, alpha=2.0),
        Buckets(f"{base} alpha 0.5", KV, t, alpha=0.5),
        Buckets(f"{base} K weight 4", KV, t, k_weight=4.0),
        Buckets(f"{base} fixed memory", KV, t, budget="fixed"),
        Buckets(f"{base} no rotation", KV, t, rot=False))
    # the importance signal that accumulates every query (see the knobs), and interval 4
    for t in (5.5, 6.0, 7.0, 8.0):
        add("best", Buckets(f"KV-pairs online, all queries @{t}", KV, t, sample="all"),
            Buckets(f"KV-pairs online, interval 4 @{t}", KV, t, interval=4))
    # the recommended default (buckets.md): KV pairs, importance sampled every 4th query
    # (running mean), memory fixed at create time, K errors weighted 20x; and with K weight 1
    for t in (5.5, 6.0, 6.5, 7.0, 8.0):
        add("default", Buckets(f"default @{t}", KV, t, interval=4, budget="fixed", k_weight=20.0),
            Buckets(f"KV-pairs 1/4 fixed, K weight 1 @{t}", KV, t, interval=4, budget="fixed"),
            Buckets(f"default, current budget @{t}", KV, t, interval=4, k_weight=20.0))
    for t in (4.5, 5.0, 6.0, 7.0):
        add("long-default", Buckets(f"default @{t}", KV, t, interval=4, budget="fixed", k_weight=20.0))
    # seed 003's layout: a token's tier shared by its K/V heads (importance over all heads)
    for t in (5.5, 6.0, 7.0):
        add("scope", Buckets(f"default, tiers per token @{t}", KV, t, interval=4, budget="fixed",
                             k_weight=20.0, scope="sequence"))
    # K fixed at 8 bits, V by importance
    K8 = ("Q8", "Q8/Q4", "Q8/Q3", "Q8/Q2")
    for t in (6.5, 7.0):
        add("kfix", Buckets(f"K8, V in 8/4/3/2 @{t}", K8, t, interval=4, budget="fixed"))
    # spread: the random order with other seeds, the online policy at nearby targets
    add("best", Buckets("KV-pairs random @6.0 seed 1", KV, 6.0, importance="random", seed=1),
        Buckets("KV-pairs random @6.0 seed 2", KV, 6.0, importance="random", seed=2),
        Buckets("KV-pairs online @5.9", KV, 5.9), Buckets("KV-pairs online @6.1", KV, 6.1))
    # the long-context subset, most telling first
    add("long", Buckets("KV-pairs online @5.0", KV, 5.0),
        Buckets("KV-pairs random @5.0", KV, 5.0, importance="random"),
        Buckets("KV-pairs oracle @5.0", KV, 5.0, importance="oracle"),
        Buckets("Q4/Q3 online @4.75", ("Q4", "Q3"), 4.75),
        Buckets("KV-pairs online @6.0", KV, 6.0),
        Buckets("F16/Q8/Q4/Q3 online @5.0", NO2, 5.0),
        Buckets("KV-pairs online @4.5", KV, 4.5), Buckets("KV-pairs online @7.0", KV, 7.0),
        Buckets("K4: V3/V2 online @4.5", ("Q4/Q3", "Q4/Q2"), 4.5),
        Buckets("Q4/Q3 random @4.75", ("Q4", "Q3"), 4.75, importance="random"),
        Buckets("KV-pairs online @5.5", KV, 5.5),
        Buckets("KV-pairs online @5.0 interval 4", KV, 5.0, interval=4),
        Buckets("KV-pairs online @5.0 all queries", KV, 5.0, sample="all"))
    return B


def key_of(ids, args):
    return hashlib.sha1((str(list(ids)) + args.gguf + str(os.path.getsize(args.gguf)))
                        .encode()).hexdigest()[:12]


def reference(m, ids, args):
    """The FP16-cache run with this study's attention code: tail log-probs, tail attention
    outputs per layer, and the oracle importance per layer (attention each row receives from
    all later queries, divided by their number, max over the query heads of each KV head).
    Cached under ~/.cache/m40llm/fidelity/."""
    N = len(ids)
    d = os.path.join(args.cache, "fidelity")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"buckets_ref_{key_of(ids, args)}_N{N}_tail{args.tail}.npz")
    if os.path.exists(path):
        z = np.load(path)
        return z["lp"], z["att"], z["oracle"]
    L, G, H = m.L, m.G, m.H
    att = np.zeros((L, args.tail, H, m.D), np.float32)
    oracle = np.zeros((L, G, N), np.float32)
    kv = {}

    def kv_hook(layer, K, V):
        kv[layer] = (kf.f16_roundtrip(K), kf.f16_roundtrip(V))
        return K, V

    def attend(layer, q, Kc, Vc):
        K, V = kv.pop(layer)
        e = np.zeros(N, np.int64)
        out = np.empty_like(q)
        colsum = np.zeros((H, N))
        for a in range(0, N, 256):
            b = min(N, a + 256)
            out[a:b], ps = cs.attend_chunk(q[a:b], a, K, V, K, V, e, p_sum=True)
            colsum[:, :b] += ps
        att[layer] = out[N - args.tail:]
        norm = colsum / (N - np.arange(N))[None, :]
        oracle[layer] = norm.reshape(G, H // G, N).max(axis=1)
        return out

    t0 = time.time()
    logits, _ = m.forward(ids, kv_hook, attend, logits_from=N - args.tail, progress=args.verbose)
    lp = mdl.log_softmax(logits)
    np.savez(path, lp=lp, att=att, oracle=oracle)
    print(f"reference run {time.time() - t0:.1f}s", file=sys.stderr)
    return lp, att, oracle


def score(m, ids, args, ref, cache):
    lp_ref, att_ref, _ = ref
    N = len(ids)
    att = {}

    def attend(layer, q, Kc, Vc):
        out = cache.attend(layer, q, Kc, Vc)
        att[layer] = out[N - args.tail:]
        return out

    t0 = time.time()
    logits, _ = m.forward(ids, cache.kv_hook, attend, logits_from=N - args.tail, progress=args.verbose)
    lp = mdl.log_softmax(logits)
    kl = (np.exp(lp_ref) * (lp_ref - lp)).sum(-1)
    tgt = np.asarray(ids[N - args.tail + 1:])
    nll = -lp[np.arange(len(tgt)), tgt]
    rel = [float(np.linalg.norm(att[li] - att_ref[li]) / np.linalg.norm(att_ref[li]))
           for li in range(m.L)]
    return dict(kl=float(kl.mean()), kl_max=float(kl.max()),
                top1=float(np.mean(lp.argmax(-1) == lp_ref.argmax(-1))),
                ppl=float(np.exp(nll.mean())), attn_rel=float(np.mean(rel)),
                attn_rel_max=float(np.max(rel)), seconds=round(time.time() - t0, 1))


def load(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def save(path, res):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=mdl.DEFAULT_GGUF)
    ap.add_argument("--cache", default=mdl.DEFAULT_CACHE)
    ap.add_argument("--text", nargs="*", default=[p for p in mdl.DEFAULT_TEXTS if os.path.exists(p)])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--runs", default="uniform,buckets,mixes,knobs",
                    help="groups: uniform, buckets, mixes, knobs, best, default, kfix, long-uniform, long, "
                    "long-default (comma-separated)")
    ap.add_argument("--only", default="", help="run only these names (';'-separated)")
    ap.add_argument("--redo", action="store_true", help="rerun names already in the JSON")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    import buckets_report
    if args.report_only:
        buckets_report.report(args.out)
        return
    N = args.tokens
    m = mdl.Model(args.gguf)
    ids = m.tok.encode(mdl.read_text(args.text))[:N]
    assert len(ids) == N
    ref = reference(m, ids, args)
    path = os.path.join(args.out, f"buckets_{N}.json")
    res = load(path) or dict(N=N, tail=args.tail, model=os.path.basename(args.gguf), text=args.text,
                             hp=m.hp, uniform={}, buckets={},
                             layout=lb.layout_table(), map_bits=lb.MAP_BITS)
    tgt = np.asarray(ids[N - args.tail + 1:])
    res["uniform"]["F16"] = dict(kl=0.0, kl_max=0.0, top1=1.0, attn_rel=0.0, attn_rel_max=0.0,
                                 ppl=float(np.exp(-ref[0][np.arange(len(tgt)), tgt].mean())), bits=16.0, spec=dict(k="F16", v="F16", rot=False, sinks=0, window=0))
    groups = args.runs.split(",")
    only = {x.strip() for x in args.only.split(";") if x.strip()}
    todo = []
    if "uniform" in groups:
        todo += [("uniform", s) for s in uniform_specs()]
    if "long-uniform" in groups:
        by = {s.name: s for s in uniform_specs()}
        todo += [("uniform", by[n]) for n in LONG_UNIFORM]
    bs = bucket_specs(N)
    for g in groups:
        todo += [("buckets", s) for s in bs.get(g, [])]
    for kind, s in todo:
        if only and s.name not in only:
            continue
        if s.name in res[kind] and not args.redo:
            continue
        if kind == "uniform":
            r = score(m, ids, args, ref, cs.UniformCache(s))
            r["bits"] = s.bits(N, m.D)
        else:
            P = s.sinks + s.window
            low = min((k.bpv + v.bpv) / 2 for k, v in map(cs.tier_pair, s.tiers))
            floor = (16.0 * P + (N - P) * (low + lb.MAP_BITS / (2 * m.D))) / N
            if s.target < floor:
                print(f"  skip {s.name}: target below the floor {floor:.2f}", file=sys.stderr)
                continue
            c = cs.BucketCache(s, N, oracle=ref[2])
            r = score(m, ids, args, ref, c)
            r.update(c.summary())
            r["target"] = s.target
        r["spec"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.__dict__.items()}
        res[kind][s.name] = r
        save(path, res)
        print(f"  {kind:8s} {s.name:40s} bits {r['bits']:.2f}  KL {r['kl']:.3e}  top1 "
              f"{r['top1'] * 100:.1f}%  attn {r['attn_rel']:.3e}  ({r['seconds']}s)", file=sys.stderr)
    buckets_report.report(args.out)


if __name__ == "__main__":
    main()
