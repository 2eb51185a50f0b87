"""ctypes path to the m40llm library's CPU backend: its own KV cache (append_f32 quantizes in the
cache's format) and its own decode attention (m40llm_kvcache_attn_last_token_f32q /
attn_batch_f32q, float64 accumulation), as a drop-in `attend` for model.Model.forward.

Build the shared library (no CUDA needed):

    cmake -S . -B /tmp/m40so -DM40LLM_ENABLE_CUDA=OFF -DBUILD_SHARED_LIBS=ON && cmake --build /tmp/m40so

Options struct: version 1 (format only, F16); version 2 adds v_format (-1: same as format) and
M40LLM_KV_Q8 = 1, M40LLM_KV_Q4 = 2 (M40LLM_KV_Q3 = 3 and M40LLM_KV_Q2 = 4 came later, V only:
the format ids are kvformats.FORMAT_IDS); version 3 adds rotation (m40llm_kv_rotation: AUTO = 0,
which today rotates every quantized tensor, NONE = 1, K = 2, KV = 3), n_sinks and window
(protected tokens kept FP16 where a tensor is quantized). The struct version is the highest the
loaded library accepts (m40llm_kvcache_options_init); a v3 cache without rotation asks for NONE
explicitly (v3's default AUTO rotates), a v1/v2 cache has neither rotation nor protected tokens.
Version 4 adds tiers (n_tiers, tiers[4] of (k_format, v_format, rows)): a tiered cache, with
tier_move, tier_of, tier_stats and the importance export for a placement policy of the caller's
(lib_tiers.py); version 5 the library's own placement (PLACE_IMPORTANCE, fed by observe calls);
version 6 observe_interval, the cache's own observe calls among plain ones (0 here unless asked,
so a v6 cache behaves as a v5 one); version 7 demote_margin, the placement's hysteresis (0 unless
asked).
"""
import ctypes as C
import os

import numpy as np

BACKEND_CPU = 2
ROTATE_AUTO, ROTATE_NONE, ROTATE_K, ROTATE_KV = 0, 1, 2, 3


class ContextOptions(C.Structure):
    _fields_ = [("version", C.c_uint), ("backend", C.c_int), ("device", C.c_int),
                ("cuda_stream", C.c_void_p)]


class KvOptionsV1(C.Structure):
    _fields_ = [("version", C.c_uint), ("n_layers", C.c_int), ("n_heads", C.c_int),
                ("n_kv_heads", C.c_int), ("head_dim", C.c_int), ("max_seqs", C.c_int),
                ("max_seq_len", C.c_int), ("format", C.c_int)]


class KvOptionsV2(C.Structure):
    _fields_ = KvOptionsV1._fields_ + [("v_format", C.c_int)]


class KvOptionsV3(C.Structure):
    _fields_ = KvOptionsV2._fields_ + [("rotation", C.c_int), ("n_sinks", C.c_int),
                                       ("window", C.c_int)]


class KvTier(C.Structure):
    _fields_ = [("k_format", C.c_int), ("v_format", C.c_int), ("rows", C.c_int)]


class KvOptionsV4(C.Structure):
    _fields_ = KvOptionsV3._fields_ + [("n_tiers", C.c_int), ("tiers", KvTier * 4)]


class KvOptionsV5(C.Structure):
    _fields_ = KvOptionsV4._fields_ + [("placement", C.c_int)]


class KvOptionsV6(C.Structure):
    _fields_ = KvOptionsV5._fields_ + [("observe_interval", C.c_int)]


class KvOptionsV7(C.Structure):
    _fields_ = KvOptionsV6._fields_ + [("demote_margin", C.c_float)]


PLACE_FIRST_FREE, PLACE_IMPORTANCE = 0, 1


class TierStats(C.Structure):
    _fields_ = [("version", C.c_uint), ("n_tiers", C.c_int), ("rows", C.c_int64 * 4),
                ("free_rows", C.c_int64 * 4), ("kept_rows", C.c_int64),
                ("bits_per_value", C.c_double), ("moved_rows", C.c_int64),
                ("demoted_rows", C.c_int64), ("observe_calls", C.c_int64)]


KV_OPTIONS = {1: KvOptionsV1, 2: KvOptionsV2, 3: KvOptionsV3, 4: KvOptionsV4, 5: KvOptionsV5,
              6: KvOptionsV6, 7: KvOptionsV7}


class LibraryError(RuntimeError):
    pass


class Library:
    def __init__(self, path):
        if os.path.isdir(path):
            path = os.path.join(path, "libm40llm.so")
        self.path = path
        L = self.lib = C.CDLL(path)
        P, I, F = C.c_void_p, C.c_int, C.c_float
        fp = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
        L.m40llm_version_string.restype = C.c_char_p
        L.m40llm_status_string.restype = C.c_char_p
        L.m40llm_last_error_message.restype = C.c_char_p
        L.m40llm_context_options_init.argtypes = [C.POINTER(ContextOptions), C.c_uint]
        L.m40llm_context_create.argtypes = [C.POINTER(P), C.POINTER(ContextOptions)]
        L.m40llm_context_destroy.argtypes = [P]
        L.m40llm_context_destroy.restype = None
        L.m40llm_kvcache_options_init.argtypes = [P, C.c_uint]
        L.m40llm_kvcache_create.argtypes = [C.POINTER(P), P, P]
        L.m40llm_kvcache_get_options.argtypes = [P, P]
        L.m40llm_kvcache_destroy.argtypes = [P]
        L.m40llm_kvcache_destroy.restype = None
        L.m40llm_kvcache_seq_reset.argtypes = [P, I]
        L.m40llm_kvcache_seq_len.argtypes = [C.POINTER(I), P, I, I]
        L.m40llm_kvcache_append_f32.argtypes = [P, I, I, fp, fp, I]
        L.m40llm_kvcache_read_f16.argtypes = [np.ctypeslib.ndpointer(np.uint16, flags="C_CONTIGUOUS"),
                                              np.ctypeslib.ndpointer(np.uint16, flags="C_CONTIGUOUS"),
                                              P, I, I, I, I]
        L.m40llm_kvcache_attn_last_token_f32q.argtypes = [fp, P, I, I, fp, F]
        L.m40llm_kvcache_attn_batch_f32q.argtypes = [fp, P, I, np.ctypeslib.ndpointer(np.int32),
                                                     I, fp, F]
        if hasattr(L, "m40llm_kvcache_tier_stats"):  # libraries with tiers
            L.m40llm_kvcache_tier_move.argtypes = [P, I, I, I, I, I]
            L.m40llm_kvcache_tier_of.argtypes = [C.POINTER(I), P, I, I, I]
            L.m40llm_kvcache_tier_stats.argtypes = [C.POINTER(TierStats), P]
        self.version = L.m40llm_version_string().decode()
        self.kv_options_version = 1
        for ver in (7, 6, 5, 4, 3, 2):
            if L.m40llm_kvcache_options_init(C.byref(KV_OPTIONS[ver]()), ver) == 0:
                self.kv_options_version = ver
                break
        opts = ContextOptions()
        self.check(L.m40llm_context_options_init(C.byref(opts), 1), "context_options_init")
        opts.backend = BACKEND_CPU
        self.ctx = P()
        self.check(L.m40llm_context_create(C.byref(self.ctx), C.byref(opts)), "context_create")

    def check(self, rc, what):
        if rc != 0:
            raise LibraryError(f"{what}: {self.lib.m40llm_status_string(rc).decode()} "
                               f"({self.lib.m40llm_last_error_message().decode()})")

    def needs_version(self, k_format, v_format=-1, rotation=ROTATE_NONE, n_sinks=0, window=0,
                      tiers=(), placement=PLACE_FIRST_FREE, observe_interval=0, demote_margin=0.0):
        """The options struct version a cache with these settings needs."""
        if demote_margin:
            return 7
        if observe_interval:
            return 6
        if placement != PLACE_FIRST_FREE:
            return 5
        if tiers:
            return 4
        if rotation != ROTATE_NONE or n_sinks or window:
            return 3
        return 1 if k_format == 0 and v_format in (-1, 0) else 2

    def supports(self, k_format, v_format=-1, rotation=ROTATE_NONE, n_sinks=0, window=0):
        return self.needs_version(k_format, v_format, rotation, n_sinks, window) <= self.kv_options_version

    def cache(self, n_layers, n_heads, n_kv_heads, head_dim, max_seq_len, k_format=0, v_format=-1,
              max_seqs=1, rotation=ROTATE_NONE, n_sinks=0, window=0, tiers=(),
              placement=PLACE_FIRST_FREE, observe_interval=0, demote_margin=0.0):
        """tiers: (k_format, v_format, rows) per tier (options version 4); the cache's formats
        are then the first tier's. observe_interval: the cache's own observe calls (version 6;
        0, the default here, leaves them to the caller, as versions up to 5 do). demote_margin:
        the placement's hysteresis (version 7)."""
        return Cache(self, n_layers, n_heads, n_kv_heads, head_dim, max_seq_len, k_format,
                     v_format, max_seqs, rotation, n_sinks, window, tiers, placement,
                     observe_interval, demote_margin)

    def options(self, n_layers, n_heads, n_kv_heads, head_dim, max_seq_len, k_format=0,
                v_format=-1, max_seqs=1, rotation=ROTATE_NONE, n_sinks=0, window=0, tiers=(),
                placement=PLACE_FIRST_FREE, observe_interval=0, demote_margin=0.0):
        """The options struct of the oldest version these settings need (see cache())."""
        L = self.lib
        if tiers:
            k_format, v_format = tiers[0][0], tiers[0][1]
        if v_format == k_format:
            v_format = -1
        need = self.needs_version(k_format, v_format, rotation, n_sinks, window, tiers, placement,
                                  observe_interval, demote_margin)
        ver = self.kv_options_version
        if need > ver:
            raise LibraryError(f"this library has kvcache options version {ver}, these settings "
                               f"need {need} (format {k_format}/{v_format}, rotation {rotation}, "
                               f"sinks {n_sinks}, window {window})")
        o = KV_OPTIONS[ver]()
        self.check(L.m40llm_kvcache_options_init(C.byref(o), ver), f"kvcache_options_init({ver})")
        if ver >= 2:
            o.v_format = v_format
        if ver >= 3:
            o.rotation, o.n_sinks, o.window = rotation, n_sinks, window
        if tiers:
            o.n_tiers = len(tiers)
            for t, (kf_, vf_, rows) in enumerate(tiers):
                o.tiers[t].k_format, o.tiers[t].v_format, o.tiers[t].rows = kf_, vf_, rows
        if ver >= 5:
            o.placement = placement
        if ver >= 6:
            o.observe_interval = observe_interval
        if ver >= 7:
            o.demote_margin = demote_margin
        o.n_layers, o.n_heads, o.n_kv_heads, o.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        o.max_seqs, o.max_seq_len, o.format = max_seqs, max_seq_len, k_format
        return o

    def plan_tiers(self, bits, *args, **kwargs):
        """The rows m40llm_kvcache_plan_tiers gives the tiers of options(*args, **kwargs) (their
        rows ignored) for at most `bits` bits a K/V value, every byte counted."""
        o = self.options(*args, **kwargs)
        f = self.lib.m40llm_kvcache_plan_tiers
        f.argtypes = [C.c_void_p, C.c_double]
        self.check(f(C.byref(o), bits), f"kvcache_plan_tiers({bits})")
        return [o.tiers[t].rows for t in range(o.n_tiers)]

    def close(self):
        if self.ctx:
            self.lib.m40llm_context_destroy(self.ctx)
            self.ctx = None


class Cache:
    def __init__(self, lib, n_layers, n_heads, n_kv_heads, head_dim, max_seq_len, k_format,
                 v_format, max_seqs, rotation=ROTATE_NONE, n_sinks=0, window=0, tiers=(),
                 placement=PLACE_FIRST_FREE, observe_interval=0, demote_margin=0.0):
        self.lib = lib
        L = lib.lib
        o = lib.options(n_layers, n_heads, n_kv_heads, head_dim, max_seq_len, k_format, v_format,
                        max_seqs, rotation, n_sinks, window, tiers, placement, observe_interval,
                        demote_margin)
        ver = o.version
        self.H, self.G, self.D = n_heads, n_kv_heads, head_dim
        self.h = C.c_void_p()
        lib.check(L.m40llm_kvcache_create(C.byref(self.h), lib.ctx, C.byref(o)), "kvcache_create")
        # what the library made of it (rotation / protection as the cache holds them)
        g = KV_OPTIONS[ver]()
        g.version = ver
        lib.check(L.m40llm_kvcache_get_options(C.byref(g), self.h), "kvcache_get_options")
        self.options = {f: getattr(g, f) for f, _ in g._fields_}

    def reset(self, seq=0):
        self.lib.check(self.lib.lib.m40llm_kvcache_seq_reset(self.h, seq), "seq_reset")

    def append(self, layer, k, v, seq=0):
        k = np.ascontiguousarray(k, np.float32)
        v = np.ascontiguousarray(v, np.float32)
        n = k.shape[0] if k.ndim == 3 else 1
        self.lib.check(self.lib.lib.m40llm_kvcache_append_f32(self.h, layer, seq, k, v, n), "append_f32")

    def read_f16(self, layer, pos, n, seq=0):
        k = np.empty((n, self.G, self.D), np.uint16)
        v = np.empty_like(k)
        self.lib.check(self.lib.lib.m40llm_kvcache_read_f16(k, v, self.h, layer, seq, pos, n), "read_f16")
        return k.view(np.float16).astype(np.float32), v.view(np.float16).astype(np.float32)

    def attn_batch(self, layer, q, seq_ids):
        q = np.ascontiguousarray(q, np.float32)
        out = np.empty_like(q)
        ids = np.ascontiguousarray(seq_ids, np.int32)
        self.lib.check(self.lib.lib.m40llm_kvcache_attn_batch_f32q(out, self.h, layer, ids, len(ids), q, 0.0),
                       "attn_batch_f32q")
        return out

    def decode_layer(self, layer, q, K, V, seq=0):
        """Decode semantics for every position of one layer: append position t (quantized by the
        library), then attention of q[t] over the cache (positions 0..t). q [N, H, D],
        K/V [N, G, D] FP32. Returns [N, H, D]."""
        L = self.lib.lib
        N = q.shape[0]
        q = np.ascontiguousarray(q, np.float32)
        K = np.ascontiguousarray(K, np.float32)
        V = np.ascontiguousarray(V, np.float32)
        out = np.empty_like(q)
        ids = np.array([seq], np.int32)
        row = self.G * self.D * 4
        qrow = self.H * self.D * 4
        kp, vp, qp, op = (a.ctypes.data for a in (K, V, q, out))
        for t in range(N):
            rc = _append(L, self.h, layer, seq, kp + t * row, vp + t * row)
            if rc:
                self.lib.check(rc, "append_f32")
            rc = _attn(L, op + t * qrow, self.h, layer, ids, qp + t * qrow)
            if rc:
                self.lib.check(rc, "attn_batch_f32q")
        return out

    def tier_move(self, layer, begin, end, tier, seq=0):
        L = self.lib.lib
        self.lib.check(L.m40llm_kvcache_tier_move(self.h, layer, seq, begin, end, tier), "tier_move")

    def tier_of(self, layer, pos, seq=0):
        t = C.c_int()
        self.lib.check(self.lib.lib.m40llm_kvcache_tier_of(C.byref(t), self.h, layer, seq, pos),
                       "tier_of")
        return t.value

    def tier_stats(self):
        st = TierStats()
        # versions 2 and 3 add demoted_rows and observe_calls: read where the library has them
        st.version = 3 if self.lib.kv_options_version >= 6 else 1
        self.lib.check(self.lib.lib.m40llm_kvcache_tier_stats(C.byref(st), self.h), "tier_stats")
        n = st.n_tiers
        out = dict(rows=list(st.rows[:n]), free_rows=list(st.free_rows[:n]),
                   kept_rows=st.kept_rows, bits_per_value=st.bits_per_value,
                   moved_rows=st.moved_rows)
        if st.version == 3:
            out.update(demoted_rows=st.demoted_rows, observe_calls=st.observe_calls)
        return out

    def attn_observe(self, layer, q, seq=0):
        """Attention of one q row [H, D] whose weights feed the cache's importance placement
        (m40llm_kvcache_attn_observe_ex; options version 5, PLACE_IMPORTANCE)."""
        q = np.ascontiguousarray(q, np.float32)
        out = np.empty_like(q)
        ids = np.array([seq], np.int32)
        f = _fn(self.lib.lib, "m40llm_kvcache_attn_observe_ex",
                [C.c_void_p, C.c_void_p, C.c_int, C.c_void_p, C.c_int, C.c_void_p, C.c_int,
                 C.c_float])
        rc = f(out.ctypes.data, self.h, layer, ids.ctypes.data, 1, q.ctypes.data, 0, 0.0)
        self.lib.check(rc, "attn_observe_ex")
        return out

    def attn_importance(self, layer, q, importance, decay, seq=0):
        """Attention of one q row [H, D] over the cache, and importance [G, stride] (float32,
        updated in place: decay * itself + the largest weight over each K/V head's query heads)."""
        q = np.ascontiguousarray(q, np.float32)
        out = np.empty_like(q)
        ids = np.array([seq], np.int32)
        f = _fn(self.lib.lib, "m40llm_kvcache_attn_importance_ex",
                [C.c_void_p, C.c_void_p, C.c_size_t, C.c_float, C.c_void_p, C.c_int, C.c_void_p,
                 C.c_int, C.c_void_p, C.c_int, C.c_float])
        rc = f(out.ctypes.data, importance.ctypes.data, importance.shape[1], decay, self.h, layer,
               ids.ctypes.data, 1, q.ctypes.data, 0, 0.0)
        self.lib.check(rc, "attn_importance_ex")
        return out

    def close(self):
        if self.h:
            self.lib.lib.m40llm_kvcache_destroy(self.h)
            self.h = None


_raw = {}


def _fn(L, name, argtypes):
    key = (id(L), name)
    if key not in _raw:
        g = C.CFUNCTYPE(C.c_int, *argtypes)((name, L))
        _raw[key] = g
    return _raw[key]


def _append(L, h, layer, seq, kp, vp):
    f = _fn(L, "m40llm_kvcache_append_f32",
            [C.c_void_p, C.c_int, C.c_int, C.c_void_p, C.c_void_p, C.c_int])
    return f(h, layer, seq, kp, vp, 1)


def _attn(L, op, h, layer, ids, qp):
    f = _fn(L, "m40llm_kvcache_attn_batch_f32q",
            [C.c_void_p, C.c_void_p, C.c_int, C.c_void_p, C.c_int, C.c_void_p, C.c_float])
    return f(op, h, layer, ids.ctypes.data, 1, qp, 0.0)


class LibraryAttend:
    """kv_hook/attend pair for Model.forward: the cache is the library's (it quantizes on append),
    the attention is the library's, position by position (decode)."""

    def __init__(self, lib, n_layers, n_heads, n_kv_heads, head_dim, n_tokens, k_format, v_format,
                 rotation=ROTATE_NONE, n_sinks=0, window=0):
        self.cache = lib.cache(n_layers, n_heads, n_kv_heads, head_dim, n_tokens, k_format, v_format,
                               rotation=rotation, n_sinks=n_sinks, window=window)

    def kv_hook(self, layer, K, V):
        return K, V  # FP32 in; the library quantizes

    def attend(self, layer, q, K, V):
        return self.cache.decode_layer(layer, q, K, V)

    def close(self):
        self.cache.close()
