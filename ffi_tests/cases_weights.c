/*
 * Attention weights (m40llm_kvcache_attn_weights_ex): F16 caches against a float64 reference
 * over the test's own model of the cache; quantized caches with protected tokens (sinks and a
 * window whose ring has wrapped) against the CPU backend over the same appends. Every row's
 * entries past its sequence's length must keep their poison; the output must match the
 * reference too; failing calls must write nothing.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

/* A weight may differ from the reference by this much relative to itself, plus W_ABS: the
 * scores are FP32 sums of head_dim products on the GPU. */
#define W_REL 1e-4
#define W_ABS 1e-7

/* Compares row (n_heads rows of stride floats, lens[i] valid) with want (double, or float when
 * wantf) and checks the poison past the length; returns the number of bad entries. */
static long check_rows(const float *got, const double *want, const float *wantf, int n_heads,
                       int len, size_t stride, const char *what) {
  long bad = 0;
  for (int h = 0; h < n_heads; h++) {
    const float *g = got + (size_t)h * stride;
    double sum = 0.0;
    for (int p = 0; p < len; p++) {
      const double r =
          want ? want[(size_t)h * (size_t)len + p] : (double)wantf[(size_t)h * stride + p];
      sum += g[p];
      if (!(fabs((double)g[p] - r) <= W_ABS + W_REL * fabs(r))) {
        if (bad++ < 3)
          T_CHECKF(0, "%s: head %d position %d of %d: weight %.9g, want %.9g", what, h, p, len,
                   (double)g[p], r);
      }
    }
    if (len > 0 && !(fabs(sum - 1.0) <= 1e-5) && bad++ < 3)
      T_CHECKF(0, "%s: head %d's weights sum to %.9g", what, h, sum);
    if (!t_all_bytes(g + len, (stride - (size_t)len) * sizeof(float), 0xFF) && bad++ < 3)
      T_CHECKF(0, "%s: head %d: an entry past its length %d (of %zu) was written", what, h, len,
               stride);
  }
  return bad;
}

/* The call on kv's layer 0 for ids with q host [n][n_heads][head_dim]: the host copies of the
 * output and the weights (poisoned with 0xFF first; stride floats a row). */
static int run_weights(t_kv *kv, const int32_t *ids, int n, const float *q, size_t stride,
                       float *out, float *w) {
  const m40llm_kvcache_options *o = &kv->opts;
  const size_t qn = (size_t)n * (size_t)o->n_heads * (size_t)o->head_dim;
  const size_t wn = (size_t)n * (size_t)o->n_heads * stride;
  float *dq = t_dev_upload(kv->ctx, q, qn * sizeof(float));
  float *dout = t_dev_alloc(kv->ctx, qn * sizeof(float));
  float *dw = t_dev_alloc(kv->ctx, wn * sizeof(float) + 4);
  int ok = dq && dout && dw && T_OK(m40llm_memset(kv->ctx, dout, 0xFF, qn * sizeof(float))) &&
           T_OK(m40llm_memset(kv->ctx, dw, 0xFF, wn * sizeof(float) + 4)) &&
           T_OK(m40llm_kvcache_attn_weights_ex(dout, dw, stride, kv->cache, 0, ids, n, dq,
                                               M40LLM_DTYPE_F32, 0.0f)) &&
           T_OK(m40llm_context_synchronize(kv->ctx)) &&
           t_dev_download(kv->ctx, out, dout, qn * sizeof(float)) &&
           t_dev_download(kv->ctx, w, dw, wn * sizeof(float) + 4);
  if (ok) T_CHECKF(t_all_bytes(w + wn, 4, 0xFF), "the weights were written past their rows");
  m40llm_free(kv->ctx, dq);
  m40llm_free(kv->ctx, dout);
  m40llm_free(kv->ctx, dw);
  return ok;
}

typedef struct {
  int n_heads, n_kv_heads, head_dim;
  int lens[4]; /* -1 ends */
} f16_shape;

/* F16: every sequence's weights and output against the float64 reference. */
static void f16_case(m40llm_context *ctx, f16_shape s, int small) {
  int n = 0, max_len = 1;
  int32_t ids[5];
  for (; n < 4 && s.lens[n] >= 0; n++) {
    if (small && s.lens[n] > 300) s.lens[n] = 300 + s.lens[n] % 7;
    if (s.lens[n] > max_len) max_len = s.lens[n];
  }
  t_set_case("weights F16 %d/%d heads, head_dim %d, lengths %d %d %d %d", s.n_heads, s.n_kv_heads,
             s.head_dim, s.lens[0], n > 1 ? s.lens[1] : -1, n > 2 ? s.lens[2] : -1,
             n > 3 ? s.lens[3] : -1);
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, s.n_heads, s.n_kv_heads, s.head_dim, n, max_len) != M40LLM_OK)
    return;
  for (int i = 0; i < n; i++) {
    ids[i] = i;
    if (s.lens[i] > 0 && !T_OK(t_kv_append_random(&kv, 0, i, s.lens[i], 1.0f))) goto done;
  }
  ids[n] = n - 1; /* a repeated id */
  const int rows = n + 1;
  const size_t stride = (size_t)max_len + 3, hd = (size_t)s.n_heads * (size_t)s.head_dim;
  float *q = malloc((size_t)rows * hd * sizeof(float));
  float *out = malloc((size_t)rows * hd * sizeof(float));
  float *w = malloc(((size_t)rows * (size_t)s.n_heads * stride + 1) * sizeof(float));
  double *ref = malloc((size_t)s.n_heads * (size_t)max_len * sizeof(double));
  double *ref_out = malloc(hd * sizeof(double));
  if (!T_CHECK(q && out && w && ref && ref_out)) goto free_all;
  t_fill_uniform(q, (size_t)rows * hd, -1.5f, 1.5f);
  if (!run_weights(&kv, ids, rows, q, stride, out, w)) goto free_all;
  for (int i = 0; i < rows; i++) {
    const int len = t_model_len(&kv.model, 0, ids[i]);
    char what[64];
    snprintf(what, sizeof what, "row %d (seq %d)", i, (int)ids[i]);
    t_ref_weights(ref, q + (size_t)i * hd, t_model_k(&kv.model, 0, ids[i]), len, s.n_heads,
                s.n_kv_heads, s.head_dim, 0.0f);
    check_rows(w + (size_t)i * (size_t)s.n_heads * stride, ref, NULL, s.n_heads, len, stride, what);
    t_ref_attention(ref_out, q + (size_t)i * hd, t_model_k(&kv.model, 0, ids[i]),
                    t_model_v(&kv.model, 0, ids[i]), len, s.n_heads, s.n_kv_heads, s.head_dim,
                    0.0f);
    const double err = t_rel_l2(out + (size_t)i * hd, ref_out, hd);
    T_CHECKF(err <= 1e-5, "%s: output rel L2 %.3g", what, err);
  }
free_all:
  free(q), free(out), free(w), free(ref), free(ref_out);
done:
  t_kv_destroy(&kv);
}

/* Quantized K/V with 4 sinks and a window of 16, against the CPU backend's weights. */
static void quant_case(m40llm_context *ctx, m40llm_context *cpu, int kf, int vf, int n_heads,
                       int n_kv_heads, int head_dim, int small) {
  const int lens[] = {1, 3, 20, 90, small ? 333 : 1200};
  enum { N = 5 };
  int max_len = 0;
  for (int i = 0; i < N; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
  t_set_case("weights K %d / V %d, %d/%d heads, head_dim %d", kf, vf, n_heads, n_kv_heads,
             head_dim);
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1, o.n_heads = n_heads, o.n_kv_heads = n_kv_heads, o.head_dim = head_dim;
  o.max_seqs = N, o.max_seq_len = max_len, o.format = kf, o.v_format = vf;
  o.n_sinks = 4, o.window = 16;
  if (t_pair_refused(ctx, &o)) return;
  t_kv a, b;
  const int ok_a = t_kv_create_opts(&a, ctx, &o) == M40LLM_OK;
  const int ok_b = ok_a && t_kv_create_opts(&b, cpu, &o) == M40LLM_OK;
  if (!ok_b) goto done;
  int32_t ids[N];
  for (int i = 0; i < N; i++) {
    t_kv *both[2] = {&a, &b};
    int st[2];
    ids[i] = N - 1 - i;
    t_kv_append_same_random(both, st, 2, 0, i, lens[i], 1.0f, i % 2);
    if (!T_OK(st[0]) || !T_OK(st[1])) goto done;
  }
  const size_t stride = (size_t)max_len + 1, hd = (size_t)n_heads * (size_t)head_dim;
  const size_t wn = (size_t)N * (size_t)n_heads * stride + 1;
  float *q = malloc(N * hd * sizeof(float));
  float *out = malloc(2 * N * hd * sizeof(float));
  float *w = malloc(2 * wn * sizeof(float));
  if (T_CHECK(q && out && w)) {
    t_fill_uniform(q, N * hd, -1.5f, 1.5f);
    if (run_weights(&a, ids, N, q, stride, out, w) &&
        run_weights(&b, ids, N, q, stride, out + N * hd, w + wn)) {
      for (int i = 0; i < N; i++) {
        char what[64];
        snprintf(what, sizeof what, "row %d (seq %d, length %d)", i, (int)ids[i], lens[ids[i]]);
        check_rows(w + (size_t)i * (size_t)n_heads * stride, NULL,
                   w + wn + (size_t)i * (size_t)n_heads * stride, n_heads, lens[ids[i]], stride,
                   what);
        double ref[8 * 256];
        for (size_t j = 0; j < hd; j++) ref[j] = out[N * hd + (size_t)i * hd + j];
        const double err = t_rel_l2(out + (size_t)i * hd, ref, hd);
        T_CHECKF(err <= 1e-5, "%s: output rel L2 %.3g against the CPU backend's", what, err);
      }
    }
  }
  free(q), free(out), free(w);
done:
  if (ok_b) t_kv_destroy(&b);
  if (ok_a) t_kv_destroy(&a);
}

/* An FP16 or BF16 q gives the weights of the FP32 call on q's values, bit for bit (the 16-bit
 * rows are widened exactly before the same kernels run). */
static void dtype_case(m40llm_context *ctx) {
  t_set_case("weights: FP16 and BF16 q against the FP32 call");
  enum { H = 8, D = 64, LEN = 77 };
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, H, 2, D, 2, LEN) != M40LLM_OK) return;
  const int32_t ids[2] = {1, 0};
  const size_t qn = 2 * H * D, wn = 2 * H * LEN;
  float q[2 * H * D], q16f[2 * H * D];
  uint16_t q16[2 * H * D];
  float *w = malloc(3 * wn * sizeof(float));
  float *dev = t_dev_alloc(ctx, (3 * wn + 3 * qn) * sizeof(float));
  if (!T_CHECK(w && dev) || !T_OK(t_kv_append_random(&kv, 0, 0, LEN, 1.0f)) ||
      !T_OK(t_kv_append_random(&kv, 0, 1, 40, 1.0f)))
    goto done;
  t_fill_uniform(q, qn, -1.5f, 1.5f);
  for (int dt = M40LLM_DTYPE_F16; dt <= M40LLM_DTYPE_BF16; dt++) {
    for (size_t i = 0; i < qn; i++) { /* BF16: the high half of the FP32 bits, truncated */
      q16[i] = dt == M40LLM_DTYPE_F16 ? t_f32_to_f16(q[i]) : (uint16_t)(t_f32_bits(q[i]) >> 16);
      q16f[i] = dt == M40LLM_DTYPE_F16 ? t_f16_to_f32(q16[i])
                                       : t_f32_from_bits((uint32_t)q16[i] << 16);
    }
    float *dw = dev, *dq32 = dev + 2 * wn, *dout = dev + 2 * wn + qn;
    uint16_t *dq16 = (uint16_t *)(dev + 2 * wn + 2 * qn);
    if (!T_OK(m40llm_memcpy_to_device(ctx, dq32, q16f, sizeof q16f)) ||
        !T_OK(m40llm_memcpy_to_device(ctx, dq16, q16, sizeof q16)) ||
        !T_OK(m40llm_memset(ctx, dw, 0xFF, 2 * wn * sizeof(float))) ||
        !T_OK(m40llm_kvcache_attn_weights_ex(dout, dw, LEN, kv.cache, 0, ids, 2, dq32,
                                             M40LLM_DTYPE_F32, 0.0f)) ||
        !T_OK(m40llm_kvcache_attn_weights_ex(dout, dw + wn, LEN, kv.cache, 0, ids, 2, dq16, dt,
                                             0.0f)) ||
        !t_dev_download(ctx, w, dw, 2 * wn * sizeof(float)))
      break;
    T_CHECKF(memcmp(w, w + wn, wn * sizeof(float)) == 0, "dtype %d: the weights differ from "
             "the FP32 call's on the same values", dt);
    double sum = 0.0; /* row 0 is sequence 1, 40 positions: written, summing to 1 */
    for (int p = 0; p < 40; p++) sum += w[wn + (size_t)p];
    T_CHECKF(fabs(sum - 1.0) < 1e-5, "dtype %d: row 0 head 0's weights sum to %.9g", dt, sum);
  }
done:
  free(w);
  m40llm_free(ctx, dev);
  t_kv_destroy(&kv);
}

/* Bad calls fail with their status and write neither out nor the weights. */
static void error_case(m40llm_context *ctx) {
  t_set_case("weights: errors");
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, 4, 2, 64, 2, 64) != M40LLM_OK) return;
  const size_t hd = 4 * 64, stride = 40;
  float q[2 * 4 * 64];
  t_fill_uniform(q, 2 * hd, -1.0f, 1.0f);
  float *dq = t_dev_upload(ctx, q, sizeof q);
  float *buf = t_dev_alloc(ctx, (2 * hd + 2 * 4 * stride) * sizeof(float));
  float *host = malloc((2 * hd + 2 * 4 * stride) * sizeof(float));
  if (!T_CHECK(dq && buf && host) || !T_OK(t_kv_append_random(&kv, 0, 0, 33, 1.0f)) ||
      !T_OK(t_kv_append_random(&kv, 0, 1, 40, 1.0f)))
    goto done;
  float *out = buf, *w = buf + 2 * hd;
  const size_t all = (2 * hd + 2 * 4 * stride) * sizeof(float);
  if (!T_OK(m40llm_memset(ctx, buf, 0xFF, all))) goto done;
  const int32_t ids[2] = {0, 1}, bad_ids[2] = {0, 2};
  T_FAIL_WITH(m40llm_kvcache_attn_weights_ex(out, NULL, stride, kv.cache, 0, ids, 2, dq,
                                             M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "weights is NULL");
  T_FAIL_WITH(m40llm_kvcache_attn_weights_ex(out, w, 39, kv.cache, 0, ids, 2, dq,
                                             M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "weights_stride is 39");
  T_FAIL_WITH(m40llm_kvcache_attn_weights_ex(out, w, stride, kv.cache, 0, bad_ids, 2, dq,
                                             M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_OUT_OF_RANGE, "seq_ids[1] = 2");
  T_FAIL_WITH(m40llm_kvcache_attn_weights_ex(out, out + hd, stride, kv.cache, 0, ids, 2, dq,
                                             M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "overlap out");
  T_FAIL_WITH(m40llm_kvcache_attn_weights_ex(out, dq + 8, stride, kv.cache, 0, ids, 2, dq,
                                             M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "overlap q");
  T_FAIL_WITH(m40llm_kvcache_attn_weights_ex(out, w, stride, kv.cache, 1, ids, 2, dq,
                                             M40LLM_DTYPE_F32, 0.0f),
              M40LLM_ERR_OUT_OF_RANGE, "layer 1");
  if (T_OK(m40llm_context_synchronize(ctx)) && t_dev_download(ctx, host, buf, all))
    T_CHECKF(t_all_bytes(host, all, 0xFF), "a failed call wrote out or the weights");
  /* The boundary: a stride of exactly the longest length. */
  T_OK(m40llm_kvcache_attn_weights_ex(out, w, 40, kv.cache, 0, ids, 2, dq, M40LLM_DTYPE_F32,
                                      0.0f));
done:
  m40llm_free(ctx, dq);
  m40llm_free(ctx, buf);
  free(host);
  t_kv_destroy(&kv);
}

void t_cases_weights(m40llm_context *ctx, m40llm_context *cpu, int small) {
  static const f16_shape shapes[] = {
      {4, 4, 64, {1, 31, 33, 257}},    {9, 3, 64, {0, 2049, 33, -1}},
      {8, 1, 128, {257, 4000, -1, -1}}, {32, 8, 128, {1, 1500, -1, -1}},
      {16, 2, 256, {100, 700, -1, -1}}, {6, 2, 80, {45, 600, -1, -1}},
      {16, 2, 64, {300, 5, -1, -1}},
  };
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) f16_case(ctx, shapes[i], small);
  static const int pairs[][2] = {{M40LLM_KV_Q4, M40LLM_KV_Q4},
                                 {M40LLM_KV_Q8, M40LLM_KV_Q8},
                                 {M40LLM_KV_Q8, M40LLM_KV_Q4},
                                 {M40LLM_KV_Q4, M40LLM_KV_Q2}};
  /* Group 4 and wide 8-head tiles (one launch over the kept parts and the codes), 8 heads at
   * head_dim 64 and a head_dim off its class (two launches). */
  static const int heads[][3] = {{8, 2, 128}, {16, 2, 128}, {16, 2, 64}, {4, 4, 96}};
  for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
    for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++)
      if (!small || (p + h) % 2 == 0)
        quant_case(ctx, cpu, pairs[p][0], pairs[p][1], heads[h][0], heads[h][1], heads[h][2],
                   small);
  dtype_case(ctx);
  error_case(ctx);
}
