/*
 * Batched append (m40llm_kvcache_append_batch_f32/_f16) on any context: against the same rows
 * appended one sequence at a time on the same backend (stored values bit-identical through
 * read_f16, lengths, attention bit-identical) and against a batched append on the CPU backend
 * (stored values bit-identical, attention within 1e-5 of its float64), for every K/V format,
 * rotated and protected caches, GQA, ragged counts (0, 1, 31, 33, 257), batches of more
 * sequences than one CUDA launch takes; and errors part-way through a batch, after which every
 * sequence (lengths, stored values, the protected window) is as it was. Append-and-attend
 * (m40llm_kvcache_append_attn_f32q) against the two calls it stands for, bit for bit, and the
 * CPU backend, over batches of more sequences than one CUDA launch takes too.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

typedef struct {
  int kf, vf, n_heads, n_kv, d, rotation, sinks, window;
} batch_shape;

/* The cache, or NULL with the status in *rc (when rc is not NULL). */
static m40llm_kvcache *create(m40llm_context *ctx, batch_shape s, int n_layers, int max_seqs,
                              int max_seq_len, int *rc) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = n_layers, o.n_heads = s.n_heads, o.n_kv_heads = s.n_kv, o.head_dim = s.d;
  o.max_seqs = max_seqs, o.max_seq_len = max_seq_len;
  o.format = s.kf, o.v_format = s.vf, o.rotation = s.rotation;
  o.n_sinks = s.sinks, o.window = s.window;
  m40llm_kvcache *c = NULL;
  const int st = m40llm_kvcache_create(&c, ctx, &o);
  if (rc) *rc = st;
  return st == M40LLM_OK ? c : NULL;
}

/* Every (layer, seq)'s length and stored K/V (read_f16, FP16 bits) on the host: [layer][seq]
 * blocks of max_seq_len rows, zero past the length. */
typedef struct {
  int n_layers, max_seqs, max_len;
  size_t row;
  int *len;
  uint16_t *k, *v;
} snapshot;

static void snap_free(snapshot *s) {
  free(s->len), free(s->k), free(s->v);
  memset(s, 0, sizeof *s);
}

static int snap_take(snapshot *s, m40llm_context *ctx, m40llm_kvcache *c) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  memset(s, 0, sizeof *s);
  if (!T_OK(m40llm_kvcache_get_options(&o, c))) return 0;
  s->n_layers = o.n_layers, s->max_seqs = o.max_seqs, s->max_len = o.max_seq_len;
  s->row = (size_t)o.n_kv_heads * (size_t)o.head_dim;
  const size_t blocks = (size_t)o.n_layers * (size_t)o.max_seqs;
  const size_t block = (size_t)o.max_seq_len * s->row;
  s->len = calloc(blocks, sizeof *s->len);
  s->k = calloc(blocks * block, sizeof *s->k);
  s->v = calloc(blocks * block, sizeof *s->v);
  uint16_t *dk = t_dev_alloc(ctx, block * 2), *dv = t_dev_alloc(ctx, block * 2);
  int ok = T_CHECK(s->len && s->k && s->v && dk && dv);
  for (int l = 0; ok && l < o.n_layers; l++)
    for (int q = 0; ok && q < o.max_seqs; q++) {
      const size_t b = (size_t)l * (size_t)o.max_seqs + (size_t)q;
      ok = T_OK(m40llm_kvcache_seq_len(&s->len[b], c, l, q));
      if (!ok || s->len[b] == 0) continue;
      const size_t bytes = (size_t)s->len[b] * s->row * 2;
      ok = T_OK(m40llm_kvcache_read_f16(dk, dv, c, l, q, 0, s->len[b])) &&
           t_dev_download(ctx, s->k + b * block, dk, bytes) &&
           t_dev_download(ctx, s->v + b * block, dv, bytes);
    }
  m40llm_free(ctx, dk);
  m40llm_free(ctx, dv);
  if (!ok) snap_free(s);
  return ok;
}

/* Whether two snapshots hold the same lengths and bits; reports the first difference. */
static int snap_same(const snapshot *a, const snapshot *b, const char *what) {
  if (!a->len || !b->len) return 0;
  const size_t block = (size_t)a->max_len * a->row;
  for (int l = 0; l < a->n_layers; l++)
    for (int q = 0; q < a->max_seqs; q++) {
      const size_t i = (size_t)l * (size_t)a->max_seqs + (size_t)q;
      if (!T_CHECKF(a->len[i] == b->len[i], "%s: layer %d seq %d has length %d, want %d", what,
                    l, q, a->len[i], b->len[i]))
        return 0;
      for (size_t e = 0; e < (size_t)a->len[i] * a->row; e++) {
        const uint16_t ka = a->k[i * block + e], kb = b->k[i * block + e];
        const uint16_t va = a->v[i * block + e], vb = b->v[i * block + e];
        if (!T_CHECKF(ka == kb && va == vb,
                      "%s: layer %d seq %d position %zu differs: K %04x want %04x, V %04x want "
                      "%04x", what, l, q, e / a->row, ka, kb, va, vb))
          return 0;
      }
    }
  return T_CHECK(1);
}

/* Fills every sequence of every layer with random rows to max_seq_len, then empties it: rows
 * (and FP16 slots) a batched append fails to write then hold values no other cache has. */
static int poison(m40llm_context *ctx, m40llm_kvcache *c, int n_layers, int max_seqs, int max_len,
                  size_t row) {
  const size_t n = (size_t)max_len * row;
  float *h = malloc(n * sizeof(float));
  if (!T_CHECK(h)) return 0;
  t_fill_uniform(h, n, -50.0f, 50.0f);
  float *d = t_dev_upload(ctx, h, n * sizeof(float));
  int ok = d != NULL;
  for (int l = 0; ok && l < n_layers; l++)
    for (int q = 0; ok && q < max_seqs; q++)
      ok = T_OK(m40llm_kvcache_append_f32(c, l, q, d, d + row, max_len - 1)) &&
           T_OK(m40llm_kvcache_append_f32(c, l, q, d, d, 1));
  for (int q = 0; ok && q < max_seqs; q++) ok = T_OK(m40llm_kvcache_seq_reset(c, q));
  m40llm_free(ctx, d);
  free(h);
  return ok;
}

static void shuffle(int32_t *a, int n) {
  for (int i = n - 1; i > 0; i--) {
    const int j = t_rand_int(0, i);
    const int32_t t = a[i];
    a[i] = a[j], a[j] = t;
  }
}

/* The caches one shape is checked on: batched (a) and one by one (b) on ctx, batched on the
 * CPU (c). */
typedef struct {
  m40llm_context *ctx, *cpu;
  m40llm_kvcache *a, *b, *c;
  batch_shape s;
  int n_layers, max_seqs, max_len;
  size_t row;
} trio;

/* One batch of fresh random rows into layer `layer` of the three caches; counts NULL: one each.
 * Returns whether every call succeeded. */
static int trio_append(trio *t, int layer, const int32_t *ids, const int32_t *counts, int n,
                       int use_f16) {
  size_t total = 0;
  for (int i = 0; i < n; i++) total += counts ? (size_t)counts[i] : 1;
  if (total == 0) total = 1; /* rows enough for an upload; none are read */
  const size_t elems = total * t->row, esz = use_f16 ? 2 : 4;
  float *k = malloc(elems * sizeof(float)), *v = malloc(elems * sizeof(float));
  uint16_t *hk = malloc(elems * 2), *hv = malloc(elems * 2);
  int ok = T_CHECK(k && v && hk && hv);
  if (ok) {
    t_fill_uniform(k, elems, -2.0f, 2.0f);
    t_fill_uniform(v, elems, -3.0f, 3.0f);
    for (size_t i = 0; i < elems; i++) hk[i] = t_f32_to_f16(k[i]), hv[i] = t_f32_to_f16(v[i]);
  }
  const void *sk = use_f16 ? (const void *)hk : (const void *)k;
  const void *sv = use_f16 ? (const void *)hv : (const void *)v;
  unsigned char *dk = ok ? t_dev_upload(t->ctx, sk, elems * esz) : NULL;
  unsigned char *dv = ok ? t_dev_upload(t->ctx, sv, elems * esz) : NULL;
  unsigned char *ck = ok ? t_dev_upload(t->cpu, sk, elems * esz) : NULL;
  unsigned char *cv = ok ? t_dev_upload(t->cpu, sv, elems * esz) : NULL;
  ok = ok && dk && dv && ck && cv;
  if (ok && use_f16) {
    ok = T_OK(m40llm_kvcache_append_batch_f16(t->a, layer, ids, counts, n, (const uint16_t *)dk,
                                              (const uint16_t *)dv)) &&
         T_OK(m40llm_kvcache_append_batch_f16(t->c, layer, ids, counts, n, (const uint16_t *)ck,
                                              (const uint16_t *)cv));
  } else if (ok) {
    ok = T_OK(m40llm_kvcache_append_batch_f32(t->a, layer, ids, counts, n, (const float *)dk,
                                              (const float *)dv)) &&
         T_OK(m40llm_kvcache_append_batch_f32(t->c, layer, ids, counts, n, (const float *)ck,
                                              (const float *)cv));
  }
  size_t off = 0;
  for (int i = 0; ok && i < n; i++) {
    const int cnt = counts ? counts[i] : 1;
    if (cnt == 0) continue;
    ok = use_f16 ? T_OK(m40llm_kvcache_append_f16(t->b, layer, ids[i], (const uint16_t *)(dk + off),
                                                  (const uint16_t *)(dv + off), cnt))
                 : T_OK(m40llm_kvcache_append_f32(t->b, layer, ids[i], (const float *)(dk + off),
                                                  (const float *)(dv + off), cnt));
    off += (size_t)cnt * t->row * esz;
  }
  m40llm_free(t->ctx, dk), m40llm_free(t->ctx, dv);
  m40llm_free(t->cpu, ck), m40llm_free(t->cpu, cv);
  free(k), free(v), free(hk), free(hv);
  return ok;
}

/* The three caches' contents agree, bit for bit. */
static int trio_same(trio *t, const char *when) {
  snapshot a, b, c;
  int ok = snap_take(&a, t->ctx, t->a);
  ok = snap_take(&b, t->ctx, t->b) && ok;
  ok = snap_take(&c, t->cpu, t->c) && ok;
  char what[160];
  snprintf(what, sizeof what, "%s: batched vs one by one", when);
  ok = ok && snap_same(&a, &b, what);
  snprintf(what, sizeof what, "%s: batched vs batched on the CPU", when);
  ok = ok && snap_same(&a, &c, what);
  snap_free(&a), snap_free(&b), snap_free(&c);
  return ok;
}

/* Attention over every sequence of layer `layer`: a and b bit-identical, a within 1e-5 of c. */
static void trio_attention(trio *t, int layer) {
  const int n = t->max_seqs;
  const size_t qrow = (size_t)t->s.n_heads * (size_t)t->s.d;
  const size_t bytes = (size_t)n * qrow * sizeof(float);
  float *q = malloc(bytes), *oa = malloc(bytes), *ob = malloc(bytes), *oc = malloc(bytes);
  double *ref = malloc((size_t)n * qrow * sizeof(double));
  int32_t *ids = malloc((size_t)n * sizeof *ids);
  float *dq = t_dev_alloc(t->ctx, bytes), *dout = t_dev_alloc(t->ctx, bytes);
  float *cq = t_dev_alloc(t->cpu, bytes), *cout = t_dev_alloc(t->cpu, bytes);
  if (T_CHECK(q && oa && ob && oc && ref && ids && dq && dout && cq && cout)) {
    for (int i = 0; i < n; i++) ids[i] = i;
    t_fill_uniform(q, (size_t)n * qrow, -1.0f, 1.0f);
    int ok = T_OK(m40llm_memcpy_to_device(t->ctx, dq, q, bytes)) &&
             T_OK(m40llm_memcpy_to_device(t->cpu, cq, q, bytes));
    m40llm_kvcache *caches[3] = {t->a, t->b, t->c};
    float *outs[3] = {oa, ob, oc};
    for (int i = 0; ok && i < 3; i++) {
      m40llm_context *ctx = i == 2 ? t->cpu : t->ctx;
      float *o = i == 2 ? cout : dout;
      ok = T_OK(m40llm_memset(ctx, o, 0xFF, bytes)) &&
           T_OK(m40llm_kvcache_attn_batch_f32q(o, caches[i], layer, ids, n, i == 2 ? cq : dq,
                                               0.0f)) &&
           t_dev_download(ctx, outs[i], o, bytes);
    }
    if (ok) {
      T_CHECKF(memcmp(oa, ob, bytes) == 0,
               "attention after the batched appends differs from after the single ones");
      for (size_t i = 0; i < (size_t)n * qrow; i++) ref[i] = oc[i];
      const double err = t_rel_l2(oa, ref, (size_t)n * qrow);
      T_CHECKF(err <= 1e-5, "attention vs the CPU backend: relative L2 %.3g (bound 1e-5)", err);
    }
  }
  m40llm_free(t->ctx, dq), m40llm_free(t->ctx, dout);
  m40llm_free(t->cpu, cq), m40llm_free(t->cpu, cout);
  free(q), free(oa), free(ob), free(oc), free(ref), free(ids);
}

static int backend_is_cuda(m40llm_context *ctx) {
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  return m40llm_context_device_info(&info, ctx) == M40LLM_OK && info.backend == M40LLM_BACKEND_CUDA;
}

static int trio_open(trio *t, m40llm_context *ctx, batch_shape s, int n_layers, int max_seqs,
                     int max_len) {
  memset(t, 0, sizeof *t);
  t->ctx = ctx, t->s = s, t->n_layers = n_layers, t->max_seqs = max_seqs, t->max_len = max_len;
  t->row = (size_t)s.n_kv * (size_t)s.d;
  m40llm_context_options co = M40LLM_CONTEXT_OPTIONS_INIT;
  co.backend = M40LLM_BACKEND_CPU;
  if (!T_OK(m40llm_context_create(&t->cpu, &co))) return 0;
  int rc = M40LLM_OK;
  t->a = create(ctx, s, n_layers, max_seqs, max_len, &rc);
  if (backend_is_cuda(ctx) && !t_cuda_has_pair(s.kf, s.vf)) {
    /* the CUDA backend has kernels for some format pairs only, and says so at create */
    T_CHECKF(rc == M40LLM_ERR_UNSUPPORTED &&
                 strstr(m40llm_last_error_message(), "no kernels for K format") != NULL,
             "create returned %d (%s)", rc, m40llm_last_error_message());
    return 0;
  }
  t->b = create(ctx, s, n_layers, max_seqs, max_len, NULL);
  t->c = create(t->cpu, s, n_layers, max_seqs, max_len, NULL);
  if (!T_CHECK(t->a && t->b && t->c)) return 0;
  return poison(ctx, t->a, n_layers, max_seqs, max_len, t->row) &&
         poison(ctx, t->b, n_layers, max_seqs, max_len, t->row) &&
         poison(t->cpu, t->c, n_layers, max_seqs, max_len, t->row);
}

static void trio_close(trio *t) {
  m40llm_kvcache_destroy(t->a);
  m40llm_kvcache_destroy(t->b);
  m40llm_kvcache_destroy(t->c);
  m40llm_context_destroy(t->cpu);
}

/* One shape: 6 sequences, a ragged prefill (counts 1, 31, 33, 257, 0 and 1), then decode steps
 * (counts NULL) and ragged small counts (0..40) in turn, some rounds in FP16, on layer 1 (layer 0
 * gets one batch: layers are independent). */
static void shape_case(m40llm_context *ctx, batch_shape s, int small) {
  enum { SEQS = 6, LAYERS = 2 };
  const int rounds = small ? 6 : 10;
  const int max_len = 257 + 40 * rounds; /* the prefill, then rounds of at most 40 */
  t_set_case("batched append K %d / V %d, %d/%d heads, head_dim %d, rotation %d, sinks %d, "
             "window %d: setup", s.kf, s.vf, s.n_heads, s.n_kv, s.d, s.rotation, s.sinks, s.window);
  trio t;
  if (!trio_open(&t, ctx, s, LAYERS, SEQS, max_len)) {
    trio_close(&t);
    return;
  }
  int32_t ids[SEQS] = {0, 1, 2, 3, 4, 5}, counts[SEQS] = {1, 31, 33, 257, 0, 1};
  int ok = 1;
  for (int r = 0; ok && r < rounds; r++) {
    t_set_case("batched append K %d / V %d, %d/%d heads, head_dim %d, rotation %d, sinks %d, "
               "window %d: round %d", s.kf, s.vf, s.n_heads, s.n_kv, s.d, s.rotation, s.sinks,
               s.window, r);
    shuffle(ids, SEQS);
    const int n = r == 0 ? SEQS : t_rand_int(1, SEQS);
    const int kind = r == 0 ? 0 : 1 + r % 2; /* 0: prefill, 1: decode (counts NULL), 2: ragged */
    if (kind == 0) shuffle(counts, SEQS);
    if (kind == 2)
      for (int i = 0; i < n; i++) counts[i] = t_rand_int(0, 40);
    ok = trio_append(&t, 1, ids, kind == 1 ? NULL : counts, n, r % 4 == 3);
    if (ok && r == 1) ok = trio_append(&t, 0, ids, NULL, n, 0);
    ok = ok && trio_same(&t, "after the round");
  }
  if (ok) trio_attention(&t, 1);
  trio_close(&t);
}

/* More sequences than one CUDA launch takes (128): 300 decode tokens in shuffled order, then
 * ragged counts 0..3. */
static void wide_case(m40llm_context *ctx, batch_shape s) {
  enum { SEQS = 300 };
  t_set_case("batched append, %d sequences, K %d / V %d, sinks %d, window %d", SEQS, s.kf, s.vf,
             s.sinks, s.window);
  trio t;
  memset(&t, 0, sizeof t);
  int32_t *ids = malloc(SEQS * sizeof *ids), *counts = malloc(SEQS * sizeof *counts);
  if (T_CHECK(ids && counts) && trio_open(&t, ctx, s, 1, SEQS, 12)) {
    for (int i = 0; i < SEQS; i++) ids[i] = i;
    int ok = 1;
    for (int r = 0; ok && r < 3; r++) {
      shuffle(ids, SEQS);
      for (int i = 0; i < SEQS; i++) counts[i] = t_rand_int(0, 3);
      ok = trio_append(&t, 0, ids, r == 0 ? NULL : counts, r == 2 ? SEQS - 7 : SEQS, r == 1) &&
           trio_same(&t, "wide batch");
    }
    if (ok) trio_attention(&t, 0);
  }
  trio_close(&t);
  free(ids), free(counts);
}

/* Errors part-way through a batch leave every sequence as it was. The cache is protected (Q8,
 * 2 sinks, a window of 4) so that a stray write past a sequence's end would also land in a
 * ring slot that read_f16 returns. */
static void error_case(m40llm_context *ctx) {
  t_set_case("batched append error paths: setup");
  const batch_shape s = {M40LLM_KV_Q8, M40LLM_KV_SAME, 4, 2, 32, M40LLM_ROTATE_AUTO, 2, 4};
  enum { SEQS = 4, LEN = 10 };
  const size_t row = 2 * 32;
  m40llm_kvcache *c = create(ctx, s, 2, SEQS, LEN, NULL);
  float h[LEN * 2 * 32 * 2];
  t_fill_uniform(h, sizeof h / sizeof h[0], -1.0f, 1.0f);
  float *k = t_dev_upload(ctx, h, sizeof h);
  float *v = k ? k + LEN * row : NULL;
  const uint16_t *k16 = (const uint16_t *)k, *v16 = (const uint16_t *)v;
  snapshot before, after;
  memset(&before, 0, sizeof before);
  if (!T_CHECK(c && k)) goto done;
  const int lens[SEQS] = {3, 9, 0, 5};
  for (int q = 0; q < SEQS; q++)
    if (lens[q] && !T_OK(m40llm_kvcache_append_f32(c, 1, q, k, v, lens[q]))) goto done;
  if (!T_OK(m40llm_kvcache_append_f32(c, 0, 1, k, v, LEN))) goto done; /* full */
  if (!snap_take(&before, ctx, c)) goto done;

  const int32_t ids[4] = {0, 2, 1, 3}, ones[4] = {1, 1, 1, 1};
  const int32_t bad_last[3] = {0, 2, 4}, bad_neg[2] = {-1, 0}, dup[3] = {0, 2, 0};
  const int32_t neg[3] = {1, 1, -1}, over[3] = {1, 5, 2}, huge[2] = {1, INT_MAX};
  const int32_t full_ids[3] = {3, 0, 1};
  for (int f16 = 0; f16 < 2; f16++) {
#define BATCH(cache_, layer_, ids_, counts_, n_, kk, vv)                                        \
  (f16 ? m40llm_kvcache_append_batch_f16((cache_), (layer_), (ids_), (counts_), (n_),           \
                                         (kk) ? k16 : NULL, (vv) ? v16 : NULL)                   \
       : m40llm_kvcache_append_batch_f32((cache_), (layer_), (ids_), (counts_), (n_),           \
                                         (kk) ? k : NULL, (vv) ? v : NULL))
    t_set_case("append_batch_%s error paths", f16 ? "f16" : "f32");
    T_FAIL_WITH(BATCH(NULL, 1, ids, ones, 4, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "cache");
    T_FAIL_WITH(BATCH(c, -1, ids, ones, 4, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(BATCH(c, 2, ids, ones, 4, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "layer");
    T_FAIL_WITH(BATCH(c, 1, NULL, ones, 4, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "seq_ids");
    T_FAIL_WITH(BATCH(c, 1, ids, ones, 4, 0, 1), M40LLM_ERR_INVALID_ARGUMENT, "k");
    T_FAIL_WITH(BATCH(c, 1, ids, ones, 4, 1, 0), M40LLM_ERR_INVALID_ARGUMENT, "v");
    T_FAIL_WITH(BATCH(c, 1, ids, ones, 0, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "n_seqs");
    T_FAIL_WITH(BATCH(c, 1, ids, ones, -1, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "n_seqs");
    T_FAIL_WITH(BATCH(c, 1, ids, ones, 5, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "max_seqs");
    T_FAIL_WITH(BATCH(c, 1, bad_last, NULL, 3, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "seq_ids[2]");
    T_FAIL_WITH(BATCH(c, 1, bad_neg, NULL, 2, 1, 1), M40LLM_ERR_OUT_OF_RANGE, "seq_ids[0]");
    T_FAIL_WITH(BATCH(c, 1, dup, NULL, 3, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "repeats");
    T_FAIL_WITH(BATCH(c, 1, ids, neg, 3, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "n_tokens[2]");
    /* capacity: seq 1 holds 9 of 10; the sequences before it in the batch fit */
    T_FAIL_WITH(BATCH(c, 1, ids, over, 3, 1, 1), M40LLM_ERR_CAPACITY, "max_seq_len");
    T_FAIL_WITH(BATCH(c, 1, ids, huge, 2, 1, 1), M40LLM_ERR_CAPACITY, "max_seq_len");
    T_FAIL_WITH(BATCH(c, 0, full_ids, NULL, 3, 1, 1), M40LLM_ERR_CAPACITY, "seq 1");
    /* a repeat is refused even where its second count is 0 */
    const int32_t zero_dup[3] = {1, 0, 0};
    T_FAIL_WITH(BATCH(c, 1, dup, zero_dup, 3, 1, 1), M40LLM_ERR_INVALID_ARGUMENT, "repeats");
    /* counts of 0 only: nothing to do, which succeeds */
    const int32_t zeros[2] = {0, 0}, zero_ids[2] = {1, 2};
    T_OK(BATCH(c, 1, zero_ids, zeros, 2, 1, 1));
    T_OK(BATCH(c, 0, zero_ids + 0, zeros, 1, 1, 1)); /* seq 1 of layer 0 is full: 0 fits */
    T_OK(BATCH(c, 1, zero_ids, zeros, 2, 0, 0));     /* no rows: k and v may be NULL */
    T_FAIL_WITH(BATCH(c, 1, dup, zero_dup, 3, 0, 0), M40LLM_ERR_INVALID_ARGUMENT, "repeats");
#undef BATCH
    if (!snap_take(&after, ctx, c)) goto done;
    snap_same(&after, &before, "after the failed batches");
    snap_free(&after);
  }
  t_set_case("batched append after errors");
  {
    /* the id checks left nothing behind: the same ids are accepted, once each */
    const int32_t ids2[3] = {2, 0, 3}, counts2[3] = {3, 0, 1};
    if (T_OK(m40llm_kvcache_append_batch_f32(c, 1, ids2, counts2, 3, k, v))) {
      const int want[SEQS] = {3, 9, 3, 6};
      for (int q = 0; q < SEQS; q++) {
        int len = -1;
        if (T_OK(m40llm_kvcache_seq_len(&len, c, 1, q))) T_INT_EQ(len, want[q]);
      }
    }
  }
done:
  snap_free(&before);
  m40llm_free(ctx, k);
  m40llm_kvcache_destroy(c);
}

/* One decode step through m40llm_kvcache_append_attn_f32q on t->a and t->c (the CPU), and as
 * append_batch + attn_batch on t->b, for ids[0..n): outputs poisoned first; a's bit-identical
 * to b's and within 1e-5 of c's. On a CPU context the ids are also passed from inside a's out
 * (they may share memory); with out_is_k, a's out is its k (read before out is written).
 * Returns whether every call succeeded. */
static int fused_step(trio *t, int layer, const int32_t *ids, int n, int out_is_k) {
  const size_t row = t->row, qrow = (size_t)t->s.n_heads * (size_t)t->s.d;
  const size_t kv_bytes = (size_t)n * row * sizeof(float), q_bytes = (size_t)n * qrow * sizeof(float);
  float *k = malloc(kv_bytes), *v = malloc(kv_bytes), *q = malloc(q_bytes);
  float *oa = malloc(q_bytes), *ob = malloc(q_bytes), *oc = malloc(q_bytes);
  double *ref = malloc((size_t)n * qrow * sizeof(double));
  float *dk = NULL, *dv = NULL, *dq = NULL, *ck = NULL, *cv = NULL, *cq = NULL;
  float *da = t_dev_alloc(t->ctx, q_bytes > kv_bytes ? q_bytes : kv_bytes);
  float *db = t_dev_alloc(t->ctx, q_bytes);
  float *dc = t_dev_alloc(t->cpu, q_bytes);
  int ok = T_CHECK(k && v && q && oa && ob && oc && ref && da && db && dc);
  if (ok) {
    t_fill_uniform(k, (size_t)n * row, -2.0f, 2.0f);
    t_fill_uniform(v, (size_t)n * row, -3.0f, 3.0f);
    t_fill_uniform(q, (size_t)n * qrow, -1.0f, 1.0f);
    dk = t_dev_upload(t->ctx, k, kv_bytes), dv = t_dev_upload(t->ctx, v, kv_bytes);
    dq = t_dev_upload(t->ctx, q, q_bytes);
    ck = t_dev_upload(t->cpu, k, kv_bytes), cv = t_dev_upload(t->cpu, v, kv_bytes);
    cq = t_dev_upload(t->cpu, q, q_bytes);
    ok = dk && dv && dq && ck && cv && cq && T_OK(m40llm_memset(t->ctx, da, 0xFF, q_bytes)) &&
         T_OK(m40llm_memset(t->ctx, db, 0xFF, q_bytes)) &&
         T_OK(m40llm_memset(t->cpu, dc, 0xFF, q_bytes)) &&
         (!out_is_k || T_OK(m40llm_memcpy_to_device(t->ctx, da, k, kv_bytes)));
  }
  /* On the CPU backend, out is host memory: the ids may live in it (n ids fit one q row). */
  const int alias = ok && !out_is_k && !backend_is_cuda(t->ctx) && (size_t)n <= qrow;
  if (alias) memcpy(da, ids, (size_t)n * sizeof *ids);
  ok = ok &&
       T_OK(m40llm_kvcache_append_attn_f32q(da, t->a, layer, alias ? (const int32_t *)(void *)da : ids,
                                            n, out_is_k ? da : dk, dv, dq, 0.0f)) &&
       T_OK(m40llm_kvcache_append_batch_f32(t->b, layer, ids, NULL, n, dk, dv)) &&
       T_OK(m40llm_kvcache_attn_batch_f32q(db, t->b, layer, ids, n, dq, 0.0f)) &&
       T_OK(m40llm_kvcache_append_attn_f32q(dc, t->c, layer, ids, n, ck, cv, cq, 0.0f)) &&
       t_dev_download(t->ctx, oa, da, q_bytes) && t_dev_download(t->ctx, ob, db, q_bytes) &&
       t_dev_download(t->cpu, oc, dc, q_bytes);
  if (ok) {
    T_CHECKF(memcmp(oa, ob, q_bytes) == 0, "append_attn differs from append_batch + attn_batch");
    for (size_t i = 0; i < (size_t)n * qrow; i++) ref[i] = oc[i];
    const double err = t_rel_l2(oa, ref, (size_t)n * qrow);
    T_CHECKF(err <= 1e-5, "append_attn vs the CPU backend: relative L2 %.3g (bound 1e-5)", err);
  }
  m40llm_free(t->ctx, dk), m40llm_free(t->ctx, dv), m40llm_free(t->ctx, dq);
  m40llm_free(t->ctx, da), m40llm_free(t->ctx, db);
  m40llm_free(t->cpu, ck), m40llm_free(t->cpu, cv), m40llm_free(t->cpu, cq), m40llm_free(t->cpu, dc);
  free(k), free(v), free(q), free(oa), free(ob), free(oc), free(ref);
  return ok;
}

/* Append-and-attend against the two calls: ragged prompts, then decode steps over shuffled
 * subsets; and its errors, which write nothing (lengths, contents, out). */
static void fused_case(m40llm_context *ctx, batch_shape s) {
  enum { SEQS = 5 };
  t_set_case("append_attn K %d / V %d, %d/%d heads, head_dim %d, sinks %d, window %d", s.kf,
             s.vf, s.n_heads, s.n_kv, s.d, s.sinks, s.window);
  trio t;
  if (!trio_open(&t, ctx, s, 2, SEQS, 300)) {
    trio_close(&t);
    return;
  }
  int32_t ids[SEQS] = {0, 1, 2, 3, 4}, prompt[SEQS] = {0, 1, 31, 33, 257};
  int ok = trio_append(&t, 1, ids, prompt, SEQS, 0);
  for (int step = 0; ok && step < 12; step++) {
    shuffle(ids, SEQS);
    ok = fused_step(&t, 1, ids, t_rand_int(1, SEQS), step % 4 == 3) &&
         trio_same(&t, "after a fused step");
  }
  if (ok) {
    t_set_case("append_attn error paths");
    const size_t row = t.row, qrow = (size_t)s.n_heads * (size_t)s.d;
    float *kv = t_dev_alloc(ctx, 4 * row * sizeof(float));
    float *q = t_dev_alloc(ctx, 4 * qrow * sizeof(float)), *out = t_dev_alloc(ctx, 4 * qrow * sizeof(float));
    snapshot before, after;
    memset(&before, 0, sizeof before);
    if (kv && q && out && T_OK(m40llm_memset(ctx, kv, 0, 4 * row * sizeof(float))) &&
        T_OK(m40llm_memset(ctx, q, 0, 4 * qrow * sizeof(float))) &&
        T_OK(m40llm_memset(ctx, out, 0xFF, 4 * qrow * sizeof(float))) &&
        snap_take(&before, ctx, t.a)) {
      const int32_t dup[2] = {1, 1}, bad[2] = {0, 5}, ok_ids[2] = {0, 1};
      m40llm_kvcache *a = t.a;
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, NULL, 1, ok_ids, 2, kv, kv, q, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "cache");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 2, ok_ids, 2, kv, kv, q, 0.0f),
                  M40LLM_ERR_OUT_OF_RANGE, "layer");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, dup, 2, kv, kv, q, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "repeats");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, bad, 2, kv, kv, q, 0.0f),
                  M40LLM_ERR_OUT_OF_RANGE, "seq_ids[1]");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, ok_ids, 0, kv, kv, q, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "n_seqs");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, NULL, 2, kv, kv, q, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "seq_ids");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, ok_ids, 2, NULL, kv, q, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "k");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, ok_ids, 2, kv, kv, NULL, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "q");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, ok_ids, 2, kv, kv, q, NAN),
                  M40LLM_ERR_INVALID_ARGUMENT, "scale");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, ok_ids, 2, kv, kv, out + qrow, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "overlap");
      T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(NULL, a, 1, ok_ids, 2, kv, kv, q, 0.0f),
                  M40LLM_ERR_INVALID_ARGUMENT, "out");
      if (snap_take(&after, ctx, a)) {
        snap_same(&after, &before, "after the failed append_attn calls");
        snap_free(&after);
      }
      /* capacity: fill seq 4 (257 + steps of 300) to the end; then a batch naming it fails */
      int len = 0;
      if (T_OK(m40llm_kvcache_seq_len(&len, a, 1, 4))) {
        snap_free(&before);
        const int room = 300 - len;
        float *fill = t_dev_alloc(ctx, (size_t)room * row * sizeof(float));
        if (fill && T_OK(m40llm_memset(ctx, fill, 0, (size_t)room * row * sizeof(float))) &&
            T_OK(m40llm_kvcache_append_f32(a, 1, 4, fill, fill, room)) &&
            snap_take(&before, ctx, a)) {
          const int32_t full[3] = {0, 2, 4};
          T_FAIL_WITH(m40llm_kvcache_append_attn_f32q(out, a, 1, full, 3, kv, kv, q, 0.0f),
                      M40LLM_ERR_CAPACITY, "seq 4");
        }
        m40llm_free(ctx, fill);
      }
      float *host = malloc(4 * qrow * sizeof(float));
      if (T_CHECK(host) && t_dev_download(ctx, host, out, 4 * qrow * sizeof(float)))
        T_CHECKF(t_all_bytes(host, 4 * qrow * sizeof(float), 0xFF), "a failed append_attn wrote out");
      free(host);
      if (before.len && snap_take(&after, ctx, a)) {
        snap_same(&after, &before, "after the failed append_attn of a full sequence");
        snap_free(&after);
      }
    }
    snap_free(&before);
    m40llm_free(ctx, kv), m40llm_free(ctx, q), m40llm_free(ctx, out);
  }
  trio_close(&t);
}

/* Append-and-attend over more sequences than one CUDA launch takes, from ragged prompts (0 to
 * 20 tokens: a step's row may be a sequence's first). */
static void fused_wide_case(m40llm_context *ctx, batch_shape s) {
  enum { SEQS = 131 };
  t_set_case("append_attn, %d sequences, K %d / V %d, %d/%d heads, head_dim %d", SEQS, s.kf, s.vf,
             s.n_heads, s.n_kv, s.d);
  trio t;
  memset(&t, 0, sizeof t);
  int32_t *ids = malloc(SEQS * sizeof *ids), *counts = malloc(SEQS * sizeof *counts);
  if (T_CHECK(ids && counts) && trio_open(&t, ctx, s, 1, SEQS, 24)) {
    for (int i = 0; i < SEQS; i++) ids[i] = i, counts[i] = t_rand_int(0, 20);
    int ok = trio_append(&t, 0, ids, counts, SEQS, 0);
    for (int step = 0; ok && step < 2; step++) {
      shuffle(ids, SEQS);
      ok = fused_step(&t, 0, ids, SEQS, step) && trio_same(&t, "after a wide fused step");
    }
  }
  trio_close(&t);
  free(ids), free(counts);
}

void t_cases_append_batch(m40llm_context *ctx, int small) {
  enum { AUTO = M40LLM_ROTATE_AUTO, NONE = M40LLM_ROTATE_NONE, KV = M40LLM_ROTATE_KV };
  enum { F16 = M40LLM_KV_F16, Q8 = M40LLM_KV_Q8, Q4 = M40LLM_KV_Q4, SAME = M40LLM_KV_SAME };
  enum { Q3 = M40LLM_KV_Q3, Q2 = M40LLM_KV_Q2 };
  static const batch_shape shapes[] = {
      {F16, SAME, 32, 8, 128, AUTO, 4, 128}, /* GQA; all F16: nothing protected */
      {F16, SAME, 6, 2, 40, AUTO, 0, 0},     /* head_dim not a power of two */
      {Q8, SAME, 4, 2, 64, AUTO, 4, 16},     /* the window's ring wraps within one batch */
      {Q4, SAME, 8, 1, 96, KV, 2, 7},        /* MQA */
      {Q8, Q4, 8, 2, 128, AUTO, 4, 128},
      {Q8, SAME, 12, 4, 32, NONE, 0, 0},
      {F16, Q4, 4, 2, 64, AUTO, 3, 5},       /* the CPU backend only */
      {Q4, Q3, 8, 2, 64, AUTO, 4, 16},       /* V in 3 and 2 bits */
      {Q4, Q2, 4, 1, 128, KV, 2, 7},
  };
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) shape_case(ctx, shapes[i], small);
  wide_case(ctx, shapes[1]);
  wide_case(ctx, (batch_shape){Q8, SAME, 4, 2, 32, AUTO, 2, 3});
  error_case(ctx);
  fused_case(ctx, shapes[0]);
  fused_case(ctx, shapes[2]);
  fused_case(ctx, shapes[4]);
  fused_case(ctx, shapes[7]);
  fused_case(ctx, shapes[8]);
  /* F16 caches, whose CUDA split kernels write the rows themselves where head_dim is a multiple
   * of 16 (head_dim 40: the two calls): group 16 in two tiles of query heads, MQA at head_dim
   * 256, odd heads. */
  fused_case(ctx, shapes[1]);
  fused_case(ctx, (batch_shape){F16, SAME, 16, 1, 64, AUTO, 0, 0});
  fused_case(ctx, (batch_shape){F16, SAME, 8, 1, 256, AUTO, 0, 0});
  fused_case(ctx, (batch_shape){F16, SAME, 9, 3, 80, AUTO, 0, 0});
  fused_wide_case(ctx, (batch_shape){F16, SAME, 4, 2, 64, AUTO, 0, 0});
  fused_wide_case(ctx, (batch_shape){Q8, Q4, 4, 2, 64, AUTO, 2, 3});
  t_set_case("");
}
