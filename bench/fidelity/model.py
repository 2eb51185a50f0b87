"""NumPy float32 forward pass of a GGUF Llama model (SmolLM2-135M-Instruct), teacher-forced over a
whole sequence, with a pluggable KV cache and attention.

    python3 model.py [--gguf PATH] [--prompt TEXT] [--text FILE] [--tokens N]

prints a greedy continuation of a prompt and the perplexity over the first N tokens of a text.

Conventions (checked against llama.cpp): GGUF stores attn_q/attn_k rows permuted by
convert_hf_to_gguf.py so that RoPE rotates *adjacent* pairs (x[2i], x[2i+1]) by pos * base^(-2i/d)
(ggml's LLAMA_ROPE_TYPE_NORM). K and q therefore live in the "interleaved" dim order; the KV
cache stores K in that order (as llama.cpp does). `dim_order="hf"` permutes K and q (and nothing
else; dot products are unchanged) to the Hugging Face rotate_half order, where the 32-dim groups of
the quantized formats see different channels.

Hooks, called per layer with all positions of the sequence:
- kv_hook(layer, K, V) -> (K', V'): what the cache would store (quantize/dequantize); K, V are
  [N, n_kv_heads, head_dim] float32 after RoPE.
- attend(layer, q, K_cache, V_cache) -> out [N, n_heads, head_dim]: causal attention of every
  position over the cache (position t sees cache rows 0..t), the decode computation for each t.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from tokenizer import Tokenizer  # noqa: E402

DEFAULT_CACHE = os.environ.get("M40LLM_CACHE", os.path.expanduser("~/.cache/m40llm"))
DEFAULT_GGUF = os.path.join(DEFAULT_CACHE, "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_gguf(path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(path)
    f = r.fields
    arch = f["general.architecture"].contents()
    hp = dict(
        n_layers=int(f[f"{arch}.block_count"].contents()),
        d_model=int(f[f"{arch}.embedding_length"].contents()),
        n_heads=int(f[f"{arch}.attention.head_count"].contents()),
        n_kv_heads=int(f[f"{arch}.attention.head_count_kv"].contents()),
        rope_base=float(f[f"{arch}.rope.freq_base"].contents()),
        eps=float(f[f"{arch}.attention.layer_norm_rms_epsilon"].contents()),
        ctx=int(f[f"{arch}.context_length"].contents()),
    )
    hp["head_dim"] = hp["d_model"] // hp["n_heads"]
    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type)
        w[t.name] = np.ascontiguousarray(a.reshape([int(x) for x in reversed(t.shape)])
                                         .astype(np.float32))
    return hp, w, Tokenizer.from_gguf(r)


def rms_norm(x, g, eps):
    return (x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))) * g


def rope_tables(n, head_dim, base):
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x, cos, sin):
    """x [N, H, D] interleaved pairs; cos/sin [N, D/2]."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def hf_order(head_dim):
    """Permutation taking the GGUF interleaved order to the HF rotate_half order."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def causal_attention(q, K, V, scale=None, chunk=256):
    """q [N, H, D], K/V [N, G, D] -> [N, H, D]; position t attends to rows 0..t. float32."""
    N, H, D = q.shape
    G = K.shape[1]
    r = H // G
    scale = np.float32(1.0 / np.sqrt(D)) if scale is None else np.float32(scale)
    out = np.empty_like(q)
    qg = q.reshape(N, G, r, D).transpose(1, 0, 2, 3)  # [G, N, r, D]
    Kt = K.transpose(1, 2, 0)  # [G, D, N]
    Vg = V.transpose(1, 0, 2)  # [G, N, D]
    for a in range(0, N, chunk):
        b = min(N, a + chunk)
        qc = qg[:, a:b].reshape(G, (b - a) * r, D)
        s = np.matmul(qc, Kt[:, :, :b]) * scale  # [G, C*r, b]
        s = s.reshape(G, b - a, r, b)
        t = np.arange(a, b)[:, None, None]
        j = np.arange(b)[None, None, :]
        s = np.where(j <= t, s, -np.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        o = np.matmul(p.reshape(G, (b - a) * r, b), Vg[:, :b])  # [G, C*r, D]
        out[a:b] = o.reshape(G, b - a, r, D).transpose(1, 0, 2, 3).reshape(b - a, H, D)
    return out


class Model:
    def __init__(self, gguf_path=DEFAULT_GGUF):
        t0 = time.time()
        self.hp, self.w, self.tok = load_gguf(gguf_path)
        self.load_s = time.time() - t0
        hp = self.hp
        self.L, self.H, self.G, self.D = hp["n_layers"], hp["n_heads"], hp["n_kv_heads"], hp["head_dim"]
        w = self.w
        self.emb = w["token_embd.weight"]  # [vocab, d_model]
        self.out_w = w.get("output.weight", self.emb)  # tied when absent
        self.tied = "output.weight" not in w
        # fused projections, stored transposed for x @ W
        self.layers = []
        for i in range(self.L):
            p = f"blk.{i}."
            self.layers.append(dict(
                attn_norm=w[p + "attn_norm.weight"], ffn_norm=w[p + "ffn_norm.weight"],
                wqkv=np.ascontiguousarray(np.concatenate(
                    [w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]], 0).T),
                wo=np.ascontiguousarray(w[p + "attn_output.weight"].T),
                wgu=np.ascontiguousarray(np.concatenate(
                    [w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]], 0).T),
                wd=np.ascontiguousarray(w[p + "ffn_down.weight"].T),
            ))
        self.out_norm = w["output_norm.weight"]

    def forward(self, tokens, kv_hook=None, attend=None, capture=(), logits_from=0,
                dim_order="gguf", progress=False):
        """Teacher-forced pass over tokens. Returns (logits [N - logits_from, vocab] float32,
        captures {layer: (q, K, V)} with q/K/V float32 after RoPE and before kv_hook)."""
        hp = self.hp
        N = len(tokens)
        H, G, D = self.H, self.G, self.D
        cos, sin = rope_tables(N, D, hp["rope_base"])
        perm = hf_order(D) if dim_order == "hf" else None
        x = self.emb[np.asarray(tokens)].astype(np.float32)
        caps = {}
        t0 = time.time()
        for li, ly in enumerate(self.layers):
            h = rms_norm(x, ly["attn_norm"], hp["eps"])
            qkv = h @ ly["wqkv"]
            q = qkv[:, :H * D].reshape(N, H, D)
            k = qkv[:, H * D:(H + G) * D].reshape(N, G, D)
            v = np.ascontiguousarray(qkv[:, (H + G) * D:].reshape(N, G, D))
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            if perm is not None:
                q = np.ascontiguousarray(q[..., perm])
                k = np.ascontiguousarray(k[..., perm])
            if li in capture:
                caps[li] = (q.copy(), k.copy(), v.copy())
            kc, vc = kv_hook(li, k, v) if kv_hook else (k, v)
            o = attend(li, q, kc, vc) if attend else causal_attention(q, kc, vc)
            x = x + o.reshape(N, H * D) @ ly["wo"]
            h = rms_norm(x, ly["ffn_norm"], hp["eps"])
            gu = h @ ly["wgu"]
            F = gu.shape[1] // 2
            g = gu[:, :F]
            act = g / (1.0 + np.exp(-g)) * gu[:, F:]
            x = x + act @ ly["wd"]
            if progress:
                print(f"\r  layer {li + 1}/{self.L} {time.time() - t0:.1f}s", end="", file=sys.stderr)
        if progress:
            print(file=sys.stderr)
        h = rms_norm(x[logits_from:], self.out_norm, hp["eps"])
        return h @ self.out_w.T, caps


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity(logits, tokens, start):
    """logits[i] predicts tokens[start + i + 1]."""
    lp = log_softmax(logits[:-1])
    tgt = np.asarray(tokens[start + 1:start + len(logits)])
    nll = -lp[np.arange(len(tgt)), tgt]
    return float(np.exp(nll.mean())), float(nll.mean())


def greedy(model, prompt_ids, n_new):
    ids = list(prompt_ids)
    for _ in range(n_new):
        logits, _ = model.forward(ids, logits_from=len(ids) - 1)
        ids.append(int(np.argmax(logits[-1])))
    return ids[len(prompt_ids):]


def read_text(paths):
    return "\n\n".join(open(p, encoding="utf-8").read() for p in paths)


DEFAULT_TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                 "/usr/share/common-licenses/GPL-2", "/usr/share/common-licenses/MPL-2.0"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--prompt", default="<|im_start|>user\nWhat is the capital of France? Answer in one "
                    "sentence.<|im_end|>\n<|im_start|>assistant\n")
    ap.add_argument("--prompt2", default="The GNU General Public License is a free, copyleft license for")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--text", nargs="*", default=[p for p in DEFAULT_TEXTS if os.path.exists(p)])
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    m = Model(args.gguf)
    print(f"loaded {args.gguf} in {m.load_s:.1f}s: {m.hp}, tied output: {m.tied}")
    for pr in (args.prompt, args.prompt2):
        ids = m.tok.encode(pr)
        out = greedy(m, ids, args.new)
        print(f"prompt: {pr!r}\ngreedy: {m.tok.decode(out)!r}")
    ids = m.tok.encode(read_text(args.text))[:args.tokens]
    t0 = time.time()
    logits, _ = m.forward(ids)
    ppl, nll = perplexity(logits, ids, 0)
    print(f"perplexity over {len(ids)} tokens of {args.text[0]}...: {ppl:.3f} (nll {nll:.4f}), "
          f"forward {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
