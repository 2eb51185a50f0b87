/* The CPU backend: plain C over host memory. Attention accumulates in double, so it doubles as
 * the reference the GPU is tested against. K/V rows go through their format's reference
 * routines (kv_format.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int cpu_device_count(int *out_count) {
  *out_count = 0;
  return M40LLM_OK;
}

static int cpu_init(m40llm_context *ctx, int device, void *user_stream) {
  (void)device, (void)user_stream;
  ctx->state = NULL;
  return M40LLM_OK;
}

static void cpu_fini(m40llm_context *ctx) { (void)ctx; }

static int cpu_synchronize(m40llm_context *ctx) {
  (void)ctx;
  return M40LLM_OK;
}

static void *cpu_stream(const m40llm_context *ctx) {
  (void)ctx;
  return NULL;
}

static int cpu_device_info(m40llm_device_info *out, const m40llm_context *ctx) {
  (void)ctx;
  out->backend = M40LLM_BACKEND_CPU;
  out->device = -1;
  strcpy(out->name, "CPU");
  return M40LLM_OK;
}

static int cpu_malloc(void **out, m40llm_context *ctx, size_t bytes) {
  (void)ctx;
  if (bytes > SIZE_MAX - 255)
    return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes", bytes);
  void *p = m40llm_host_aligned_alloc(256, (bytes + 255) & ~(size_t)255);
  if (!p) return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes", bytes);
  *out = p;
  return M40LLM_OK;
}

static int cpu_free(m40llm_context *ctx, void *ptr) {
  (void)ctx;
  free(ptr);
  return M40LLM_OK;
}

static int cpu_memcpy(m40llm_context *ctx, void *dst, const void *src, size_t bytes, int kind) {
  (void)ctx, (void)kind;
  memmove(dst, src, bytes);
  return M40LLM_OK;
}

static int cpu_memset(m40llm_context *ctx, void *dst, int value, size_t bytes) {
  (void)ctx;
  memset(dst, value, bytes);
  return M40LLM_OK;
}

static int cpu_check_cache(const m40llm_kvcache_options *opts) {
  (void)opts;
  return M40LLM_OK;
}

static int cpu_cache_created(m40llm_kvcache *c) {
  (void)c;
  return M40LLM_OK;
}

static int cpu_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                      const void *v, int n_tokens, int src_is_f32) {
  const m40llm_kvcache_options *o = &c->opts;
  const int d = o->head_dim;
  for (int t = 0; t < n_tokens; t++) {
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t src = ((size_t)t * (size_t)o->n_kv_heads + (size_t)h) * (size_t)d;
      const size_t row = m40llm_kv_row(o, layer, seq, h, pos + t);
      const m40llm_kv_tensor *tensors[2] = {&c->k, &c->v};
      const void *srcs[2] = {k, v};
      for (int i = 0; i < 2; i++) {
        const m40llm_kv_tensor *x = tensors[i];
        void *codes = m40llm_kv_at(x, M40LLM_KV_CODES, row);
        void *params = m40llm_kv_at(x, M40LLM_KV_PARAMS, row);
        if (src_is_f32)
          x->layout.fmt->encode_f32(codes, params, (const float *)srcs[i] + src, d);
        else
          x->layout.fmt->encode_f16(codes, params, (const uint16_t *)srcs[i] + src, d);
      }
    }
  }
  return M40LLM_OK;
}

static void read_rows(const m40llm_kv_tensor *x, uint16_t *out, const m40llm_kvcache_options *o,
                      int layer, int seq, int pos, int n_tokens) {
  if (!out) return;
  const int d = o->head_dim;
  for (int t = 0; t < n_tokens; t++)
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t row = m40llm_kv_row(o, layer, seq, h, pos + t);
      x->layout.fmt->read_f16(out + ((size_t)t * (size_t)o->n_kv_heads + (size_t)h) * (size_t)d,
                              m40llm_kv_at(x, M40LLM_KV_CODES, row),
                              m40llm_kv_at(x, M40LLM_KV_PARAMS, row), d);
    }
}

static int cpu_read_f16(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                        int seq, int pos, int n_tokens) {
  read_rows(&c->k, k_out, &c->opts, layer, seq, pos, n_tokens);
  read_rows(&c->v, v_out, &c->opts, layer, seq, pos, n_tokens);
  return M40LLM_OK;
}

static int cpu_fork(const m40llm_kvcache *c, int dst_seq, int src_seq) {
  const m40llm_kvcache_options *o = &c->opts;
  const m40llm_kv_tensor *tensors[2] = {&c->k, &c->v};
  for (int l = 0; l < o->n_layers; l++) {
    const size_t n = (size_t)*m40llm_len_slot(c, l, src_seq);
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t src = m40llm_kv_row(o, l, src_seq, h, 0);
      const size_t dst = m40llm_kv_row(o, l, dst_seq, h, 0);
      for (int i = 0; i < 2; i++)
        for (int p = 0; p < M40LLM_KV_PLANES; p++)
          if (tensors[i]->plane[p])
            memcpy(m40llm_kv_at(tensors[i], p, dst), m40llm_kv_at(tensors[i], p, src),
                   n * tensors[i]->layout.row_bytes[p]);
    }
  }
  return M40LLM_OK;
}

/* A row of K or V as floats. */
static void decode_row(float *dst, const m40llm_kv_tensor *x, size_t row, int d) {
  x->layout.fmt->decode(dst, m40llm_kv_at(x, M40LLM_KV_CODES, row),
                        m40llm_kv_at(x, M40LLM_KV_PARAMS, row), d);
}

/* One query head against the len rows of one K/V head from row base, in double, with a running
 * (online) softmax so no per-position scratch is needed. A -inf score has weight 0; a row whose
 * every score is -inf yields zeros. */
static void attend_head(const m40llm_kvcache *c, size_t base, int len, const float *q,
                        float *out, double scale, double *acc, float *row) {
  const int d = c->opts.head_dim;
  if (len == 0) {
    memset(out, 0, (size_t)d * sizeof(float));
    return;
  }
  double max = -INFINITY, sum = 0.0;
  for (int i = 0; i < d; i++) acc[i] = 0.0;
  for (int p = 0; p < len; p++) {
    decode_row(row, &c->k, base + (size_t)p, d);
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)q[i] * (double)row[i];
    s *= scale;
    if (s > max) {
      const double r = exp(max - s);
      sum *= r;
      for (int i = 0; i < d; i++) acc[i] *= r;
      max = s;
    }
    /* A score of -inf (K holds an infinity) has weight 0, even while max is still -inf. */
    const double w = s == -INFINITY ? 0.0 : exp(s - max);
    sum += w;
    decode_row(row, &c->v, base + (size_t)p, d);
    for (int i = 0; i < d; i++) acc[i] += w * (double)row[i];
  }
  /* Every score -inf: nothing had weight, the output is zeros. */
  for (int i = 0; i < d; i++) out[i] = sum > 0.0 ? (float)(acc[i] / sum) : 0.0f;
}

static int cpu_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                         const float *q, float *out, float scale) {
  const m40llm_kvcache_options *o = &c->opts;
  const int group = o->n_heads / o->n_kv_heads;
  const size_t d = (size_t)o->head_dim;
  double acc[256];
  float row[256];
  for (int i = 0; i < n_seqs; i++) {
    const int len = *m40llm_len_slot(c, layer, seq_ids[i]);
    for (int h = 0; h < o->n_heads; h++) {
      const size_t base = m40llm_kv_row(o, layer, seq_ids[i], h / group, 0);
      const size_t r = ((size_t)i * (size_t)o->n_heads + (size_t)h) * d;
      attend_head(c, base, len, q + r, out + r, (double)scale, acc, row);
    }
  }
  return M40LLM_OK;
}

const m40llm_backend_ops m40llm_cpu_backend = {
    .kind = M40LLM_BACKEND_CPU,
    .device_count = cpu_device_count,
    .no_device_reason = NULL,
    .init = cpu_init,
    .fini = cpu_fini,
    .synchronize = cpu_synchronize,
    .stream = cpu_stream,
    .device_info = cpu_device_info,
    .malloc = cpu_malloc,
    .free = cpu_free,
    .memcpy = cpu_memcpy,
    .memset = cpu_memset,
    .check_cache = cpu_check_cache,
    .cache_created = cpu_cache_created,
    .append = cpu_append,
    .read_f16 = cpu_read_f16,
    .fork = cpu_fork,
    .attention = cpu_attention,
};
