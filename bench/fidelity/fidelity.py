"""Fidelity of the KV cache formats on a real model (SmolLM2-135M-Instruct, GGUF) and on synthetic
head_dim-128 data with outlier channels.

    python3 bench/fidelity/fidelity.py [--tokens 2048] [--library /tmp/m40so/libm40llm.so]

(a) attention level, for several layers of the F16-cache run: the captured FP32 q/K/V, cache
    built in each format, attention of the last --attn-queries positions: relative L2 of the
    output (Frobenius over all queries and heads) and mean cosine against the FP16 cache's
    output, mean KL(p_F16 || p_format) of the attention distribution.
(b) end to end: the whole model with the format's cache in every layer (each position's K/V
    quantized as it is appended, the current one's too; teacher-forced in one pass, which is the
    decode computation), next-token distribution over the last --tail positions: mean
    KL(P_F16 || P_format), top-1 agreement with the F16 cache, perplexity of the text there.
(c) synthetic (labelled so): random head_dim-128 q/K/V with outlier channels (10-30x), (a)'s
    metrics.
Rows marked "preview" (rotation, protected sinks/window, FP32) are float references of features
the library does not have yet. Results: results/fidelity_<N>.json per context length and
results/fidelity.md / fidelity.json / fidelity.png merged over every JSON present.
"""
import argparse
import glob
import hashlib
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvformats as kf  # noqa: E402
import model as mdl  # noqa: E402
from kvformats import Spec  # noqa: E402

P4 = dict(sinks=4, window=128)
SPECS = [
    Spec("F16", "F16", "F16"),
    Spec("Q8", "Q8", "Q8"),
    Spec("Q4", "Q4", "Q4"),
    Spec("Q8-K/Q4-V", "Q8", "Q4"),
    Spec("FP32 (no rounding)", "FP32", "FP32", preview=True),
    Spec("Q8 +rot", "Q8", "Q8", rot_k=True, preview=True),
    Spec("Q8 +rot +prot", "Q8", "Q8", rot_k=True, preview=True, **P4),
    Spec("Q4 +rot", "Q4", "Q4", rot_k=True, preview=True),
    Spec("Q4 +prot", "Q4", "Q4", preview=True, **P4),
    Spec("Q4 +rot +sinks", "Q4", "Q4", rot_k=True, sinks=4, preview=True),
    Spec("Q4 +rot +prot", "Q4", "Q4", rot_k=True, preview=True, **P4),
    Spec("Q4 +rot K,V +prot", "Q4", "Q4", rot_k=True, rot_v=True, preview=True, **P4),
    Spec("Q8-K/Q4-V +rot +prot", "Q8", "Q4", rot_k=True, preview=True, **P4),
]
# the reduced set for long contexts (--quick-specs)
QUICK = ["F16", "Q8", "Q4", "Q8-K/Q4-V", "Q8 +rot +prot", "Q4 +rot", "Q4 +rot +prot"]


def kl_rows(logp_ref, logp):
    return (np.exp(logp_ref) * (logp_ref - logp)).sum(-1)


def attn_metrics(o_ref, o, P_ref, P):
    rel = float(np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref))
    num = (o * o_ref).sum(-1)
    den = np.linalg.norm(o, axis=-1) * np.linalg.norm(o_ref, axis=-1)
    cos = float(np.mean(num / np.maximum(den, 1e-30)))
    with np.errstate(divide="ignore", invalid="ignore"):
        Pr = P_ref.astype(np.float64)
        Pf = np.maximum(P.astype(np.float64), 1e-45)
        kl = np.where(Pr > 0, Pr * (np.log(np.maximum(Pr, 1e-45)) - np.log(Pf)), 0).sum(-1)
    return dict(rel_l2=rel, cos=cos, attn_kl=float(np.mean(kl)))


def cache_dir(args):
    d = os.path.join(args.cache, "fidelity")
    os.makedirs(d, exist_ok=True)
    return d


def reference_run(m, ids, args, layers):
    """F16-cache run: captures of q/K/V at `layers` and the tail's log-probs, cached as .npy."""
    key = hashlib.sha1((str(list(ids)) + args.gguf + str(os.path.getsize(args.gguf)))
                       .encode()).hexdigest()[:12]
    d = cache_dir(args)
    base = os.path.join(d, f"{key}_N{len(ids)}")
    paths = {li: [f"{base}_L{li}_{n}.npy" for n in "qkv"] for li in layers}
    lp_path = f"{base}_tail{args.tail}_logp_f16.npy"
    if all(os.path.exists(p) for ps in paths.values() for p in ps) and os.path.exists(lp_path):
        caps = {li: tuple(np.load(p) for p in ps) for li, ps in paths.items()}
        return caps, np.load(lp_path), 0.0
    t0 = time.time()
    sc = kf.SpecCache(Spec("F16"), m.D)
    logits, caps = m.forward(ids, sc.kv_hook, sc.attend, capture=set(layers),
                             logits_from=len(ids) - args.tail, progress=True)
    for li, ps in paths.items():
        for p, a in zip(ps, caps[li]):
            np.save(p, a)
    lp = mdl.log_softmax(logits)
    np.save(lp_path, lp)
    return caps, lp, time.time() - t0


def e2e(m, ids, args, lp_ref, kv_hook, attend):
    t0 = time.time()
    logits, _ = m.forward(ids, kv_hook, attend, logits_from=len(ids) - args.tail, progress=args.verbose)
    lp = mdl.log_softmax(logits)
    kl = kl_rows(lp_ref, lp)
    tgt = np.asarray(ids[len(ids) - args.tail + 1:])
    nll = -lp[np.arange(len(tgt)), tgt]
    return dict(kl=float(kl.mean()), kl_max=float(kl.max()),
                top1=float(np.mean(lp.argmax(-1) == lp_ref.argmax(-1))),
                ppl=float(np.exp(nll.mean())), seconds=round(time.time() - t0, 1)), lp


def synthetic(args, specs, N=2048, H=8, G=2, D=128, q_from=None, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((N, H, D)).astype(np.float32)
    K = rng.standard_normal((N, G, D)).astype(np.float32)
    V = rng.standard_normal((N, G, D)).astype(np.float32)
    for g in range(G):
        kc = rng.choice(D, 4, replace=False)
        K[:, g, kc] *= rng.uniform(10, 30, 4).astype(np.float32)
        K[:, g, kc] += rng.uniform(-10, 10, 4).astype(np.float32)  # outlier channels are biased too
        vc = rng.choice(D, 2, replace=False)
        V[:, g, vc] *= rng.uniform(10, 30, 2).astype(np.float32)
    q_from = N - args.attn_queries if q_from is None else q_from
    ref = kf.SpecCache(Spec("F16"), D).attention_level(q, K, V, q_from)
    rows = []
    for s in specs:
        if s.name == "F16":
            continue
        o, P = kf.SpecCache(s, D).attention_level(q, K, V, q_from)
        rows.append(dict(spec=s.name, preview=s.preview, **attn_metrics(ref[0], o, ref[1], P)))
    return dict(desc=f"synthetic: N={N}, {H} query / {G} KV heads, head_dim {D}; K: 4 outlier "
                     f"channels per KV head scaled 10-30x and offset +-10, V: 2 channels 10-30x; "
                     f"queries {q_from}..{N - 1}", rows=rows)


def run_library(m, ids, args, lp_ref, caps, specs, np_lp):
    import lib_attn
    lib = lib_attn.Library(args.library)
    out = dict(path=args.library, version=lib.version, kv_options_version=lib.kv_options_version,
               rows=[])
    for s in specs:
        fm = s.library_formats
        if fm is None:
            continue
        if not lib.supports(*fm):
            out["rows"].append(dict(spec=s.name, skipped="library has no kvcache options v2 / format"))
            continue
        print(f"[library] {s.name}: formats {fm}", file=sys.stderr)
        row = dict(spec=s.name, formats=list(fm))
        # attention level, library vs numpy reference, on the captured layers' inputs
        for li in args.lib_layers:
            q, K, V = caps[li]
            c = lib.cache(1, m.H, m.G, m.D, len(ids), fm[0], fm[1])
            o_lib = c.decode_layer(0, q, K, V)
            c.close()
            sc = kf.SpecCache(s, m.D)
            o_np, _ = sc.attention_level(q, K, V, 0, want_p=False)
            row[f"attn_rel_l2_lib_vs_numpy_L{li}"] = float(np.linalg.norm(o_lib - o_np) /
                                                           np.linalg.norm(o_np))
        if not args.library_no_e2e:
            la = lib_attn.LibraryAttend(lib, m.L, m.H, m.G, m.D, len(ids), fm[0], fm[1])
            res, lp = e2e(m, ids, args, lp_ref, la.kv_hook, la.attend)
            la.close()
            row.update({f"e2e_{k}": v for k, v in res.items()})
            if s.name in np_lp:
                kl = kl_rows(np_lp[s.name], lp)
                row["e2e_kl_lib_vs_numpy"] = float(kl.mean())
                row["e2e_top1_lib_vs_numpy"] = float(np.mean(lp.argmax(-1) == np_lp[s.name].argmax(-1)))
        out["rows"].append(row)
        print(f"[library] {row}", file=sys.stderr)
    lib.close()
    return out


def run_length(m, all_ids, N, args, specs):
    ids = all_ids[:N]
    assert len(ids) == N, f"text has only {len(all_ids)} tokens"
    print(f"== N = {N}", file=sys.stderr)
    caps, lp_ref, t_ref = reference_run(m, ids, args, args.layers)
    print(f"reference (F16 cache) run {t_ref:.1f}s", file=sys.stderr)
    res = dict(N=N, tail=args.tail, attn_queries=args.attn_queries, layers=args.layers,
               attention={}, e2e={}, library=None)
    # (a) attention level
    q_from = N - args.attn_queries
    for li in args.layers:
        q, K, V = caps[li]
        o_ref, P_ref = kf.SpecCache(Spec("F16"), m.D).attention_level(q, K, V, q_from)
        for s in specs:
            if s.name == "F16":
                continue
            o, P = kf.SpecCache(s, m.D).attention_level(q, K, V, q_from)
            res["attention"].setdefault(s.name, {})[str(li)] = attn_metrics(o_ref, o, P_ref, P)
    print("attention level done", file=sys.stderr)
    # (b) end to end
    np_lp = {}
    tgt = np.asarray(ids[N - args.tail + 1:])
    res["e2e"]["F16"] = dict(kl=0.0, kl_max=0.0, top1=1.0, seconds=round(t_ref, 1),
                             ppl=float(np.exp(-lp_ref[np.arange(len(tgt)), tgt].mean())))
    np_lp["F16"] = lp_ref
    for s in specs:
        if s.name == "F16":
            continue
        sc = kf.SpecCache(s, m.D)
        r, lp = e2e(m, ids, args, lp_ref, sc.kv_hook, sc.attend)
        if s.library_formats is not None:
            np_lp[s.name] = lp
        res["e2e"][s.name] = r
        print(f"  e2e {s.name:24s} KL {r['kl']:.3e} top1 {r['top1'] * 100:.1f}% ppl {r['ppl']:.3f} "
              f"({r['seconds']}s)", file=sys.stderr)
    if args.library:
        res["library"] = run_library(m, ids, args, lp_ref, caps, specs, np_lp)
    return res


def fmt_row(s, vals):
    return "| " + " | ".join([s] + vals) + " |"


def report(outdir):
    runs = []
    for p in sorted(glob.glob(os.path.join(outdir, "fidelity_*.json"))):
        with open(p) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda r: r["N"])
    if not runs:
        return
    spec_by = {s.name: s for s in SPECS}
    lines = ["# KV cache format fidelity: SmolLM2-135M-Instruct (Q4_1 GGUF) on license text", ""]
    meta = runs[0]["meta"]
    lines += [f"Model `{meta['gguf']}`; text: {', '.join(meta['text'])} ({meta['text_tokens']} tokens, "
              f"tokenizer: {meta['tokenizer']}); F16-cache perplexity over the tail shown per row. "
              "Reference for every metric: the same model with the FP16 cache. "
              "**preview** rows are float references of features the library does not have yet "
              "(rotation = normalized Walsh-Hadamard on K and q; prot = first 4 tokens and last 128 "
              "tokens kept FP16). Numbers from numpy (float32 model, FP32 attention).", ""]
    lines += ["## End to end (quantized cache in every layer)", ""]
    hdr = ["format", "bits/val", "preview"]
    for r in runs:
        hdr += [f"KL @{r['N']}", f"top-1 @{r['N']}", f"ppl @{r['N']}"]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    names = [s.name for s in SPECS if any(s.name in r["e2e"] for r in runs)]
    for n in names:
        s = spec_by[n]
        vals = [f"{s.bits:.2f}", "preview" if s.preview else ""]
        for r in runs:
            e = r["e2e"].get(n)
            vals += ([f"{e['kl']:.2e}", f"{e['top1'] * 100:.1f}%", f"{e['ppl']:.3f}"] if e else ["", "", ""])
        lines.append(fmt_row(n, vals))
    lines += ["", f"KL: mean over the last {runs[0]['tail']} positions of KL(P_F16 || P_format) "
              "(nats); top-1: argmax agreement with the F16 cache; ppl: perplexity of the text over "
              "those positions.", ""]
    lines += ["## Attention level (captured q/K/V of the F16 run)", ""]
    for r in runs:
        lines += [f"N = {r['N']}, queries {r['N'] - r['attn_queries']}..{r['N'] - 1}, layers "
                  f"{r['layers']}: mean over layers (worst layer in brackets)", "",
                  "| format | rel L2 | cosine | attn KL |", "|---|---|---|---|"]
        for n, per in r["attention"].items():
            v = list(per.values())
            rl = [x["rel_l2"] for x in v]
            co = [x["cos"] for x in v]
            kl = [x["attn_kl"] for x in v]
            lines.append(fmt_row(n + (" (preview)" if spec_by[n].preview else ""),
                                 [f"{np.mean(rl):.2e} ({max(rl):.2e})", f"{np.mean(co):.6f} ({min(co):.6f})",
                                  f"{np.mean(kl):.2e} ({max(kl):.2e})"]))
        lines.append("")
    syn = runs[0].get("synthetic")
    if syn:
        lines += ["## Synthetic (not a model): " + syn["desc"], "",
                  "| format | rel L2 | cosine | attn KL |", "|---|---|---|---|"]
        for x in syn["rows"]:
            lines.append(fmt_row(x["spec"] + (" (preview)" if x["preview"] else ""),
                                 [f"{x['rel_l2']:.2e}", f"{x['cos']:.6f}", f"{x['attn_kl']:.2e}"]))
        lines.append("")
    libs = [(r["N"], r["library"]) for r in runs if r.get("library")]
    if libs:
        lines += ["## Library (CPU backend through ctypes) vs the numpy reference", ""]
        for N, lb in libs:
            lines += [f"N = {N}, `{lb['path']}` version {lb['version']}, kvcache options v"
                      f"{lb['kv_options_version']}:", ""]
            for row in lb["rows"]:
                if "skipped" in row:
                    lines.append(f"- {row['spec']}: skipped ({row['skipped']})")
                    continue
                parts = [f"{k.replace('attn_rel_l2_lib_vs_numpy_', 'attention rel L2 lib vs numpy ')}"
                         f" {v:.2e}" for k, v in row.items() if k.startswith("attn_rel_l2")]
                if "e2e_kl" in row:
                    parts.append(f"end to end with the library's cache and attention in every layer: KL vs F16 "
                                 f"{row['e2e_kl']:.2e}, top-1 {row['e2e_top1'] * 100:.1f}%, ppl {row['e2e_ppl']:.3f}")
                if "e2e_kl_lib_vs_numpy" in row:
                    parts.append(f"KL lib vs numpy {row['e2e_kl_lib_vs_numpy']:.2e}, top-1 agreement "
                                 f"{row['e2e_top1_lib_vs_numpy'] * 100:.1f}%")
                lines.append(f"- {row['spec']}: " + "; ".join(parts))
            lines.append("")
    with open(os.path.join(outdir, "fidelity.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(outdir, "fidelity.json"), "w") as f:
        json.dump(runs, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axs = plt.subplots(1, 2, figsize=(13, 5.5))
    w = 0.8 / len(runs)
    for i, r in enumerate(runs):
        ns = [n for n in names if n in r["e2e"] and n != "F16"]
        x = np.array([names.index(n) for n in ns])
        axs[0].bar(x + i * w, [max(r["e2e"][n]["kl"], 1e-9) for n in ns], w, label=f"N={r['N']}")
        axs[1].bar(x + i * w, [r["e2e"][n]["top1"] * 100 for n in ns], w, label=f"N={r['N']}")
    for ax in axs:
        ax.set_xticks(np.arange(len(names)) + w * (len(runs) - 1) / 2)
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
        ax.legend()
    axs[0].set_yscale("log")
    axs[0].set_ylabel("next-token KL vs F16 cache (nats)")
    axs[1].set_ylabel("top-1 agreement with F16 cache (%)")
    axs[1].set_ylim(50, 100.5)
    fig.suptitle("SmolLM2-135M, KV cache formats, end to end (last %d positions)" % runs[0]["tail"])
    fig.tight_layout()
    fig.savefig(os.path.join(outdir, "fidelity.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=mdl.DEFAULT_GGUF)
    ap.add_argument("--cache", default=mdl.DEFAULT_CACHE, help="captures go here (not git)")
    ap.add_argument("--text", nargs="*", default=[p for p in mdl.DEFAULT_TEXTS if os.path.exists(p)])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--tail", type=int, default=256)
    ap.add_argument("--attn-queries", type=int, default=512)
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2, 8, 15, 22, 29])
    ap.add_argument("--specs", default="all", help="all, quick, or comma-separated names")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--library", help="libm40llm.so (CPU backend) for the library path")
    ap.add_argument("--lib-layers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 15])
    ap.add_argument("--library-no-e2e", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        report(args.out)
        return
    if args.specs == "all":
        specs = SPECS
    else:
        want = QUICK if args.specs == "quick" else args.specs.split(",")
        specs = [s for s in SPECS if s.name in want or s.name == "F16"]
    m = mdl.Model(args.gguf)
    all_ids = m.tok.encode(mdl.read_text(args.text))
    meta = dict(gguf=os.path.basename(args.gguf), text=args.text, text_tokens=len(all_ids),
                tokenizer="byte-level BPE from the GGUF (tokenizer.py), "
                          + ("exact smollm pre-tokenizer" if __import__("tokenizer").EXACT_PRETOKENIZER
                             else "ASCII pre-tokenizer approximation"),
                hp=m.hp)
    syn = None
    if not args.no_synthetic:
        t0 = time.time()
        syn = synthetic(args, specs)
        print(f"synthetic done {time.time() - t0:.1f}s", file=sys.stderr)
    for N in args.tokens:
        t0 = time.time()
        res = run_length(m, all_ids, N, args, specs)
        res["meta"] = meta
        res["synthetic"] = syn
        res["seconds"] = round(time.time() - t0, 1)
        path = os.path.join(args.out, f"fidelity_{N}.json")
        if os.path.exists(path):  # keep library results of an earlier run if this one has none
            with open(path) as f:
                old = json.load(f)
            if res["library"] is None and old.get("library"):
                res["library"] = old["library"]
            for k in ("e2e", "attention"):
                for n, v in old.get(k, {}).items():
                    res[k].setdefault(n, v)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        report(args.out)
        print(open(os.path.join(args.out, "fidelity.md")).read())


if __name__ == "__main__":
    main()
