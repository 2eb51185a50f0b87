/*
 * Importance (m40llm_kvcache_attn_importance_ex): on any backend, F16 caches against a float64
 * reference over the test's own model (random starting values, two calls so the decay is seen,
 * repeated ids, an empty sequence, more rows than one launch takes), the same backend's weights
 * call reduced on the host, and the errors; on a GPU, quantized caches with protected tokens
 * against the CPU backend. Entries past a row's length keep their poison; failing calls write
 * nothing.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

/* Each importance may differ from the reference by this much relative to itself, plus I_ABS:
 * the GPU's scores are FP32 sums of head_dim products (as for the weights). */
#define I_REL 1e-4
#define I_ABS 1e-7

/* Compares the importance rows of one query row (n_kv_heads rows of stride floats, len valid)
 * with want (n_kv_heads x len, double) and checks the poison past the length. */
static void check_imp(const float *got, const double *want, int n_kv_heads, int len,
                      size_t stride, double rel, const char *what) {
  long bad = 0;
  for (int g = 0; g < n_kv_heads; g++) {
    const float *r = got + (size_t)g * stride;
    for (int p = 0; p < len; p++) {
      const double w = want[(size_t)g * (size_t)len + p];
      if (!(fabs((double)r[p] - w) <= I_ABS + rel * fabs(w)) && bad++ < 3)
        T_CHECKF(0, "%s: K/V head %d position %d of %d: importance %.9g, want %.9g", what, g, p,
                 len, (double)r[p], w);
    }
    if (!t_all_bytes(r + len, (stride - (size_t)len) * sizeof(float), 0xFF) && bad++ < 3)
      T_CHECKF(0, "%s: K/V head %d: an entry past its length %d (of %zu) was written", what, g,
               len, stride);
  }
}

/* Starting values: random in [0, 1) below each row's length, poison (0xFF) from there on. */
static void fill_start(float *imp, const int *lens, int rows, int n_kv_heads, size_t stride) {
  memset(imp, 0xFF, (size_t)rows * (size_t)n_kv_heads * stride * sizeof(float));
  for (int i = 0; i < rows; i++)
    for (int g = 0; g < n_kv_heads; g++)
      t_fill_uniform(imp + ((size_t)i * (size_t)n_kv_heads + (size_t)g) * stride,
                     (size_t)lens[i], 0.0f, 1.0f);
}

/* Calls the importance call `calls` times with decay on layer 0 of kv for ids, q host; imp
 * holds the starting rows and gets the result; out gets the last output. */
static int run_imp(t_kv *kv, const int32_t *ids, int n, const float *q, float *imp,
                   size_t stride, float decay, int calls, float *out) {
  const m40llm_kvcache_options *o = &kv->opts;
  const size_t qn = (size_t)n * (size_t)o->n_heads * (size_t)o->head_dim;
  const size_t in = (size_t)n * (size_t)o->n_kv_heads * stride;
  float *dq = t_dev_upload(kv->ctx, q, qn * sizeof(float));
  float *dout = t_dev_alloc(kv->ctx, qn * sizeof(float));
  float *di = t_dev_alloc(kv->ctx, in * sizeof(float) + 4);
  int ok = dq && dout && di && T_OK(m40llm_memset(kv->ctx, dout, 0xFF, qn * sizeof(float))) &&
           T_OK(m40llm_memset(kv->ctx, di, 0xFF, in * sizeof(float) + 4)) &&
           T_OK(m40llm_memcpy_to_device(kv->ctx, di, imp, in * sizeof(float)));
  for (int c = 0; ok && c < calls; c++)
    ok = T_OK(m40llm_kvcache_attn_importance_ex(dout, di, stride, decay, kv->cache, 0, ids, n, dq,
                                                M40LLM_DTYPE_F32, 0.0f));
  float tail = 0.0f;
  ok = ok && T_OK(m40llm_context_synchronize(kv->ctx)) &&
       t_dev_download(kv->ctx, out, dout, qn * sizeof(float)) &&
       t_dev_download(kv->ctx, imp, di, in * sizeof(float)) &&
       t_dev_download(kv->ctx, &tail, di + in, sizeof tail);
  if (ok) T_CHECKF(t_all_bytes(&tail, 4, 0xFF), "the importance was written past its rows");
  m40llm_free(kv->ctx, dq);
  m40llm_free(kv->ctx, dout);
  m40llm_free(kv->ctx, di);
  return ok;
}

typedef struct {
  int n_heads, n_kv_heads, head_dim, n_seqs, rows;
  int lens[4];
} imp_shape;

/* The float64 reference: each row's importance after `calls` calls from its starting values,
 * and its output. Rows take the ids i % n_seqs. */
static void ref_case(m40llm_context *ctx, imp_shape s, float decay, int small) {
  int max_len = 1;
  for (int i = 0; i < s.n_seqs; i++) {
    if (small && s.lens[i] > 300) s.lens[i] = 300 + s.lens[i] % 7;
    if (s.lens[i] > max_len) max_len = s.lens[i];
  }
  t_set_case("importance F16 %d/%d heads, head_dim %d, %d rows over lengths %d %d %d %d, decay %g",
             s.n_heads, s.n_kv_heads, s.head_dim, s.rows, s.lens[0], s.lens[1], s.lens[2],
             s.lens[3], (double)decay);
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, s.n_heads, s.n_kv_heads, s.head_dim, s.n_seqs, max_len) !=
      M40LLM_OK)
    return;
  for (int i = 0; i < s.n_seqs; i++)
    if (s.lens[i] > 0 && !T_OK(t_kv_append_random(&kv, 0, i, s.lens[i], 1.0f))) goto done;
  const int calls = 2, group = s.n_heads / s.n_kv_heads;
  const size_t stride = (size_t)max_len + 2, hd = (size_t)s.n_heads * (size_t)s.head_dim;
  const size_t in = (size_t)s.rows * (size_t)s.n_kv_heads * stride;
  int32_t *ids = malloc((size_t)s.rows * sizeof *ids);
  int *lens = malloc((size_t)s.rows * sizeof *lens);
  float *q = malloc((size_t)s.rows * hd * sizeof(float));
  float *out = malloc((size_t)s.rows * hd * sizeof(float));
  float *imp = malloc(in * sizeof(float)), *start = malloc(in * sizeof(float));
  double *w = malloc((size_t)s.n_heads * (size_t)max_len * sizeof(double));
  double *want = malloc((size_t)s.n_kv_heads * (size_t)max_len * sizeof(double));
  double *ref_out = malloc(hd * sizeof(double));
  if (!T_CHECK(ids && lens && q && out && imp && start && w && want && ref_out)) goto free_all;
  for (int i = 0; i < s.rows; i++) ids[i] = i % s.n_seqs, lens[i] = s.lens[ids[i]];
  t_fill_uniform(q, (size_t)s.rows * hd, -1.5f, 1.5f);
  fill_start(start, lens, s.rows, s.n_kv_heads, stride);
  memcpy(imp, start, in * sizeof(float));
  if (!run_imp(&kv, ids, s.rows, q, imp, stride, decay, calls, out)) goto free_all;
  double worst = 0.0;
  for (int i = 0; i < s.rows; i++) {
    const int len = lens[i];
    t_ref_weights(w, q + (size_t)i * hd, t_model_k(&kv.model, 0, ids[i]), len, s.n_heads,
                  s.n_kv_heads, s.head_dim, 0.0f);
    for (int g = 0; g < s.n_kv_heads; g++)
      for (int p = 0; p < len; p++) {
        double most = 0.0;
        for (int h = g * group; h < (g + 1) * group; h++)
          most = w[(size_t)h * (size_t)len + p] > most ? w[(size_t)h * (size_t)len + p] : most;
        double v = start[((size_t)i * (size_t)s.n_kv_heads + (size_t)g) * stride + p];
        for (int c = 0; c < calls; c++) v = decay * v + most;
        want[(size_t)g * (size_t)len + p] = v;
      }
    char what[64];
    snprintf(what, sizeof what, "row %d (seq %d)", i, (int)ids[i]);
    check_imp(imp + (size_t)i * (size_t)s.n_kv_heads * stride, want, s.n_kv_heads, len, stride,
              I_REL, what);
    t_ref_attention(ref_out, q + (size_t)i * hd, t_model_k(&kv.model, 0, ids[i]),
                    t_model_v(&kv.model, 0, ids[i]), len, s.n_heads, s.n_kv_heads, s.head_dim,
                    0.0f);
    const double err = t_rel_l2(out + (size_t)i * hd, ref_out, hd);
    if (!(err <= worst)) worst = err;
  }
  T_CHECKF(worst <= 1e-5, "output rel L2 up to %.3g", worst);
free_all:
  free(ids), free(lens), free(q), free(out), free(imp), free(start), free(w), free(want);
  free(ref_out);
done:
  t_kv_destroy(&kv);
}

/* The importance is the same backend's weights (m40llm_kvcache_attn_weights_ex), the largest
 * over each K/V head's query heads, added to the decayed start: to FP32 rounding of that sum. */
static void weights_case(m40llm_context *ctx) {
  t_set_case("importance: the weights call's weights, reduced");
  enum { H = 12, KVH = 3, D = 64, LEN = 129, N = 3 };
  const int group = H / KVH;
  const float decay = 0.75f;
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, H, KVH, D, N, LEN) != M40LLM_OK) return;
  const int32_t ids[N] = {2, 0, 1};
  const int lens[N] = {LEN, 1, 64}; /* of seqs 2, 0, 1: the rows' */
  const size_t qn = (size_t)N * H * D, wn = (size_t)N * H * LEN, in = (size_t)N * KVH * LEN;
  float *q = malloc(qn * sizeof(float)), *out = malloc(qn * sizeof(float));
  float *w = malloc(wn * sizeof(float)), *imp = malloc(in * sizeof(float));
  float *start = malloc(in * sizeof(float));
  float *dq = NULL, *dout = NULL, *dw = NULL;
  if (!T_CHECK(q && out && w && imp && start) || !T_OK(t_kv_append_random(&kv, 0, 0, 1, 1.0f)) ||
      !T_OK(t_kv_append_random(&kv, 0, 1, 64, 1.0f)) ||
      !T_OK(t_kv_append_random(&kv, 0, 2, LEN, 1.0f)))
    goto done;
  t_fill_uniform(q, qn, -2.0f, 2.0f);
  dq = t_dev_upload(ctx, q, qn * sizeof(float));
  dout = t_dev_alloc(ctx, qn * sizeof(float));
  dw = t_dev_alloc(ctx, wn * sizeof(float));
  if (!dq || !dout || !dw ||
      !T_OK(m40llm_memset(ctx, dw, 0xFF, wn * sizeof(float))) ||
      !T_OK(m40llm_kvcache_attn_weights_ex(dout, dw, LEN, kv.cache, 0, ids, N, dq,
                                           M40LLM_DTYPE_F32, 0.0f)) ||
      !t_dev_download(ctx, w, dw, wn * sizeof(float)))
    goto done;
  fill_start(start, lens, N, KVH, LEN);
  memcpy(imp, start, in * sizeof(float));
  if (!run_imp(&kv, ids, N, q, imp, LEN, decay, 1, out)) goto done;
  long bad = 0;
  for (int i = 0; i < N; i++)
    for (int g = 0; g < KVH; g++)
      for (int p = 0; p < lens[i]; p++) {
        float most = 0.0f;
        for (int h = g * group; h < (g + 1) * group; h++)
          most = fmaxf(most, w[((size_t)i * H + (size_t)h) * LEN + p]);
        const size_t at = ((size_t)i * KVH + (size_t)g) * LEN + p;
        const float want = fmaf(decay, start[at], most);
        if (!(fabsf(imp[at] - want) <= 2.5e-7f * fabsf(want)) && bad++ < 3)
          T_CHECKF(0, "row %d K/V head %d position %d: importance %.9g, weights give %.9g", i, g,
                   p, (double)imp[at], (double)want);
      }
  T_CHECKF(bad == 0, "%ld entries differ from the reduced weights", bad);
done:
  m40llm_free(ctx, dq), m40llm_free(ctx, dout), m40llm_free(ctx, dw);
  free(q), free(out), free(w), free(imp), free(start);
  t_kv_destroy(&kv);
}

/* Quantized K/V with 4 sinks and a window of 16: the GPU against the CPU backend. */
static void quant_case(m40llm_context *ctx, m40llm_context *cpu, int kf, int vf, int n_heads,
                       int n_kv_heads, int head_dim, int small) {
  enum { N = 4 };
  const int lens[N] = {1, 20, 90, small ? 333 : 1500};
  const int max_len = lens[N - 1];
  t_set_case("importance K %d / V %d, %d/%d heads, head_dim %d", kf, vf, n_heads, n_kv_heads,
             head_dim);
  m40llm_kvcache_options o = M40LLM_KVCACHE_OPTIONS_INIT;
  o.n_layers = 1, o.n_heads = n_heads, o.n_kv_heads = n_kv_heads, o.head_dim = head_dim;
  o.max_seqs = N, o.max_seq_len = max_len, o.format = kf, o.v_format = vf;
  o.n_sinks = 4, o.window = 16;
  if (t_pair_refused(ctx, &o)) return;
  t_kv a, b;
  int ok_a = 0, ok_b = 0;
  if (t_kv_create_opts(&a, ctx, &o) == M40LLM_OK) ok_a = 1;
  if (ok_a && t_kv_create_opts(&b, cpu, &o) == M40LLM_OK) ok_b = 1;
  if (!ok_b) goto done;
  int32_t ids[N];
  int row_lens[N];
  for (int i = 0; i < N; i++) {
    t_kv *both[2] = {&a, &b};
    int st[2];
    ids[i] = N - 1 - i;
    row_lens[N - 1 - i] = lens[i];
    t_kv_append_same_random(both, st, 2, 0, i, lens[i], 1.0f, i % 2);
    if (!T_OK(st[0]) || !T_OK(st[1])) goto done;
  }
  const size_t stride = (size_t)max_len + 1, hd = (size_t)n_heads * (size_t)head_dim;
  const size_t in = (size_t)N * (size_t)n_kv_heads * stride;
  float *q = malloc(N * hd * sizeof(float)), *out = malloc(2 * N * hd * sizeof(float));
  float *imp = malloc(2 * in * sizeof(float));
  double *want = malloc((size_t)n_kv_heads * stride * sizeof(double));
  if (T_CHECK(q && out && imp && want)) {
    t_fill_uniform(q, N * hd, -1.5f, 1.5f);
    fill_start(imp, row_lens, N, n_kv_heads, stride);
    memcpy(imp + in, imp, in * sizeof(float));
    if (run_imp(&a, ids, N, q, imp, stride, 0.5f, 2, out) &&
        run_imp(&b, ids, N, q, imp + in, stride, 0.5f, 2, out + N * hd)) {
      for (int i = 0; i < N; i++) {
        char what[64];
        snprintf(what, sizeof what, "row %d (seq %d, length %d)", i, (int)ids[i], row_lens[i]);
        const float *cpu_rows = imp + in + (size_t)i * (size_t)n_kv_heads * stride;
        for (int g = 0; g < n_kv_heads; g++)
          for (int p = 0; p < row_lens[i]; p++)
            want[(size_t)g * (size_t)row_lens[i] + p] = cpu_rows[(size_t)g * stride + p];
        check_imp(imp + (size_t)i * (size_t)n_kv_heads * stride, want, n_kv_heads, row_lens[i],
                  stride, I_REL, what);
        double ref[8 * 256];
        for (size_t j = 0; j < hd; j++) ref[j] = out[N * hd + (size_t)i * hd + j];
        const double err = t_rel_l2(out + (size_t)i * hd, ref, hd);
        T_CHECKF(err <= 1e-5, "%s: output rel L2 %.3g against the CPU backend's", what, err);
      }
    }
  }
  free(q), free(out), free(imp), free(want);
done:
  if (ok_b) t_kv_destroy(&b);
  if (ok_a) t_kv_destroy(&a);
}

/* Bad calls fail with their status and write neither out nor the importance. */
static void error_case(m40llm_context *ctx) {
  t_set_case("importance: errors");
  t_kv kv;
  if (t_kv_create(&kv, ctx, 1, 4, 2, 64, 2, 64) != M40LLM_OK) return;
  const size_t hd = 4 * 64, stride = 40, all = (2 * hd + 2 * 2 * stride) * sizeof(float);
  float q[2 * 4 * 64];
  t_fill_uniform(q, 2 * hd, -1.0f, 1.0f);
  float *dq = t_dev_upload(ctx, q, sizeof q);
  float *buf = t_dev_alloc(ctx, all);
  float *host = malloc(all);
  if (!T_CHECK(dq && buf && host) || !T_OK(t_kv_append_random(&kv, 0, 0, 33, 1.0f)) ||
      !T_OK(t_kv_append_random(&kv, 0, 1, 40, 1.0f)) ||
      !T_OK(m40llm_memset(ctx, buf, 0xFF, all)))
    goto done;
  float *out = buf, *imp = buf + 2 * hd;
  const int32_t ids[2] = {0, 1}, bad_ids[2] = {0, 2};
  const int F32 = M40LLM_DTYPE_F32;
  T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, NULL, stride, 1.0f, kv.cache, 0, ids, 2, dq,
                                                F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "importance is NULL");
  T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, imp, 39, 1.0f, kv.cache, 0, ids, 2, dq, F32,
                                                0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "importance_stride is 39");
  const float bad_decay[3] = {-0.25f, 1.5f, NAN};
  for (int i = 0; i < 3; i++)
    T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, imp, stride, bad_decay[i], kv.cache, 0,
                                                  ids, 2, dq, F32, 0.0f),
                M40LLM_ERR_INVALID_ARGUMENT, "decay is");
  T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, imp, stride, 1.0f, kv.cache, 0, bad_ids, 2,
                                                dq, F32, 0.0f),
              M40LLM_ERR_OUT_OF_RANGE, "seq_ids[1] = 2");
  T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, out + hd, stride, 1.0f, kv.cache, 0, ids, 2,
                                                dq, F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "overlap out");
  T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, dq + 8, stride, 1.0f, kv.cache, 0, ids, 2,
                                                dq, F32, 0.0f),
              M40LLM_ERR_INVALID_ARGUMENT, "overlap q");
  T_FAIL_WITH(m40llm_kvcache_attn_importance_ex(out, imp, stride, 1.0f, kv.cache, 1, ids, 2, dq,
                                                F32, 0.0f),
              M40LLM_ERR_OUT_OF_RANGE, "layer 1");
  if (T_OK(m40llm_context_synchronize(ctx)) && t_dev_download(ctx, host, buf, all))
    T_CHECKF(t_all_bytes(host, all, 0xFF), "a failed call wrote out or the importance");
  /* The boundaries: a stride of exactly the longest length, decay 0 and 1. */
  T_OK(m40llm_kvcache_attn_importance_ex(out, imp, 40, 0.0f, kv.cache, 0, ids, 2, dq, F32,
                                         0.0f));
  T_OK(m40llm_kvcache_attn_importance_ex(out, imp, 40, 1.0f, kv.cache, 0, ids, 2, dq, F32,
                                         0.0f));
done:
  m40llm_free(ctx, dq);
  m40llm_free(ctx, buf);
  free(host);
  t_kv_destroy(&kv);
}

void t_cases_importance(m40llm_context *ctx, m40llm_context *cpu, int small) {
  /* Groups 1, 3, 4, 8 and MQA; an empty sequence; 130 rows (more than one launch's 128). */
  static const imp_shape shapes[] = {
      {4, 4, 64, 4, 5, {1, 31, 33, 257}},    {9, 3, 64, 3, 4, {0, 2049, 33, 0}},
      {8, 1, 128, 2, 3, {257, 4000, 0, 0}},  {32, 8, 128, 2, 2, {1, 1500, 0, 0}},
      {16, 2, 256, 2, 2, {100, 700, 0, 0}},  {6, 2, 80, 2, 3, {45, 600, 0, 0}},
      {8, 2, 64, 3, 130, {5, 40, 17, 0}},
  };
  const float decays[] = {1.0f, 0.5f, 0.0f};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    ref_case(ctx, shapes[i], decays[i % 3], small);
  weights_case(ctx);
  error_case(ctx);
  if (!cpu) return;
  static const int pairs[][2] = {{M40LLM_KV_Q8, M40LLM_KV_Q4}, {M40LLM_KV_Q4, M40LLM_KV_Q2}};
  static const int heads[][3] = {{8, 2, 128}, {16, 2, 128}, {4, 4, 96}};
  for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++)
    for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++)
      quant_case(ctx, cpu, pairs[p][0], pairs[p][1], heads[h][0], heads[h][1], heads[h][2],
                 small);
}
