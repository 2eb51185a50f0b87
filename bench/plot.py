#!/usr/bin/env python3
"""Bandwidth share vs context, one line per batch and head grouping (log-x).

  plot.py INPUT.json OUTPUT.png

INPUT is compare.json (m40llm and best PyTorch side by side), or a bench_attention or
sdpa_bench JSON alone. Without matplotlib it says so, writes nothing and exits 0.
"""
import json
import sys


def series(doc):
    """{panel title: {(batch, H, Hkv, D): [(ctx, share), ...]}}"""
    panels = {}

    def add(panel, d, share):
        if isinstance(share, (int, float)):
            key = (d["batch"], d["n_heads"], d["n_kv_heads"], d["head_dim"])
            panels.setdefault(panel, {}).setdefault(key, []).append((d["ctx"], share))

    if "rows" in doc:  # compare.json
        for r in doc["rows"]:
            add("m40llm", r, r.get("m40_share_copy"))
            add("PyTorch SDPA (best backend)", r, r.get("torch_share_copy"))
    elif doc.get("tool") == "bench_attention":
        for r in doc.get("shapes", []):
            add("m40llm", r, r.get("share_copy"))
    elif doc.get("tool") == "sdpa_bench":
        for r in doc.get("shapes", []):
            add("PyTorch SDPA (best backend)", r, r.get("best_share_copy"))
    for p in panels.values():
        for k in p:
            p[k].sort()
    return panels


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; no plot written")
        return 0
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    panels = series(doc)
    if not panels:
        print("plot: nothing to plot")
        return 0
    dev = doc.get("device")
    dev = dev.get("name", "") if isinstance(dev, dict) else (dev or "")

    batches = sorted({k[0] for p in panels.values() for k in p})
    groups = sorted({k[1:] for p in panels.values() for k in p}, key=lambda g: (-g[2], g[0] // g[1], g[0]))
    cmap = plt.get_cmap("viridis")
    colors = {b: cmap(i / max(1, len(batches) - 1) * 0.9) for i, b in enumerate(batches)}
    markers = ["o", "s", "^", "D", "v", "P"]

    # One row per head grouping, one column per implementation; one line per batch.
    names = list(panels)
    fig, axes = plt.subplots(len(groups), len(names), figsize=(6.5 * len(names), 3.2 * len(groups)),
                             sharex=True, sharey=True, squeeze=False)
    ymax = max(s for p in panels.values() for pts in p.values() for _, s in pts)
    for gi, g in enumerate(groups):
        for ni, name in enumerate(names):
            ax = axes[gi][ni]
            p = panels[name]
            for bi, b in enumerate(batches):
                pts = p.get((b,) + g)
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, [100 * y for y in ys], "-", marker=markers[bi % len(markers)], color=colors[b],
                        markersize=4, label=f"batch {b}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{name}: {g[0]}/{g[1]} heads, D{g[2]}", fontsize=10)
            ax.axhline(92, color="red", lw=0.8, ls="--")
            ax.axhline(100, color="gray", lw=0.6)
            ax.set_ylim(0, max(110, 100 * ymax * 1.05))
            ax.grid(True, which="both", alpha=0.3)
            if gi == len(groups) - 1:
                ax.set_xlabel("context (tokens)")
            if ni == 0:
                ax.set_ylabel("% of copy BW")
            if gi == 0 and ni == len(names) - 1:
                ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(("decode attention: bytes moved / time as % of D2D copy bandwidth (read+write); red = 92%"
                  + (f" — {dev}" if dev else "")), fontsize=11)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(f"plot: wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
