"""The benchmark grid and bytes model, shared by sdpa_bench.py, compare.py and m40_resources.py.

Keep in step with full_grid() in bench_attention.cu (`bench_attention --list` prints its grid).
A shape is (batch, n_heads, n_kv_heads, head_dim, ctx).
"""

HEAD_CONFIGS = [(32, 32, 128), (32, 8, 128), (64, 8, 128), (32, 8, 64)]  # (H, Hkv, D)
BATCHES = [1, 8, 32, 64]
CONTEXTS = [512, 2048, 8192, 32768]
LONG_CONTEXT = 131072  # batch 1 only
# head_dim 256 (groups 8, 2, 2, 1) and group 7: batch 1 at 8K and 32K, batch 8 at 8K, 32 at 2K.
MORE_CONFIGS = [(8, 1, 256), (16, 8, 256), (32, 16, 256), (32, 32, 256), (28, 4, 128)]


def full_grid(quick=False):
    if quick:
        g = [(b, h, hkv, 128, l) for (h, hkv) in [(32, 32), (32, 8)] for b in (1, 32) for l in (2048, 32768)]
        g.append((1, 32, 8, 64, 2048))
        return g
    g = []
    for (h, hkv, d) in HEAD_CONFIGS:
        for b in BATCHES:
            for l in CONTEXTS:
                g.append((b, h, hkv, d, l))
            if b == 1:
                g.append((b, h, hkv, d, LONG_CONTEXT))
    for (h, hkv, d) in MORE_CONFIGS:
        g += [(1, h, hkv, d, 8192), (1, h, hkv, d, 32768), (8, h, hkv, d, 8192), (32, h, hkv, d, 2048)]
    return g


def parse_int_k(s):
    s = s.strip()
    mult = 1
    if s[-1:] in ("k", "K"):
        mult, s = 1024, s[:-1]
    elif s[-1:] in ("m", "M"):
        mult, s = 1024 * 1024, s[:-1]
    return int(s) * mult


def parse_list(s):
    return [parse_int_k(t) for t in s.split(",") if t.strip()] if s else []


def parse_heads(s):
    out = []
    for t in (s.split(",") if s else []):
        a, b = t.split("/")
        out.append((int(a), int(b)))
    return out


def add_filter_args(p):
    """The filter options bench_attention takes too (same spelling)."""
    p.add_argument("--quick", action="store_true", help="reduced grid")
    p.add_argument("--batch", default="", help="filter, e.g. 1,8")
    p.add_argument("--ctx", default="", help="filter, e.g. 512,2K,128K")
    p.add_argument("--heads", default="", help="filter, e.g. 32/32,32/8")
    p.add_argument("--dim", default="", help="filter, e.g. 128")
    p.add_argument("--shape", action="append", default=[], metavar="B,H,Hkv,D,L",
                   help="this shape instead of the grid (repeatable; filters still apply)")


def filter_argv(args):
    """Filter options as argv for bench_attention / sdpa_bench.py."""
    out = []
    if args.quick:
        out.append("--quick")
    for name in ("batch", "ctx", "heads", "dim"):
        v = getattr(args, name)
        if v:
            out += ["--" + name, v]
    for s in args.shape:  # as plain integers: bench_attention does not read "32K"
        out += ["--shape", ",".join(str(x) for x in parse_list(s))]
    return out


def select(args, base=None):
    if base is None:
        base = [tuple(parse_list(s)) for s in args.shape] if args.shape else full_grid(args.quick)
    bs, ls, ds, hs = parse_list(args.batch), parse_list(args.ctx), parse_list(args.dim), parse_heads(args.heads)
    return [s for s in base
            if (not bs or s[0] in bs) and (not ls or s[4] in ls) and (not ds or s[3] in ds)
            and (not hs or (s[1], s[2]) in hs)]


def kv_bytes(shape):
    b, h, hkv, d, l = shape
    return 2 * 2 * b * hkv * l * d


def qo_bytes_f32(shape):
    b, h, hkv, d, l = shape
    return 2 * 4 * b * h * d


def rotation(shape, l2_bytes, cap=2048):
    """Layers (or tensor copies) to cycle through so that their K/V exceeds max(4*L2, 256 MiB)."""
    target = max(4 * l2_bytes, 256 << 20)
    kv = kv_bytes(shape)
    if kv >= target:
        return 1
    return max(1, min(-(-target // kv), cap))


def ctx_str(l):
    return f"{l // 1024}K" if l % 1024 == 0 else str(l)


def shape_key(d):
    return (d["batch"], d["n_heads"], d["n_kv_heads"], d["head_dim"], d["ctx"])


def shape_str(s):
    b, h, hkv, d, l = s
    return f"B{b} {h}/{hkv} D{d} L{ctx_str(l)}"


def load_runs(out, names):
    """bench_attention JSON results OUTDIR/NAME.json by name, for those that exist and parse."""
    import json
    import os
    runs = {}
    for name in names:
        try:
            with open(os.path.join(out, name + ".json")) as fh:
                runs[name] = json.load(fh)
        except (OSError, ValueError):
            pass
    return runs


def shape_in(run, key):
    """The shape of a bench_attention run matching key (shape_key), or None."""
    return next((x for x in run.get("shapes", []) if shape_key(x) == key), None)
