"""Decode-time caches for the bucket study (issue 15), as kv_hook/attend pairs for Model.forward.

Both run the causal attention of every position in chunks of queries, where a cache row j is
FP16 for query t while t < exit[j] (the first `sinks` rows always; the others until they leave
the `window` most recent positions, t >= j + window) and afterwards holds what the cache stores
for it at that chunk. That is the decode computation position by position, in one pass.

- UniformCache: every row one format (lowbit tiers, per-channel K over token blocks, FP16
  outlier channels, rotation), fixed once the row leaves the window.
- BucketCache: per (layer, KV head), each row that leaves the window gets a tier from an
  allocator that holds a target average of bits; rows are demoted one tier at a time, each
  demotion re-quantizing the row from its current (already quantized) values. Importance
  (online, oracle or random) orders the rows. Queries run in chunks of `interval` positions:
  the allocator runs at each chunk's start, and the online importance samples the attention of
  the chunk's last query (the decode kernel exporting each row's attention weight every
  `interval`-th step).
"""
from dataclasses import dataclass

import numpy as np

import kvformats as kf
import lowbit as lb

BIG = np.iinfo(np.int64).max // 4


def attend_chunk(qc, a, Kq, Vq, Kf, Vf, exit_t, p_sum=False):
    """Queries a..a+C-1 (qc [C, H, D]) over rows 0..a+C-1. Row j is Kf/Vf (FP16) for query t
    while t < exit_t[j], Kq/Vq afterwards. FP32. Returns out [C, H, D] and the attention
    probabilities of the last query [H, a+C] (p_sum: their sum over the chunk's queries)."""
    C, H, D = qc.shape
    b = a + C
    G = Kq.shape[1]
    r = H // G
    scale = np.float32(1.0 / np.sqrt(D))
    qg = qc.reshape(C, G, r, D).transpose(1, 0, 2, 3).reshape(G, C * r, D)
    s = (np.matmul(qg, Kq[:b].transpose(1, 2, 0)) * scale).reshape(G, C, r, b)
    t = np.arange(a, b)[:, None, None]
    R = np.nonzero(exit_t[:b] > a)[0]
    if R.size:
        sf = (np.matmul(qg, Kf[R].transpose(1, 2, 0)) * scale).reshape(G, C, r, R.size)
        fm = exit_t[R][None, None, :] > t  # [C, 1, R]: row still FP16 for this query
        s[..., R] = np.where(fm, sf, s[..., R])
    s = np.where(np.arange(b)[None, None, :] <= t, s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = np.matmul(p.reshape(G, C * r, b), Vq[:b].transpose(1, 0, 2))
    if R.size:
        w = np.where(fm, p[..., R], 0).reshape(G, C * r, R.size)
        o += np.matmul(w, (Vf[R] - Vq[R]).transpose(1, 0, 2))
    out = o.reshape(G, C, r, D).transpose(1, 0, 2, 3).reshape(C, H, D)
    return out, (p.sum(axis=1) if p_sum else p[:, C - 1]).reshape(H, b)


def exit_times(N, sinks, window):
    e = np.arange(N, dtype=np.int64) + window
    e[:sinks] = BIG
    return e


@dataclass(frozen=True)
class Uniform:
    """One format for every row. k/v: lowbit tier names; kivi: K per channel over blocks of
    `kivi` tokens (b-bit of tier k, no rotation of K); k_out/v_out: FP16 outlier channels per
    (layer, KV head), chosen by RMS over the whole text (a calibration)."""
    name: str
    k: str
    v: str
    rot: bool = True  # K and V rotated (the library's ROTATE_KV / AUTO)
    sinks: int = 4
    window: int = 128
    kivi: int = 0
    k_out: int = 0
    v_out: int = 0

    def bits(self, N, D):
        """Bits per value at context N, all bytes: quantized rows, FP16 rows (sinks, window,
        and KIVI's incomplete block), FP16 outlier channels."""
        kt, vt = lb.TIERS[self.k], lb.TIERS[self.v]
        qk = kt.bpv + 16.0 * self.k_out / D
        qv = vt.bpv + 16.0 * self.v_out / D
        if self.kivi:
            qk = kt.bits + 32.0 / self.kivi
        n16 = self.fp16_rows(N)
        return (n16 * 16.0 + (N - n16) * (qk + qv) / 2) / N

    def fp16_rows(self, N):
        return int(np.sum(self.exits(N) > N - 1))

    def exits(self, N):
        e = exit_times(N, self.sinks, self.window)
        if self.kivi:
            j = np.arange(N)
            blk_end = self.sinks + ((j - self.sinks) // self.kivi + 1) * self.kivi - 1
            e = np.where(j >= self.sinks, blk_end + self.window, BIG)
        return e


class UniformCache:
    def __init__(self, spec, chunk=256):
        self.spec = spec
        self.chunk = chunk
        self.kv = {}

    def kv_hook(self, layer, K, V):
        self.kv[layer] = (K, V)
        return K, V

    def attend(self, layer, q, Kc, Vc):
        s = self.spec
        K, V = self.kv.pop(layer)
        N, G, D = K.shape
        rot_k = s.rot and not s.kivi
        Kr = kf.wht(K) if rot_k else K
        Vr = kf.wht(V) if s.rot else V
        qr = kf.wht(q) if rot_k else q
        kt, vt = lb.TIERS[s.k], lb.TIERS[s.v]
        if s.kivi:
            Kq, _ = lb.kivi_k(Kr, kt.bits, s.kivi, s.sinks)
        else:
            Kq = lb.with_outliers(kt, Kr, lb.outlier_channels(Kr, s.k_out))
        Vq = lb.with_outliers(vt, Vr, lb.outlier_channels(Vr, s.v_out))
        Kf, Vf = kf.f16_roundtrip(Kr), kf.f16_roundtrip(Vr)
        e = s.exits(N)
        out = np.empty_like(q)
        for a in range(0, N, self.chunk):
            b = min(N, a + self.chunk)
            out[a:b], _ = attend_chunk(qr[a:b], a, Kq, Vq, Kf, Vf, e)
        return kf.wht(out) if s.rot else out


@dataclass(frozen=True)
class Buckets:
    """A bucketed cache's policy.
    tiers: allowed tiers, any order: lowbit.TIERS names, or 'K/V' pairs ('Q4/Q2': K Q4, V Q2); target: bits per value at the full
    context, all bytes (FP16 sinks + window, each row's tier codes and parameters, the slot
    map); importance: 'online' (sampled attention, EMA, max over the query heads of a KV head),
    'oracle' (hindsight: attention each row gets from all later queries of the F16-cache run,
    divided by their number, max over heads), 'random'; ema_halflife: in positions (0: running
    mean, ZipCache's normalized score); alpha: harm of a row = score^alpha * tier error;
    hyst_count / hyst_margin: a row is demoted voluntarily only after being below its tier's
    boundary by the margin for this many consecutive updates (the budget is hard: over it, rows
    nearest their boundary are demoted at once, 'forced'); budget: 'current' (the target held
    over the rows present at every step) or 'fixed' (the memory of the full context from the
    start: rows stay high until it fills); scope: 'kv_head' (each K/V head's rows get tiers of
    their own) or 'sequence' (seed 003's layout: a token's K/V heads share its tier, importance
    the largest over all query heads, the budget over all heads' rows)."""
    name: str
    tiers: tuple
    target: float
    importance: str = "online"
    interval: int = 16
    ema_halflife: int = 0
    alpha: float = 1.0
    k_weight: float = 1.0
    sample: str = "last"  # 'last': the chunk's last query; 'all': every query of the chunk
    hyst_count: int = 2
    hyst_margin: float = 0.1
    budget: str = "current"
    sinks: int = 4
    window: int = 128
    rot: bool = True
    seed: int = 0
    scope: str = "kv_head"


def tier_pair(name):
    """'Q4/Q2': K in Q4, V in Q2; 'Q4': both."""
    k, _, v = name.partition("/")
    return lb.TIERS[k], lb.TIERS[v or k]


def lower_hull(cost, err):
    """Indices of the tiers on the lower convex hull of (cost, err), by cost descending: the
    only tiers a bits-for-error trade ever picks (a tier no better than a cheaper one, or above
    the chord of its neighbours, is never worth its bits)."""
    order = sorted(range(len(cost)), key=lambda i: (cost[i], err[i]))
    hull = []
    for i in order:
        if hull and err[i] >= err[hull[-1]]:
            continue
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            cross = (cost[a] - cost[o]) * (err[i] - err[o]) - (err[a] - err[o]) * (cost[i] - cost[o])
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    return hull[::-1]


class BucketCache:
    def __init__(self, pol, N, oracle=None):
        self.pol = pol
        self.N = N
        self.oracle = oracle  # {layer: [G, N]} for importance 'oracle'
        self.kv = {}
        self.stats = {}

    def kv_hook(self, layer, K, V):
        self.kv[layer] = (K, V)
        return K, V

    def _setup(self, Kr, Vr):
        p = self.pol
        N, G, D = Kr.shape
        names = list(p.tiers)
        tiers = [tier_pair(n) for n in names]
        # the slot map: one per row of a K/V head, or per token for scope 'sequence'
        maps = G if p.scope == "sequence" else 1
        cost = [(k.bpv + v.bpv) / 2 + lb.MAP_BITS / (2 * D * maps) for k, v in tiers]
        # tier error: relative MSE on this layer's first rows (a constant per tier and layer),
        # K's weighted by k_weight
        n0 = min(N, 512)

        def rel(t, x):
            return float(np.sum((t.roundtrip(x) - x) ** 2) / np.sum(x.astype(np.float64) ** 2))

        err = [p.k_weight * rel(k, Kr[:n0]) + rel(v, Vr[:n0]) for k, v in tiers]
        h = lower_hull(cost, err)
        self.t_names = [names[i] for i in h]
        self.tiers = [tiers[i] for i in h]
        self.cost = np.array([cost[i] for i in h])
        self.err = np.array([err[i] for i in h])
        # boundary i (between tier i and i + 1): a row stays at or above tier i if w > lam * c[i]
        self.c = (self.cost[:-1] - self.cost[1:]) / (self.err[1:] - self.err[:-1])
        P = p.sinks + p.window
        self.bq = (p.target * N - 16.0 * P) / (N - P)  # average bits of an assigned row at N
        return dict(tiers_allowed=names, tiers_on_hull=self.t_names,
                    tier_cost_bits=[float(x) for x in cost], tier_rel_mse=err)

    def _ideal(self, w, budget):
        """Tier index per row (0 = most bits) minimizing sum(w * err) under sum(cost) <= budget,
        and the multiplier lam."""
        m = len(self.cost)
        n = w.size
        if m == 1 or budget >= n * self.cost[0]:
            return np.zeros(n, np.int64), 0.0
        ws = np.sort(w)
        if budget <= n * self.cost[-1]:
            return np.full(n, m - 1, np.int64), np.inf

        def bits(lam):
            above = n - np.searchsorted(ws, lam * self.c, side="right")  # rows at tier <= i
            cnt = np.diff(np.concatenate([[0], above, [n]]))
            return float(cnt @ self.cost)

        lo, hi = -80.0, 80.0  # log lam
        for _ in range(64):
            mid = (lo + hi) / 2
            if bits(np.exp(mid)) > budget:
                lo = mid
            else:
                hi = mid
        lam = np.exp(hi)
        return (w[:, None] <= lam * self.c[None, :]).sum(1), lam

    def _requant(self, st, rows, g, tier_idx, prev=None):
        """Rows of KV head g to tiers tier_idx, from their current values (FP16 for rows
        leaving the window; prev: the tiers they held, whose K or V format may not change)."""
        for ti in np.unique(tier_idx):
            sel = tier_idx == ti
            for w, X in enumerate((st["Kcur"], st["Vcur"])):
                fmt = self.tiers[ti][w]
                s2 = sel if prev is None else sel & np.array(
                    [self.tiers[x][w] is not fmt for x in prev], bool)
                if s2.any():
                    X[rows[s2], g] = fmt.roundtrip(X[rows[s2], g])

    def _allocate(self, g, w_all, new, st, heads=None):
        """Tiers of KV head g's rows (heads: the K/V heads whose values follow them, g unless
        given: all of them for scope 'sequence')."""
        p = self.pol
        heads = g if heads is None else heads
        tier, cnt = st["tier"][g], st["cnt"][g]
        old = np.nonzero(tier >= 0)[0]
        rows = np.concatenate([old, new])
        n = rows.size
        if n == 0:
            return
        budget = self.bq * (n if p.budget == "current" else self.N - p.sinks - p.window)
        w = w_all[rows]
        ideal, lam = self._ideal(w, budget)
        m = len(self.cost)
        no = old.size
        # rows leaving the window: their tier at once, quantized from FP16
        if new.size:
            tier[new] = ideal[no:]
            cnt[new] = 0
            self._requant(st, new, heads, ideal[no:])
        # voluntary demotions, one tier, with hysteresis
        if no:
            cur = tier[old]
            thr = np.where(cur < m - 1, lam * self.c[np.minimum(cur, m - 2)] if m > 1 else 0, -np.inf)
            elig = (ideal[:no] > cur) & (w[:no] < thr * (1 - p.hyst_margin))
            cnt[old] = np.where(elig, cnt[old] + 1, 0)
            dem = old[cnt[old] >= p.hyst_count]
            if dem.size:
                tier[dem] += 1
                cnt[dem] = 0
                self._requant(st, dem, heads, tier[dem], tier[dem] - 1)
                st["demoted"] += dem.size
        # the budget is hard: demote the rows nearest their boundary
        while True:
            cur = tier[rows]
            over = float(self.cost[cur].sum()) - budget
            if over <= 1e-9:
                break
            cand = np.nonzero(cur < m - 1)[0]
            if cand.size == 0:
                break
            ratio = w[cand] / (lam * self.c[cur[cand]]) if np.isfinite(lam) and lam > 0 else w[cand]
            order = cand[np.argsort(ratio, kind="stable")]
            save = np.cumsum(self.cost[cur[order]] - self.cost[cur[order] + 1])
            k = int(np.searchsorted(save, over - 1e-9)) + 1
            pick = rows[order[:k]]
            tier[pick] += 1
            cnt[pick] = 0
            self._requant(st, pick, heads, tier[pick], tier[pick] - 1)
            st["forced"] += pick.size
        st["last_ideal"][g] = (rows, ideal)

    def attend(self, layer, q, Kc, Vc):
        p = self.pol
        K, V = self.kv.pop(layer)
        N, G, D = K.shape
        H = q.shape[1]
        r = H // G
        Kr = kf.wht(K) if p.rot else K
        Vr = kf.wht(V) if p.rot else V
        qr = kf.wht(q) if p.rot else q
        info = self._setup(Kr, Vr)
        Kf, Vf = kf.f16_roundtrip(Kr), kf.f16_roundtrip(Vr)
        st = dict(Kcur=Kf.copy(), Vcur=Vf.copy(), tier=np.full((G, N), -1, np.int64),
                  cnt=np.zeros((G, N), np.int64), demoted=0, forced=0, last_ideal={})
        e = exit_times(N, p.sinks, p.window)
        S = np.zeros((H, N), np.float64)
        nsamp = np.zeros(N, np.int64)
        beta = 0.5 ** (p.interval / p.ema_halflife) if p.ema_halflife else None
        if p.importance == "random":
            fixed = np.random.default_rng((p.seed, layer)).random((G, N))
        elif p.importance == "oracle":
            fixed = self.oracle[layer]
        out = np.empty_like(q)
        for a in range(0, N, p.interval):
            b = min(N, a + p.interval)
            lo, hi = max(p.sinks, a - p.window), max(p.sinks, b - p.window)
            new = np.arange(lo, hi) if hi > lo else np.zeros(0, np.int64)
            if (new.size or a >= p.sinks + p.window) and p.scope == "sequence":
                w = S.max(axis=0) if p.importance == "online" else fixed.max(axis=0)
                self._allocate(0, w ** p.alpha, new, st, heads=slice(None))
            elif new.size or a >= p.sinks + p.window:
                for g in range(G):
                    if p.importance == "online":
                        w = S[g * r:(g + 1) * r].max(axis=0)
                    else:
                        w = fixed[g]
                    self._allocate(g, w ** p.alpha, new, st)
            out[a:b], pl = attend_chunk(qr[a:b], a, st["Kcur"], st["Vcur"], Kf, Vf, e,
                                        p_sum=p.sample == "all")
            if p.importance == "online":
                seen = nsamp[:b]
                # queries of this update that saw each row (1 when sampling the last one)
                nq = (b - np.maximum(np.arange(b), a)) if p.sample == "all" else np.ones(b, np.int64)
                if beta is None:
                    S[:, :b] = (S[:, :b] * seen + pl) / (seen + nq)
                else:
                    S[:, :b] = np.where(seen > 0, beta * S[:, :b] + (1 - beta) * pl / nq, pl / nq)
                nsamp[:b] += nq
        # statistics at the end of the context
        tier = st["tier"]
        if p.scope == "sequence":  # head 0's tiers are every head's
            tier[1:] = tier[0]
            st["last_ideal"] = {g: st["last_ideal"][0] for g in range(G)} if st["last_ideal"] else {}
        m = len(self.cost)
        counts = [int((tier == i).sum()) for i in range(m)]
        n16 = int((tier < 0).sum())
        bits = (float(sum(c * self.cost[i] for i, c in enumerate(counts))) + 16.0 * n16) / (G * N)
        promote = 0
        for g, (rows, ideal) in st["last_ideal"].items():
            promote += int((ideal < tier[g][rows]).sum())
        info.update(tier_counts=dict(zip(self.t_names, counts)), fp16_rows=n16, bits=bits,
                    demoted=st["demoted"], forced=st["forced"], want_promotion=promote)
        self.stats[layer] = info
        return kf.wht(out) if p.rot else out

    def summary(self):
        L = len(self.stats)
        tot = {}
        for s in self.stats.values():
            for k, v in s["tier_counts"].items():
                tot[k] = tot.get(k, 0) + v
        n = sum(tot.values()) + sum(s["fp16_rows"] for s in self.stats.values())
        return dict(bits=float(np.mean([s["bits"] for s in self.stats.values()])),
                    tier_share={k: v / n for k, v in tot.items()},
                    protected_share=sum(s["fp16_rows"] for s in self.stats.values()) / n,
                    demoted=sum(s["demoted"] for s in self.stats.values()),
                    forced=sum(s["forced"] for s in self.stats.values()),
                    want_promotion=sum(s["want_promotion"] for s in self.stats.values()),
                    tiers_on_hull=sorted({tuple(s["tiers_on_hull"]) for s in self.stats.values()}),
                    layers=L)
