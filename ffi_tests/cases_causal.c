/*
 * Causal attention over the cache (m40llm_kvcache_attn_causal_f32q) on any context: ragged
 * batches of (cached prefix P, new rows T) with T = 1, 2-16, 17-33, 64, 128, 512 (4096 outside
 * small mode), P = 0 and P > 0, GQA groups 1, 3, 4, 7, 8, 16, head_dim 64, 80, 96, 128, 256, sliding
 * windows, batches of one count (speculative verification), every K/V format (rotated, with
 * protected tokens; Q3 and Q2 V with Q4 K), K infinities (masked positions, F16), peaked rows
 * (one heavy position, the rest light and equal; small V). Output
 * poisoned first (NaN), every row checked:
 * - F16: against an independent float64 reference over the FP16 values appended (1e-5 relative
 *   L2 a row);
 * - quantized: against the CPU backend's causal call on a cache given the same rows (its
 *   float64 reference; 1e-5), and, without a window, each checked row against the decode call on
 *   a fork of its sequence truncated to the row's own position (the values a row sees are what
 *   the cache held then: bit for bit on the CPU backend, 1e-5 elsewhere);
 * - T = 1 rows against the decode call (bit for bit on the CPU backend).
 * Errors: every bad argument fails with its status and message, writes nothing and changes no
 * length.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define TOL 1e-5

typedef struct {
  int kf, vf, n_heads, n_kv, d;
} causal_shape;

typedef struct {
  m40llm_context *ctx, *cpu;
  causal_shape s;
  int n, layer, window;
  const int *P, *T;
  m40llm_kvcache *c, *ref; /* ref: the CPU backend's cache (quantized shapes, ctx not the CPU) */
  size_t kv_row, q_row;    /* floats a position of K (or V), of q */
  int rows;                /* sum of T */
  float *k, *v;            /* host: [seq][P + T][kv_row], the values appended */
  float *q;                /* host: [rows][q_row] */
} causal_case;

static m40llm_kvcache *make_cache(m40llm_context *ctx, const causal_case *t, int max_len) {
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2, o.n_heads = t->s.n_heads, o.n_kv_heads = t->s.n_kv, o.head_dim = t->s.d;
  o.max_seqs = t->n + 1, o.max_seq_len = max_len;
  o.format = t->s.kf, o.v_format = t->s.vf;
  o.n_sinks = 4, o.window = 32; /* short: prefixes reach past it, so some rows are quantized */
  m40llm_kvcache *c = NULL;
  return T_OK(m40llm_kvcache_create(&c, ctx, &o)) ? c : NULL;
}

/* Appends each sequence's P rows, then its T rows, as two batched calls (F16: the FP16 bits of
 * the values, which the host arrays then hold rounded). */
static int fill(m40llm_context *ctx, m40llm_kvcache *c, causal_case *t, int max_len) {
  int32_t *ids = malloc((size_t)t->n * sizeof *ids), *counts = malloc((size_t)t->n * sizeof *counts);
  const size_t total = (size_t)t->n * (size_t)max_len * t->kv_row;
  float *packed_k = malloc(total * sizeof(float)), *packed_v = malloc(total * sizeof(float));
  int ok = T_CHECK(ids && counts && packed_k && packed_v);
  for (int phase = 0; ok && phase < 2; phase++) {
    size_t rows = 0;
    for (int i = 0; i < t->n; i++) {
      ids[i] = i;
      const int first = phase ? t->P[i] : 0, count = phase ? t->T[i] : t->P[i];
      counts[i] = count;
      const size_t src = ((size_t)i * (size_t)max_len + (size_t)first) * t->kv_row;
      memcpy(packed_k + rows * t->kv_row, t->k + src, (size_t)count * t->kv_row * sizeof(float));
      memcpy(packed_v + rows * t->kv_row, t->v + src, (size_t)count * t->kv_row * sizeof(float));
      rows += (size_t)count;
    }
    if (rows == 0) continue;
    const size_t bytes = rows * t->kv_row * sizeof(float);
    float *dk = t_dev_upload(ctx, packed_k, bytes), *dv = t_dev_upload(ctx, packed_v, bytes);
    ok = dk && dv && T_OK(m40llm_kvcache_append_batch_f32(c, t->layer, ids, counts, t->n, dk, dv));
    m40llm_free(ctx, dk);
    m40llm_free(ctx, dv);
  }
  free(ids), free(counts), free(packed_k), free(packed_v);
  return ok;
}

/* The causal call on cache c of ctx over every sequence, output poisoned first; host result. */
/* out is the device buffer shifted by one float half the time: the API promises 4-byte alignment
 * only; the float out leaves unused must stay poisoned. */
static int run_causal(m40llm_context *ctx, m40llm_kvcache *c, const causal_case *t, float *out) {
  int32_t *ids = malloc((size_t)t->n * sizeof *ids);
  const size_t bytes = (size_t)t->rows * t->q_row * sizeof(float);
  const size_t shift = (size_t)t_rand_int(0, 1);
  float *dq = t_dev_upload(ctx, t->q, bytes), *dout = t_dev_alloc(ctx, bytes + sizeof(float));
  float edge = 0.0f;
  int ok = T_CHECK(ids) && dq && dout &&
           T_OK(m40llm_memset(ctx, dout, 0xFF, bytes + sizeof(float)));
  for (int i = 0; ok && i < t->n; i++) ids[i] = i;
  m40llm_causal_options o = M40LLM_CAUSAL_OPTIONS_INIT;
  o.window = t->window;
  ok = ok &&
       T_OK(m40llm_kvcache_attn_causal_f32q(dout + shift, c, t->layer, ids, t->T, t->n, dq, &o)) &&
       t_dev_download(ctx, out, dout + shift, bytes) &&
       t_dev_download(ctx, &edge, shift ? dout : dout + bytes / sizeof(float), sizeof edge);
  if (ok) T_CHECKF(t_all_bytes(&edge, sizeof edge, 0xFF), "a float beside out was written");
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  free(ids);
  return ok;
}

/* Row `row` of sequence i (its r-th) against the decode call on a fork of the sequence cut to
 * the row's own position, in spare slot n. */
static void check_against_decode(const causal_case *t, const float *out, int i, int r, int row) {
  const int len = t->P[i] + r + 1, spare = t->n;
  const size_t bytes = t->q_row * sizeof(float);
  float *dq = t_dev_upload(t->ctx, t->q + (size_t)row * t->q_row, bytes);
  float *dout = t_dev_alloc(t->ctx, bytes);
  float *got = malloc(bytes);
  const int32_t id = spare;
  if (T_CHECK(dq && dout && got) && T_OK(m40llm_kvcache_seq_fork(t->c, spare, i)) &&
      T_OK(m40llm_kvcache_seq_truncate(t->c, spare, len)) &&
      T_OK(m40llm_kvcache_attn_batch_f32q(dout, t->c, t->layer, &id, 1, dq, 0.0f)) &&
      t_dev_download(t->ctx, got, dout, bytes)) {
    const float *mine = out + (size_t)row * t->q_row;
    if (t->ctx == t->cpu) {
      T_CHECKF(memcmp(got, mine, bytes) == 0,
               "seq %d row %d (length %d): causal differs from decode on the CPU backend", i, r, len);
    } else {
      double *ref = malloc(t->q_row * sizeof(double));
      if (T_CHECK(ref)) {
        for (size_t e = 0; e < t->q_row; e++) ref[e] = got[e];
        const double err = t_rel_l2(mine, ref, t->q_row);
        T_CHECKF(err <= TOL, "seq %d row %d (length %d): rel L2 %g against decode", i, r, len, err);
      }
      free(ref);
    }
  }
  m40llm_free(t->ctx, dq);
  m40llm_free(t->ctx, dout);
  free(got);
}

/* What a case's values are: random, or
 * - MASKED (F16 only): K holds -inf in one dim d0, where every q is positive, at each sequence's
 *   first 40 positions, every 16th and its last: those positions score -inf and have weight 0,
 *   and rows that see only them are zeros (the reference's rule, m40llm.h's masking);
 * - PEAKED: position 0's key meets every q with a logit of 10-13 and every later key is 0, so
 *   each later position has the same weight, 2^-14.6 to 2^-18.9 of position 0's; V is near
 *   2^-12 (a quantized V's scales near 2^-18.4). The tensor-core kernels' weights (times V's
 *   scale) go to the MMAs as FP16 hi + lo terms, subnormal under 2^-14 until they were scaled
 *   (kMmaPShiftF16, causal_mma_kernel's 2^14);
 * - HUGE: PEAKED with logits near 2^27 (t_huge_qk), F16 only: each row is position 0's V. */
enum { PLAIN, MASKED, PEAKED, HUGE };
static void run_case_as(m40llm_context *ctx, m40llm_context *cpu, causal_shape s, const int *P,
                        const int *T, int n, int window, int kind) {
  const int quantized = s.kf != M40LLM_KV_F16 || s.vf != M40LLM_KV_F16;
  /* On the CPU backend a windowed quantized case has no reference but itself. */
  if (quantized && window > 0 && ctx == cpu) return;
  causal_case t = {ctx, cpu, s, n, t_rand_int(0, 1), window, P, T, NULL, NULL, 0, 0, 0,
                   NULL, NULL, NULL};
  t.kv_row = (size_t)s.n_kv * (size_t)s.d;
  t.q_row = (size_t)s.n_heads * (size_t)s.d;
  int max_len = 1;
  for (int i = 0; i < n; i++) {
    t.rows += T[i];
    if (P[i] + T[i] > max_len) max_len = P[i] + T[i];
  }
  t_set_case("causal K%d V%d heads %d/%d d %d, %d seqs, %d rows, window %d, layer %d", s.kf,
             s.vf, s.n_heads, s.n_kv, s.d, n, t.rows, window, t.layer);
  const size_t kv_n = (size_t)n * (size_t)max_len * t.kv_row;
  t.k = malloc(kv_n * sizeof(float));
  t.v = malloc(kv_n * sizeof(float));
  t.q = malloc((size_t)t.rows * t.q_row * sizeof(float));
  float *out = malloc((size_t)t.rows * t.q_row * sizeof(float));
  float *ref_out = malloc((size_t)t.rows * t.q_row * sizeof(float));
  double *ref = malloc(t.q_row * sizeof(double));
  if (!T_CHECK(t.k && t.v && t.q && out && ref_out && ref)) goto done;
  t_fill_uniform(t.k, kv_n, -1.5f, 1.5f);
  t_fill_uniform(t.v, kv_n, -1.0f, 1.0f);
  t_fill_uniform(t.q, (size_t)t.rows * t.q_row, -1.0f, 1.0f);
  if (kind == MASKED) {
    const int d0 = t_rand_int(0, s.d - 1);
    for (int i = 0; i < n; i++)
      for (int p = 0; p < P[i] + T[i]; p++)
        if (p < 40 || p % 16 == 0 || p == P[i] + T[i] - 1)
          for (int g = 0; g < s.n_kv; g++) /* append_f32 rounds it to -inf */
            t.k[((size_t)i * (size_t)max_len + (size_t)p) * t.kv_row + (size_t)g * s.d + d0] = -1e9f;
    for (int r = 0; r < t.rows; r++)
      for (int h = 0; h < s.n_heads; h++)
        t.q[(size_t)r * t.q_row + (size_t)h * s.d + d0] = t_rand_float(0.25f, 1.0f);
  } else if (kind == PEAKED || kind == HUGE) {
    float k0[256];
    (kind == HUGE ? t_huge_qk : t_peaked_qk)(t.q, s.n_heads, s.d, k0);
    for (int r = 1; r < t.rows; r++) memcpy(t.q + (size_t)r * t.q_row, t.q, t.q_row * sizeof(float));
    for (int i = 0; i < n; i++)
      for (int p = 0; p < max_len; p++)
        for (int g = 0; g < s.n_kv; g++)
          for (int e = 0; e < s.d; e++) {
            const size_t at = ((size_t)i * (size_t)max_len + (size_t)p) * t.kv_row + (size_t)g * s.d + e;
            t.k[at] = p == 0 ? k0[e] : 0.0f;
            t.v[at] = t_rand_float(0.5f, 1.5f) * 0x1p-12f;
          }
  }
  if (!quantized) /* the cache stores FP16: the reference takes the same values */
    for (size_t e = 0; e < kv_n; e++)
      t.k[e] = t_f16_to_f32(t_f32_to_f16(t.k[e])), t.v[e] = t_f16_to_f32(t_f32_to_f16(t.v[e]));
  if (!(t.c = make_cache(ctx, &t, max_len + 1)) || !fill(ctx, t.c, &t, max_len) ||
      !run_causal(ctx, t.c, &t, out))
    goto done;
  if (quantized && ctx != cpu) {
    if (!(t.ref = make_cache(cpu, &t, max_len + 1)) || !fill(cpu, t.ref, &t, max_len) ||
        !run_causal(cpu, t.ref, &t, ref_out))
      goto done;
  }
  int row = 0;
  uint16_t *kh = malloc((size_t)max_len * t.kv_row * 2), *vh = malloc((size_t)max_len * t.kv_row * 2);
  if (!T_CHECK(kh && vh)) {
    free(kh), free(vh);
    goto done;
  }
  for (int i = 0; i < n; i++) {
    const float *ks = t.k + (size_t)i * (size_t)max_len * t.kv_row;
    const float *vs = t.v + (size_t)i * (size_t)max_len * t.kv_row;
    for (size_t e = 0; e < (size_t)(P[i] + T[i]) * t.kv_row; e++)
      kh[e] = t_f32_to_f16(ks[e]), vh[e] = t_f32_to_f16(vs[e]);
    const int row0 = row;
    row += T[i]; /* past this sequence's rows, also where a failure ends their loop */
    if (quantized && !t.ref) continue; /* the CPU backend itself: checked against decode below */
    for (int r = 0; r < T[i]; r++) {
      const float *got = out + (size_t)(row0 + r) * t.q_row;
      double err;
      if (!quantized) {
        const int end = P[i] + r + 1, begin = window > 0 && end > window ? end - window : 0;
        t_ref_attention(ref, t.q + (size_t)(row0 + r) * t.q_row, kh + (size_t)begin * t.kv_row,
                        vh + (size_t)begin * t.kv_row, end - begin, s.n_heads, s.n_kv, s.d, 0.0f);
        err = t_rel_l2(got, ref, t.q_row);
      } else {
        for (size_t e = 0; e < t.q_row; e++) ref[e] = ref_out[(size_t)(row0 + r) * t.q_row + e];
        err = t_rel_l2(got, ref, t.q_row);
      }
      if (!T_CHECKF(err <= TOL, "seq %d (P %d, T %d) row %d: rel L2 %g", i, P[i], T[i], r, err))
        break;
    }
  }
  free(kh), free(vh);
  /* Rows against the decode call: the first and last of each sequence, and a random one. */
  if (window == 0) {
    row = 0;
    for (int i = 0; i < n; i++) {
      const int picks[3] = {0, T[i] - 1, t_rand_int(0, T[i] - 1)};
      for (int j = 0; j < 3; j++)
        if (j == 0 || picks[j] != picks[0]) check_against_decode(&t, out, i, picks[j], row + picks[j]);
      row += T[i];
    }
  }
done:
  m40llm_kvcache_destroy(t.c);
  m40llm_kvcache_destroy(t.ref);
  free(t.k), free(t.v), free(t.q), free(out), free(ref_out), free(ref);
}

static void run_case(m40llm_context *ctx, m40llm_context *cpu, causal_shape s, const int *P,
                     const int *T, int n, int window) {
  run_case_as(ctx, cpu, s, P, T, n, window, PLAIN);
}

/* Sequences of one row each: the causal call must be the decode call's (bit for bit on the CPU
 * backend). */
static void t1_equals_decode(m40llm_context *ctx, m40llm_context *cpu, causal_shape s) {
  const int P[5] = {0, 1, 30, 256, 700}, n = 5;
  int T[5] = {1, 1, 1, 1, 1};
  causal_case t = {ctx, cpu, s, n, 0, 0, P, T, NULL, NULL, 0, 0, n, NULL, NULL, NULL};
  t_set_case("causal T=1 equals decode, K%d V%d heads %d/%d d %d", s.kf, s.vf, s.n_heads, s.n_kv, s.d);
  t.kv_row = (size_t)s.n_kv * (size_t)s.d;
  t.q_row = (size_t)s.n_heads * (size_t)s.d;
  const int max_len = 701;
  const size_t kv_n = (size_t)n * (size_t)max_len * t.kv_row, bytes = (size_t)n * t.q_row * 4;
  t.k = malloc(kv_n * 4), t.v = malloc(kv_n * 4), t.q = malloc(bytes);
  float *a = malloc(bytes), *b = malloc(bytes);
  float *dq = NULL, *dout = NULL;
  const int32_t ids[5] = {0, 1, 2, 3, 4};
  if (!T_CHECK(t.k && t.v && t.q && a && b)) goto done;
  t_fill_uniform(t.k, kv_n, -1.5f, 1.5f);
  t_fill_uniform(t.v, kv_n, -1.0f, 1.0f);
  t_fill_uniform(t.q, (size_t)n * t.q_row, -1.0f, 1.0f);
  if (!(t.c = make_cache(ctx, &t, max_len)) || !fill(ctx, t.c, &t, max_len) ||
      !run_causal(ctx, t.c, &t, a))
    goto done;
  dq = t_dev_upload(ctx, t.q, bytes), dout = t_dev_alloc(ctx, bytes);
  if (!dq || !dout || !T_OK(m40llm_memset(ctx, dout, 0xFF, bytes)) ||
      !T_OK(m40llm_kvcache_attn_batch_f32q(dout, t.c, 0, ids, n, dq, 0.0f)) ||
      !t_dev_download(ctx, b, dout, bytes))
    goto done;
  if (ctx == cpu) {
    T_CHECK(memcmp(a, b, bytes) == 0);
  } else {
    double *ref = malloc(bytes * 2);
    if (T_CHECK(ref)) {
      for (size_t e = 0; e < (size_t)n * t.q_row; e++) ref[e] = b[e];
      const double err = t_rel_l2(a, ref, (size_t)n * t.q_row);
      T_CHECKF(err <= TOL, "rel L2 %g between causal and decode", err);
    }
    free(ref);
  }
done:
  m40llm_free(ctx, dq);
  m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(t.c);
  free(t.k), free(t.v), free(t.q), free(a), free(b);
}

/* Every bad argument: its status and message, nothing written, no length changed. */
static void errors(m40llm_context *ctx) {
  t_set_case("causal errors");
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 2, o.n_heads = 4, o.n_kv_heads = 2, o.head_dim = 32, o.max_seqs = 3, o.max_seq_len = 16;
  m40llm_kvcache *c = NULL;
  if (!T_OK(m40llm_kvcache_create(&c, ctx, &o))) return;
  const size_t row = 4 * 32, kv = 2 * 32;
  float *h = calloc(16 * row, sizeof(float)), *got = malloc(16 * row * sizeof(float));
  float *dkv = t_dev_alloc(ctx, 16 * kv * 4), *dq = t_dev_alloc(ctx, 16 * row * 4);
  float *dout = t_dev_alloc(ctx, 16 * row * 4);
  if (!T_CHECK(h && got && dkv && dq && dout)) goto done;
  T_OK(m40llm_memset(ctx, dkv, 0, 16 * kv * 4));
  T_OK(m40llm_memset(ctx, dq, 0, 16 * row * 4));
  T_OK(m40llm_kvcache_append_f32(c, 0, 0, dkv, dkv, 5));
  T_OK(m40llm_kvcache_append_f32(c, 0, 1, dkv, dkv, 3));
  T_OK(m40llm_memset(ctx, dout, 0x7F, 16 * row * 4));
  const int32_t ids[2] = {0, 1}, counts[2] = {2, 3};
  m40llm_causal_options opt = M40LLM_CAUSAL_OPTIONS_INIT;
  const int bad = M40LLM_ERR_INVALID_ARGUMENT, range = M40LLM_ERR_OUT_OF_RANGE;
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, NULL, 0, ids, counts, 2, dq, NULL), bad, "cache");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 2, ids, counts, 2, dq, NULL), range, "layer");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, NULL, counts, 2, dq, NULL), bad, "seq_ids");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 0, dq, NULL), bad, "n_seqs");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 4, dq, NULL), bad, "max_seqs");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, (const int32_t[]){0, 3}, counts, 2, dq,
                                              NULL), range, "seq_ids[1]");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, (const int32_t[]){1, 1}, counts, 2, dq,
                                              NULL), bad, "repeats");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, (const int32_t[]){0, 1}, 2, dq,
                                              NULL), bad, "q_counts[0]");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, (const int32_t[]){2, 4}, 2, dq,
                                              NULL), bad, "q_counts[1] is 4, must be 1..3");
  /* seq 2 is empty: no row of it can be new */
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, (const int32_t[]){2}, NULL, 1, dq, NULL),
              bad, "q_counts[0] is 1, must be 1..0");
  /* layer 1 is empty even though layer 0 has rows */
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 1, ids, NULL, 2, dq, NULL), bad, "layer 1");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, NULL, NULL), bad, "q is NULL");
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(NULL, c, 0, ids, counts, 2, dq, NULL), bad, "out is NULL");
  /* 5 rows: q ends 4 rows past out's start */
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, dout + 4 * row, NULL), bad,
              "overlap");
  opt.window = -1;
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, dq, &opt), bad, "window");
  opt.window = 0, opt.scale = NAN;
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, dq, &opt), bad, "scale");
  opt.scale = INFINITY;
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, dq, &opt), bad, "scale");
  opt.scale = 0.0f, opt.version = 2;
  T_FAIL_WITH(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, dq, &opt), bad, "version");
  T_FAIL_WITH(m40llm_causal_options_init(&opt, 0), bad, "version");
  T_FAIL_WITH(m40llm_causal_options_init(NULL, 1), bad, "opts");
  if (t_dev_download(ctx, got, dout, 16 * row * 4))
    T_CHECKF(t_all_bytes(got, 16 * row * 4, 0x7F), "a failed call wrote to out");
  int len = -1;
  T_OK(m40llm_kvcache_seq_len(&len, c, 0, 0));
  T_INT_EQ(len, 5);
  T_OK(m40llm_kvcache_seq_len(&len, c, 0, 1));
  T_INT_EQ(len, 3);
  /* The defaults through init and NULL opts are the same call; zeros in q give the mean of V. */
  m40llm_causal_options init;
  memset(&init, 0xAB, sizeof init);
  if (T_OK(m40llm_causal_options_init(&init, M40LLM_CAUSAL_OPTIONS_VERSION))) {
    T_CHECK(init.version == 1 && init.scale == 0.0f && init.window == 0);
    T_OK(m40llm_kvcache_attn_causal_f32q(dout, c, 0, ids, counts, 2, dq, &init));
    if (t_dev_download(ctx, got, dout, 5 * row * 4)) T_CHECK(t_all_bytes(got, 5 * row * 4, 0));
  }
done:
  free(h), free(got);
  m40llm_free(ctx, dkv), m40llm_free(ctx, dq), m40llm_free(ctx, dout);
  m40llm_kvcache_destroy(c);
}

void t_cases_causal(m40llm_context *ctx, m40llm_context *cpu, int small) {
  errors(ctx);
  const int F = M40LLM_KV_F16, Q8 = M40LLM_KV_Q8, Q4 = M40LLM_KV_Q4;
  /* Groups 1, 4, 8, 3, 4, 16, 7: on tensor cores a tile of 8 rows packs (row, head) pairs of a
   * K/V head, so tiles start and end inside rows and a group of 16 spans two tiles a row. */
  const causal_shape f16[] = {{F, F, 4, 4, 64},  {F, F, 8, 2, 80},  {F, F, 8, 1, 128},
                              {F, F, 8, 1, 256}, {F, F, 6, 2, 64},  {F, F, 16, 4, 128},
                              {F, F, 16, 1, 64}, {F, F, 14, 2, 96}};
  const int nf = sizeof f16 / sizeof f16[0];
  /* Ragged: T 1, 2-16, 17-33 on prefixes of 0, short and past a few tiles; 512 on 0 and 100. */
  const int P1[] = {0, 37, 0, 100, 0, 300, 5, 64, 1000};
  const int T1[] = {1, 1, 2, 16, 17, 33, 9, 7, 3};
  const int n1 = sizeof P1 / sizeof P1[0];
  const int P2[] = {0, 100}, T2[] = {512, small ? 40 : 512};
  for (int i = 0; i < nf; i++) {
    run_case(ctx, cpu, f16[i], P1, T1, n1, 0);
    run_case(ctx, cpu, f16[i], P2, T2, 2, 0);
    t1_equals_decode(ctx, cpu, f16[i]);
  }
  /* head_dim under its class: 48 of 64 (the FP32 kernel's score steps read zeros past it); 136
   * and 200 of 256 (a warp's dims of the second stage part past it, and wholly past it). */
  run_case(ctx, cpu, (causal_shape){F, F, 4, 2, 48}, P1, T1, n1, 0);
  run_case(ctx, cpu, (causal_shape){F, F, 4, 2, 136}, P1, T1, n1, 0);
  run_case(ctx, cpu, (causal_shape){F, F, 6, 3, 200}, P1, T1, n1, 0);
  /* Windows: shorter than, equal to and longer than a tile, one position, and longer than any
   * sequence. */
  const int windows[] = {1, 7, 16, 64, 300, 5000};
  for (int w = 0; w < (int)(sizeof windows / sizeof windows[0]); w++)
    run_case(ctx, cpu, f16[w % nf], P1, T1, n1, windows[w]);
  run_case(ctx, cpu, f16[2], P2, T2, 2, 128);
  /* K infinities on every road: prompts (T 512), short rows, a window. */
  for (int i = 0; i < 4; i++) {
    run_case_as(ctx, cpu, f16[i], P2, T2, 2, 0, MASKED);
    run_case_as(ctx, cpu, f16[i], P1, T1, n1, i == 1 ? 16 : 0, MASKED);
  }
  run_case_as(ctx, cpu, f16[2], P2, T2, 2, 128, MASKED);
  /* Quantized: rotated, protected (4 sinks, a window of 32), groups 1 to 4, d 64 to 256. */
  const causal_shape quant[] = {{Q8, Q8, 4, 4, 64}, {Q4, Q4, 8, 2, 128}, {Q8, Q4, 8, 1, 128},
                                {Q8, Q8, 4, 1, 256}, {Q4, Q4, 9, 3, 64},  {Q4, Q4, 4, 2, 256}};
  const int P3[] = {0, 3, 40, 200, 0}, T3[] = {1, 5, 16, 33, 70};
  for (int i = 0; i < (int)(sizeof quant / sizeof quant[0]); i++) {
    run_case(ctx, cpu, quant[i], P3, T3, 5, 0);
    run_case(ctx, cpu, quant[i], P3, T3, 5, 20);
    t1_equals_decode(ctx, cpu, quant[i]);
  }
  /* V in Q3 and Q2 */
  const causal_shape low[] = {{Q4, M40LLM_KV_Q3, 8, 2, 64}, {Q4, M40LLM_KV_Q2, 4, 1, 128}};
  for (int i = 0; i < (int)(sizeof low / sizeof low[0]); i++) {
    m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
    o.n_layers = 1, o.n_heads = low[i].n_heads, o.n_kv_heads = low[i].n_kv;
    o.head_dim = low[i].d, o.max_seqs = 1, o.max_seq_len = 8;
    o.format = low[i].kf, o.v_format = low[i].vf;
    if (t_pair_refused(ctx, &o)) continue;
    run_case(ctx, cpu, low[i], P3, T3, 5, 0);
    t1_equals_decode(ctx, cpu, low[i]);
  }
  /* Speculative rows, one count for all (one launch on tensor cores), on prefixes long enough to
   * split; 64 and 128 rows on long prefixes: partials of 64 rows (on tensor cores the decode
   * tiles') and 128 (the prefill kernel's), more than the workspace reserved for decode calls
   * holds, so the plans take fewer splits. */
  const int P7[] = {small ? 1200 : 5000, small ? 2000 : 7000, 40}, T7[] = {6, 6, 6};
  run_case(ctx, cpu, f16[1], P7, T7, 3, 0);
  run_case(ctx, cpu, quant[1], P7, T7, 3, 0);
  /* Calls whose every item's query vectors fit a block of 16 (at head_dim 64 on the FP32 road:
   * the wide kernel's pass for few rows, which a call takes only where all its items fit): T 1
   * and 2 at every group (windows, protected tokens, rotation), up to 16 rows at group 1. */
  const int P14[] = {0, 37, 300, 1000, 5, 64}, T14[] = {2, 1, 2, 2, 1, 2};
  const int P15[] = {0, 100, 1000}, T15[] = {16, 9, 3};
  for (int i = 0; i < nf; i++)
    if (f16[i].d <= 64) run_case(ctx, cpu, f16[i], P14, T14, 6, 0);
  run_case(ctx, cpu, (causal_shape){F, F, 4, 2, 48}, P14, T14, 6, 0);
  /* head_dim 40 and 24 of 64: a warp's score dims and an output column partly and wholly past
   * head_dim */
  run_case(ctx, cpu, (causal_shape){F, F, 4, 2, 40}, P14, T14, 6, 0);
  run_case(ctx, cpu, (causal_shape){F, F, 8, 2, 24}, P14, T14, 6, 0);
  run_case(ctx, cpu, f16[0], P14, T14, 6, 16);
  run_case(ctx, cpu, f16[0], P15, T15, 3, 0);
  run_case(ctx, cpu, quant[0], P14, T14, 6, 0);
  run_case(ctx, cpu, quant[4], P14, T14, 6, 20);
  const int P8[] = {small ? 3000 : 9000, 2500}, T8[] = {64, 128};
  run_case(ctx, cpu, f16[0], P8, T8, 2, 0);
  /* A block's rows (64 at group 1) on a prefix of 32768: on tensor cores the prefill kernel. */
  const int P11[] = {32768}, T11[] = {64};
  run_case(ctx, cpu, f16[0], P11, T11, 1, 0);
  /* Protected tokens and prompts longer than 64 rows plus the window: on tensor cores the rows
   * before the last 64 are items that end before the window (their positions all codes). */
  const int P9[] = {10, 300}, T9[] = {160, 200};
  run_case(ctx, cpu, quant[0], P9, T9, 2, 0);
  run_case(ctx, cpu, quant[4], P9, T9, 2, 0);
  /* Windows that leave out less than three quarters of a sequence (on tensor cores: masked),
   * on a long prefix (splits wholly before some rows' windows) and with protected tokens. */
  const int P10[] = {small ? 1500 : 3000, 40}, T10[] = {16, 70};
  run_case(ctx, cpu, f16[1], P10, T10, 2, small ? 600 : 1000);
  run_case(ctx, cpu, quant[1], P10, T10, 2, small ? 600 : 1000);
  run_case(ctx, cpu, quant[0], P10, T10, 2, 50);
  /* Peaked rows: prompts on a prefix (on tensor cores the prefill kernel), speculative rows on
   * long prefixes (the decode tiles; quantized: their V codes' path). */
  const int P12[] = {3000, 700}, T12[] = {128, 200}, P13[] = {small ? 2000 : 6000, 900},
            T13[] = {6, 16};
  for (int i = 0; i < 4; i++) run_case_as(ctx, cpu, f16[i], P12, T12, 2, 0, PEAKED);
  run_case_as(ctx, cpu, f16[1], P13, T13, 2, 0, PEAKED);
  run_case_as(ctx, cpu, quant[1], P13, T13, 2, 0, PEAKED);
  run_case_as(ctx, cpu, quant[2], P13, T13, 2, 0, PEAKED);
  for (int i = 0; i < 4; i++) run_case_as(ctx, cpu, f16[i], P13, T12, 2, 0, HUGE);
  if (!small) {
    /* A long prompt; speculative shapes on long prefixes (the split path); a wide batch. */
    const int P4[] = {0, 1500}, T4[] = {4096, 4096};
    run_case(ctx, cpu, (causal_shape){F, F, 4, 2, 64}, P4, T4, 2, 0);
    const int P5[] = {3000, 6000, 20000}, T5[] = {4, 16, 2};
    run_case(ctx, cpu, f16[1], P5, T5, 3, 0);
    run_case(ctx, cpu, quant[1], P5, T5, 3, 0);
    int P6[80], T6[80];
    for (int i = 0; i < 80; i++) P6[i] = t_rand_int(0, 300), T6[i] = t_rand_int(1, 20);
    run_case(ctx, cpu, f16[0], P6, T6, 80, 0);
  } else {
    const int P5[] = {1500, 900}, T5[] = {4, 16};
    run_case(ctx, cpu, f16[1], P5, T5, 2, 0);
    int P6[70], T6[70];
    for (int i = 0; i < 70; i++) P6[i] = t_rand_int(0, 40), T6[i] = t_rand_int(1, 5);
    run_case(ctx, cpu, f16[0], P6, T6, 70, 0);
  }
  t_set_case("");
}
