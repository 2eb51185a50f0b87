"""Minimal GPT-2-style byte-level BPE tokenizer built from a GGUF's tokenizer.ggml.* metadata.

SmolLM2 (tokenizer.ggml.pre = "smollm") pre-splits as llama.cpp does for that pre-type: every
digit alone, then the GPT-2 regex. Special tokens (<|im_start|> etc.) are matched literally.
Needs the `regex` module for \\p{L}/\\p{N}; without it, an ASCII approximation is used (exact
for ASCII English text such as the license texts this harness reads)."""

try:
    import regex as _re

    _PAT_DIGIT = _re.compile(r"\p{N}")
    _PAT_GPT2 = _re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    EXACT_PRETOKENIZER = True
except ImportError:  # pragma: no cover
    import re as _re

    _PAT_DIGIT = _re.compile(r"\d")
    _PAT_GPT2 = _re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+|_+""")
    EXACT_PRETOKENIZER = False


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class Tokenizer:
    def __init__(self, tokens, merges, token_types=None):
        self.tokens = list(tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {}
        for i, m in enumerate(merges):
            a, b = m.split(" ", 1)
            self.ranks[(a, b)] = i
        self.byte_enc = _bytes_to_unicode()
        self.byte_dec = {v: k for k, v in self.byte_enc.items()}
        self.special = {}
        if token_types is not None:
            for i, t in enumerate(token_types):
                if int(t) == 3:  # CONTROL
                    self.special[self.tokens[i]] = i
        self._cache = {}

    @classmethod
    def from_gguf(cls, reader):
        f = reader.fields
        return cls(f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.merges"].contents(),
                   f["tokenizer.ggml.token_type"].contents())

    def _bpe(self, word):
        if word in self._cache:
            return self._cache[word]
        parts = list(word)
        while len(parts) > 1:
            best, best_i = None, -1
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            a, b = parts[best_i], parts[best_i + 1]
            out, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        ids = []
        for p in parts:
            if p in self.vocab:
                ids.append(self.vocab[p])
            else:  # cannot happen for a complete byte-level vocab; fall back to single bytes
                ids.extend(self.vocab[c] for c in p)
        self._cache[word] = ids
        return ids

    def _pretokenize(self, text):
        # llama.cpp applies the regexes in sequence: first split off single digits, then GPT-2.
        pieces = []
        pos = 0
        for m in _PAT_DIGIT.finditer(text):
            if m.start() > pos:
                pieces.append(text[pos:m.start()])
            pieces.append(m.group(0))
            pos = m.end()
        if pos < len(text):
            pieces.append(text[pos:])
        for piece in pieces:
            if _PAT_DIGIT.fullmatch(piece):
                yield piece
            else:
                yield from (m.group(0) for m in _PAT_GPT2.finditer(piece))

    def encode(self, text):
        ids = []
        segments = [text]
        if self.special:
            pat = _re.compile("(" + "|".join(_re.escape(s) for s in
                                             sorted(self.special, key=len, reverse=True)) + ")")
            segments = pat.split(text)
        for seg in segments:
            if not seg:
                continue
            if seg in self.special:
                ids.append(self.special[seg])
                continue
            for word in self._pretokenize(seg):
                enc = "".join(self.byte_enc[b] for b in word.encode("utf-8"))
                ids.extend(self._bpe(enc))
        return ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t in self.special:
                out.extend(t.encode("utf-8"))
            else:
                out.extend(self.byte_dec.get(c, ord("?")) for c in t)
        return out.decode("utf-8", errors="replace")
