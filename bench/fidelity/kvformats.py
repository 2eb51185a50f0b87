"""NumPy reference of the KV cache formats, exactly as the library implements them.

Per token, per KV head, groups of 32 consecutive dims (head_dim a multiple of 32). The input is
the FP32 K/V (rounded once, straight from FP32 to the format):
- F16: x -> float16, round-to-nearest-even.
- Q8 (symmetric, 8.5 bits/value): amax = max|x| over the group; d = f16(amax / 127) (stored);
  c = clip(rint(x / f32(d)), -127, 127) as int8 (rint: half to even), 0 where d == 0;
  dequant c * d.
- Q4 (asymmetric, 5.0 bits/value): lo, hi = min, max over the group; d = f16((hi - lo) / 15);
  m = f16(lo); c = clip(rint((x - f32(m)) / f32(d)), 0, 15), 0 where d == 0; dequant c * d + m.
- Q3 (4.0 bits/value) and Q2 (3.0), V only in the library: Q4's rule with 7 and 3 for 15.

Rotation and protected tokens (the library has both since kvcache options version 3; this is
their float reference): a normalized Walsh-Hadamard rotation over head_dim (K and q rotated;
optionally V rotated and the output rotated back), and protected tokens (the first `sinks`
positions and the most recent `window` positions, the current one included, stay FP16, rotated
as the tensor is; a position is quantized when it leaves the window). The library rotates only
tensors it quantizes; the specs here quantize every tensor they rotate. The rotation (wht) uses
the library's FP32 butterfly order, so rotated rows and codes are bit-identical to the library's;
the attention runs in FP32 or, as the library's CPU backend, in float64 (SpecCache attn_dtype).
"""
from dataclasses import dataclass

import numpy as np

GROUP = 32
FORMAT_IDS = {"F16": 0, "Q8": 1, "Q4": 2, "Q3": 3, "Q2": 4}  # m40llm_kv_format
BITS = {"FP32": 32.0, "F16": 16.0, "Q8": 8.5, "Q4": 5.0, "Q3": 4.0, "Q2": 3.0}
ASYM_BITS = {"Q4": 4, "Q3": 3, "Q2": 2}


def _groups(x):
    D = x.shape[-1]
    assert D % GROUP == 0, "head_dim must be a multiple of 32"
    return x.reshape(x.shape[:-1] + (D // GROUP, GROUP))


def f16_roundtrip(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def q8_encode(x):
    g = _groups(np.asarray(x, np.float32))
    amax = np.abs(g).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.clip(np.rint(g / d32), -127, 127)
    c = np.where(d32 == 0, 0, c).astype(np.int8)
    return c, d


def q8_decode(c, d, shape):
    return (c.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(shape)


def asym_encode(x, bits):
    """Q4 (bits 4), Q3 (3), Q2 (2): codes, FP16 scales and minimums per group."""
    qmax = np.float32(2 ** bits - 1)
    g = _groups(np.asarray(x, np.float32))
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    d = ((hi - lo) / qmax).astype(np.float16)
    m = lo.astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    m32 = m.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.clip(np.rint((g - m32) / d32), 0, qmax)
    c = np.where(d32 == 0, 0, c).astype(np.uint8)
    return c, d, m


def q4_encode(x):
    return asym_encode(x, 4)


def q4_decode(c, d, m, shape):
    return (c.astype(np.float32) * d.astype(np.float32)[..., None]
            + m.astype(np.float32)[..., None]).reshape(shape)


def roundtrip(fmt, x):
    """What the cache returns for FP32 input x [..., head_dim] in format fmt."""
    x = np.asarray(x, np.float32)
    if fmt == "FP32":
        return x.copy()
    if fmt == "F16":
        return f16_roundtrip(x)
    if fmt == "Q8":
        c, d = q8_encode(x)
        return q8_decode(c, d, x.shape)
    if fmt in ASYM_BITS:
        c, d, m = asym_encode(x, ASYM_BITS[fmt])
        return q4_decode(c, d, m, x.shape)
    raise ValueError(fmt)


def rotation_block(n):
    """The library's rotation block: the largest power of two dividing n, at most 256."""
    return min(n & -n, 256)


def wht(x, dtype=np.float32):
    """Normalized Walsh-Hadamard transform over the last axis, block-wise (rotation_block), in
    FP32 with the library's operation order (m40llm_rotate_f32: butterflies y[i] = a + c,
    y[i + h] = a - c for h = 1, 2, 4, ..., then one multiply by 1/sqrtf(block)), so that the
    rotated rows, and hence the quantized codes, are bit-identical to the library's. Its own
    inverse (up to rounding); equals x @ hadamard(block) per block. dtype float64: as the
    library rotates q and the attention output (m40llm_rotate_f64)."""
    x = np.asarray(x, dtype)
    n = x.shape[-1]
    b = rotation_block(n)
    lead = x.shape[:-1]
    y = x.reshape(lead + (n // b, b)).copy()
    h = 1
    while h < b:
        z = y.reshape(lead + (n // b, b // (2 * h), 2, h))
        a, c = z[..., 0, :], z[..., 1, :]
        y = np.stack([a + c, a - c], axis=-2).reshape(lead + (n // b, b))
        h *= 2
    y *= dtype(1) / np.sqrt(dtype(b))
    return y.reshape(x.shape)


def hadamard(n):
    """Normalized Walsh-Hadamard matrix (symmetric, orthogonal), n a power of two."""
    assert n & (n - 1) == 0
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


@dataclass(frozen=True)
class Spec:
    name: str
    k: str = "F16"
    v: str = "F16"
    rot_k: bool = False
    rot_v: bool = False
    sinks: int = 0
    window: int = 0
    preview: bool = False  # float preview: numpy only, no library equivalent (FP32)

    @property
    def protected(self):
        return self.sinks > 0 or self.window > 0

    @property
    def bits(self):
        return (BITS[self.k] + BITS[self.v]) / 2

    @property
    def library_options(self):
        """The library's cache settings for this spec (format and v_format ids, rotation as
        m40llm_kv_rotation, n_sinks, window), or None where the library has no equivalent
        (FP32, a rotated V with K unrotated). rot_k and rot_v: ROTATE_KV (3); rot_k only:
        ROTATE_K (2); neither: ROTATE_NONE (1)."""
        if self.preview or self.k not in FORMAT_IDS or self.v not in FORMAT_IDS:
            return None
        if self.rot_v and not self.rot_k:
            return None
        rotation = 3 if self.rot_v else 2 if self.rot_k else 1
        return dict(k_format=FORMAT_IDS[self.k], v_format=FORMAT_IDS[self.v], rotation=rotation,
                    n_sinks=self.sinks, window=self.window)


def mixed_attention(q, Kq, Vq, Kf=None, Vf=None, sinks=0, window=0, q_from=0, chunk=256,
                    want_p=False, scale=None, dtype=np.float32):
    """Causal attention of queries q_from..N-1 (q [N, H, D]) over a cache whose rows are Kq/Vq
    (the quantized values) except the protected ones, which come from Kf/Vf (FP16): for query t,
    row j is protected if j < sinks or j > t - window. Returns out [N - q_from, H, D] and, if
    want_p, the attention probabilities [N - q_from, H, N] (zero beyond t). dtype: what the
    scores, softmax and weighted sum are computed in (float64: as the library's CPU backend,
    whose output is then rounded to FP32 once)."""
    N, H, D = q.shape
    G = Kq.shape[1]
    r = H // G
    q, Kq, Vq = (np.asarray(a, dtype) for a in (q, Kq, Vq))
    if Kf is not None:
        Kf, Vf = np.asarray(Kf, dtype), np.asarray(Vf, dtype)
    scale = dtype(1.0 / np.sqrt(D)) if scale is None else dtype(scale)
    prot = Kf is not None and (sinks > 0 or window > 0)
    qg = q.reshape(N, G, r, D).transpose(1, 0, 2, 3)
    KqT = Kq.transpose(1, 2, 0)
    Vqg = Vq.transpose(1, 0, 2)
    if prot:
        KfT = Kf.transpose(1, 2, 0)
        dV = (Vf - Vq).transpose(1, 0, 2)
    out = np.empty((N - q_from, H, D), dtype)
    P = np.zeros((N - q_from, H, N), np.float32) if want_p else None
    for a in range(q_from, N, chunk):
        b = min(N, a + chunk)
        C = b - a
        qc = qg[:, a:b].reshape(G, C * r, D)
        s = (np.matmul(qc, KqT[:, :, :b]) * scale).reshape(G, C, r, b)
        t = np.arange(a, b)[:, None, None]
        if prot:
            lo = max(0, a - window + 1) if window > 0 else b
            if lo < b:
                sf = (np.matmul(qc, KfT[:, :, lo:b]) * scale).reshape(G, C, r, b - lo)
                jb = np.arange(lo, b)[None, None, :]
                fb = jb > t - window
                s[..., lo:b] = np.where(fb, sf, s[..., lo:b])
            S = min(sinks, b)
            if S > 0:
                s[..., :S] = (np.matmul(qc, KfT[:, :, :S]) * scale).reshape(G, C, r, S)
        j = np.arange(b)[None, None, :]
        s = np.where(j <= t, s, -np.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        pf = p.reshape(G, C * r, b)
        o = np.matmul(pf, Vqg[:, :b])
        if prot:
            if lo < b:
                w = np.where(fb & (jb >= sinks), p[..., lo:b], 0).reshape(G, C * r, b - lo)
                o += np.matmul(w, dV[:, lo:b])
            if S > 0:
                o += np.matmul(pf[:, :, :S], dV[:, :S])
        out[a - q_from:b - q_from] = o.reshape(G, C, r, D).transpose(1, 0, 2, 3).reshape(C, H, D)
        if want_p:
            P[a - q_from:b - q_from, :, :b] = p.transpose(1, 0, 2, 3).reshape(C, H, b)
    return out, P


class SpecCache:
    """kv_hook/attend pair for Model.forward implementing a Spec in numpy."""

    def __init__(self, spec, head_dim, attn_dtype=np.float32):
        self.spec = spec
        self.dtype = attn_dtype
        self.store = {}

    def kv_hook(self, layer, K, V):
        s = self.spec
        Kr = wht(K) if s.rot_k else K
        Vr = wht(V) if s.rot_v else V
        Kq, Vq = roundtrip(s.k, Kr), roundtrip(s.v, Vr)
        if s.protected:
            self.store[layer] = (f16_roundtrip(Kr), f16_roundtrip(Vr))
        return Kq, Vq

    def attend(self, layer, q, Kc, Vc):
        s = self.spec
        qr = wht(q, self.dtype) if s.rot_k else q
        Kf, Vf = self.store.pop(layer) if s.protected else (None, None)
        out, _ = mixed_attention(qr, Kc, Vc, Kf, Vf, s.sinks, s.window, dtype=self.dtype)
        return (wht(out, self.dtype) if s.rot_v else out).astype(np.float32)

    def attention_level(self, q, K, V, q_from, want_p=True):
        """Attention of queries q_from.. over this spec's cache built from FP32 q/K/V."""
        Kq, Vq = self.kv_hook(-1, K, V)
        qr = wht(q, self.dtype) if self.spec.rot_k else q
        Kf, Vf = self.store.pop(-1) if self.spec.protected else (None, None)
        out, P = mixed_attention(qr, Kq, Vq, Kf, Vf, self.spec.sinks, self.spec.window,
                                 q_from=q_from, want_p=want_p, dtype=self.dtype)
        return (wht(out, self.dtype) if self.spec.rot_v else out).astype(np.float32), P
