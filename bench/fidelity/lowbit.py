"""Float models of the candidate tier formats for mixed-precision KV buckets (issue 15), beside
the library's F16 / Q8 / Q4 (kvformats.py), and what each costs in storage.

Per token and KV head, along head_dim:
- F16: round to FP16.
- Q8: the library's symmetric 8-bit (groups of 32, one FP16 scale): kvformats.q8_*.
- Q<b>g<g>: asymmetric b-bit (b = 2, 3, 4) over groups of g dims (g = 16 or 32), two FP16
  parameters per group (scale d = f16((hi - lo) / (2^b - 1)), minimum m = f16(lo)), codes
  clip(rint((x - m) / d), 0, 2^b - 1), dequant c * d + m. Q4g32 is exactly the library's Q4.
Per channel over token blocks (KIVI's K layout, here on post-RoPE K since the cache stores K
after RoPE): kivi_k() quantizes each channel of a block of T consecutive tokens with one
(d, m) pair, asymmetric b-bit.
FP16 outlier channels: with_outliers() keeps c fixed channels of each (layer, KV head) in FP16
and quantizes the others (the outlier slots are set to a value inside the group's range first,
so they do not widen it; their codes stay in the layout, unused).
"""
from dataclasses import dataclass

import numpy as np

import kvformats as kf


@dataclass(frozen=True)
class Tier:
    name: str
    bits: int  # code bits per value; 16 for F16
    group: int = 32  # dims per parameter group (Q8: one FP16 scale; Qb: FP16 scale + minimum)

    @property
    def params_bits(self):
        """Parameter bits per value."""
        if self.bits == 16:
            return 0.0
        return (16.0 if self.bits == 8 else 32.0) / self.group

    @property
    def bpv(self):
        """Bits per value: codes plus parameters."""
        return self.bits + self.params_bits

    def bytes_per_row(self, head_dim):
        """Bytes of one token's row of one KV head (K or V alone), parameters included."""
        return head_dim * self.bpv / 8

    def roundtrip(self, x):
        x = np.asarray(x, np.float32)
        if self.bits == 16:
            return kf.f16_roundtrip(x)
        if self.bits == 8:
            c, d = kf.q8_encode(x)
            return kf.q8_decode(c, d, x.shape)
        return asym_roundtrip(x, self.bits, self.group)


def asym_roundtrip(x, bits, group, axis=-1):
    """Asymmetric b-bit over groups of `group` consecutive elements along `axis`."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    assert n % group == 0, (n, group)
    g = x.reshape(x.shape[:-1] + (n // group, group))
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    qmax = np.float32(2 ** bits - 1)
    d = ((hi - lo) / qmax).astype(np.float16).astype(np.float32)[..., None]
    m = lo.astype(np.float16).astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.clip(np.rint((g - m) / d), 0, qmax)
    c = np.where(d == 0, 0, c)
    y = (c * d + m).reshape(x.shape)
    return np.moveaxis(y, -1, axis)


TIERS = {t.name: t for t in [
    Tier("F16", 16, 1), Tier("Q8", 8, 32), Tier("Q4", 4, 32), Tier("Q4g16", 4, 16),
    Tier("Q3", 3, 32), Tier("Q3g16", 3, 16), Tier("Q2", 2, 32), Tier("Q2g16", 2, 16)]}

MAP_BITS = 32  # one int32 position per token per (layer, KV head) in a tier's slot map


def kivi_k(K, bits, block, first):
    """K [N, G, D]: per-channel asymmetric b-bit over blocks of `block` tokens starting at
    position `first` (rows before `first`, and the incomplete last block, come back
    unchanged: they stay FP16 in the cache). Returns the quantized K and the index one past
    the last complete block."""
    N = K.shape[0]
    nb = (N - first) // block
    out = np.array(K, np.float32, copy=True)
    if nb > 0:
        seg = K[first:first + nb * block].reshape(nb, block, *K.shape[1:])
        out[first:first + nb * block] = asym_roundtrip(seg, bits, block, axis=1).reshape(
            nb * block, *K.shape[1:])
    return out, first + nb * block


def outlier_channels(x, c):
    """The c channels of largest RMS of each KV head: x [N, G, D] -> [G, c] indices."""
    if c == 0:
        return np.zeros((x.shape[1], 0), np.int64)
    rms = np.sqrt((np.asarray(x, np.float64) ** 2).mean(axis=0))  # [G, D]
    return np.argsort(-rms, axis=-1)[:, :c]


def with_outliers(tier, x, idx):
    """Quantize x [N, G, D] in `tier` except channels idx [G, c] (FP16)."""
    if idx.shape[1] == 0:
        return tier.roundtrip(x)
    x = np.array(x, np.float32, copy=True)
    keep = np.take_along_axis(x, idx[None], axis=-1)
    # move each outlier slot to its group's median so it does not set the group's range
    D = x.shape[-1]
    mask = np.zeros((x.shape[1], D), bool)
    np.put_along_axis(mask, idx, True, axis=-1)
    grp = tier.group if tier.bits != 16 else D
    g = x.reshape(x.shape[0], x.shape[1], D // grp, grp)
    gm = mask.reshape(x.shape[1], D // grp, grp)
    fill = np.nanmedian(np.where(gm[None], np.nan, g), axis=-1, keepdims=True)
    g = np.where(gm[None], fill, g)
    y = tier.roundtrip(g.reshape(x.shape))
    np.put_along_axis(y, idx[None].repeat(x.shape[0], 0), kf.f16_roundtrip(keep), axis=-1)
    return y


def layout_table(head_dims=(64, 128)):
    """Bytes per token per KV head (K and V together) of each tier, parameters included, and
    with the slot map (MAP_BITS per token per KV head) that a bucket tier needs."""
    rows = []
    for t in TIERS.values():
        r = dict(tier=t.name, code_bits=t.bits, group=t.group if t.bits != 16 else None,
                 bits_per_value=t.bpv)
        for D in head_dims:
            codes = 2 * D * t.bits / 8
            params = 2 * D * t.params_bits / 8
            r[f"D{D}_codes_B"] = codes
            r[f"D{D}_params_B"] = params
            r[f"D{D}_total_B"] = codes + params
            r[f"D{D}_with_map_B"] = codes + params + MAP_BITS / 8
            r[f"D{D}_bits_per_value_with_map"] = t.bpv + MAP_BITS / (2 * D)
        rows.append(r)
    return rows
