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

static int cpu_prepare_attention(const m40llm_kvcache *c, int n_rows, const void *q,
                                 const void *out, int dtype, int observe_len) {
  (void)c, (void)n_rows, (void)q, (void)out, (void)dtype, (void)observe_len;
  return M40LLM_OK;
}

/* Encodes one row of a tensor from input of element type dtype: an F16 tensor stores FP16
 * input as it is (bits unchanged); otherwise the row is taken as FP32, rotated where the tensor
 * is, and a quantized tensor keeps its FP16 copy in protected row `protected_row` (SIZE_MAX:
 * none; an F16 tensor has no copies). */
static void append_row(const m40llm_kvcache *c, const m40llm_kv_tensor *x, size_t row,
                       const void *src, int dtype, size_t protected_row) {
  const int d = c->opts.head_dim;
  void *codes = m40llm_kv_at(x, M40LLM_KV_CODES, row);
  void *params = m40llm_kv_at(x, M40LLM_KV_PARAMS, row);
  if (x->layout.fmt->format == M40LLM_KV_F16 && dtype == M40LLM_DTYPE_F16) {
    x->layout.fmt->encode_f16(codes, params, src, d);
    return;
  }
  float f[256];
  for (int i = 0; i < d; i++) f[i] = m40llm_dtype_load(src, dtype, (size_t)i);
  if (x->rotated) m40llm_rotate_f32(f, d);
  x->layout.fmt->encode_f32(codes, params, f, d);
  if (x->layout.fmt->format != M40LLM_KV_F16 && protected_row != SIZE_MAX)
    for (int i = 0; i < d; i++) x->fp16[protected_row * (size_t)d + i] = m40llm_f32_to_f16(f[i]);
}

/* One item's rows: positions [pos, pos + n_tokens) of (layer, seq) from src rows k and v. */
static void append_item(const m40llm_kvcache *c, int layer, const m40llm_append_item *it,
                        const unsigned char *k, const unsigned char *v, int dtype) {
  const m40llm_kvcache_options *o = &c->opts;
  const size_t d = (size_t)o->head_dim, elem = m40llm_dtype_size(dtype);
  const m40llm_kv_tensor *tensors[2] = {&c->k, &c->v};
  const unsigned char *srcs[2] = {k, v};
  const int end = it->pos + it->n_tokens;
  for (int t = 0; t < it->n_tokens; t++) {
    const int p = it->pos + t;
    const int kept = c->slots > 0 && (p < c->n_sinks || p >= end - c->window);
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t src = ((size_t)t * (size_t)o->n_kv_heads + (size_t)h) * d * elem;
      const size_t prow =
          kept ? m40llm_kv_protected_row(o, c->slots, layer, it->seq, h,
                                         m40llm_kv_protected_slot(c->n_sinks, c->window, p))
               : SIZE_MAX;
      for (int i = 0; i < 2; i++)
        append_row(c, tensors[i], m40llm_kv_row(o, layer, it->seq, h, p), srcs[i] + src, dtype,
                   prow);
    }
  }
}

/* ---- Tiered caches: rows in tiers (the maps are the front end's, tiers.c) ---- */

static const m40llm_kv_tensor *tier_tensor(const m40llm_kvcache *c, int t, int is_v) {
  return is_v ? &c->tier_v[t] : &c->tier_k[t];
}

/* Tier row (t, slot) of K/V head h as stored (rotated frame), in FP32. */
static void tier_get(const m40llm_kvcache *c, int t, int is_v, int layer, int seq, int h,
                     int slot, float *dst) {
  const m40llm_kv_tensor *x = tier_tensor(c, t, is_v);
  const size_t row = m40llm_tier_row(c, t, layer, seq, h, slot);
  x->layout.fmt->decode(dst, m40llm_kv_at(x, M40LLM_KV_CODES, row),
                        m40llm_kv_at(x, M40LLM_KV_PARAMS, row), c->opts.head_dim);
}

static uint16_t *kept_row(const m40llm_kvcache *c, int is_v, int layer, int seq, int h, int pos) {
  const m40llm_kv_tensor *x = is_v ? &c->v : &c->k;
  return x->fp16 + m40llm_kv_protected_row(&c->opts, c->slots, layer, seq, h,
                                           m40llm_kv_protected_slot(c->n_sinks, c->window, pos)) *
                       (size_t)c->opts.head_dim;
}

/* One op's row of K/V head h of tensor is_v (m40llm_row_op). */
static void row_op(const m40llm_kvcache *c, int layer, const m40llm_row_op *op, int is_v, int h,
                   const void *in, int dtype, uint16_t *out) {
  const m40llm_kvcache_options *o = &c->opts;
  const int d = o->head_dim;
  const m40llm_kv_tensor *x = is_v ? &c->v : &c->k;
  if (op->from >= 0 && op->from == op->to) { /* within a tier: the bytes */
    if (h == 0 && !is_v) m40llm_tier_map_at(c, op->to, layer, op->seq)[op->dst] = op->pos;
    const m40llm_kv_tensor *y = tier_tensor(c, op->from, is_v);
    for (int p = 0; p < M40LLM_KV_PLANES; p++)
      if (y->plane[p])
        memcpy(m40llm_kv_at(y, p, m40llm_tier_row(c, op->to, layer, op->seq, h, op->dst)),
               m40llm_kv_at(y, p, m40llm_tier_row(c, op->from, layer, op->seq, h, op->src)),
               y->layout.row_bytes[p]);
    return;
  }
  float f[256];
  const size_t in_row = ((size_t)op->src * (size_t)o->n_kv_heads + (size_t)h) * (size_t)d;
  if (op->from == M40LLM_ROW_INPUT) {
    for (int i = 0; i < d; i++) f[i] = m40llm_dtype_load(in, dtype, in_row + (size_t)i);
    if (x->rotated) m40llm_rotate_f32(f, d);
  } else if (op->from == M40LLM_ROW_KEPT) {
    const uint16_t *r = kept_row(c, is_v, layer, op->seq, h, op->src);
    for (int i = 0; i < d; i++) f[i] = m40llm_f16_to_f32(r[i]);
  } else {
    tier_get(c, op->from, is_v, layer, op->seq, h, op->src, f);
  }
  if (op->to == M40LLM_ROW_OUTPUT) {
    if (!out) return;
    if (x->rotated) m40llm_rotate_f32(f, d);
    uint16_t *r = out + ((size_t)op->dst * (size_t)o->n_kv_heads + (size_t)h) * (size_t)d;
    for (int i = 0; i < d; i++) r[i] = m40llm_f32_to_f16(f[i]);
  } else if (op->to == M40LLM_ROW_KEPT) {
    uint16_t *r = kept_row(c, is_v, layer, op->seq, h, op->dst);
    for (int i = 0; i < d; i++) r[i] = m40llm_f32_to_f16(f[i]);
  } else {
    if (h == 0 && !is_v) m40llm_tier_map_at(c, op->to, layer, op->seq)[op->dst] = op->pos;
    const m40llm_kv_tensor *y = tier_tensor(c, op->to, is_v);
    const size_t row = m40llm_tier_row(c, op->to, layer, op->seq, h, op->dst);
    y->layout.fmt->encode_f32(m40llm_kv_at(y, M40LLM_KV_CODES, row),
                              m40llm_kv_at(y, M40LLM_KV_PARAMS, row), f, d);
  }
}

/* Whether ops a and b name the same tier row. */
static int same_row(const m40llm_row_op *a, int a_tier, int a_slot, const m40llm_row_op *b,
                    int b_tier, int b_slot) {
  return a_tier >= 0 && a_tier == b_tier && a_slot == b_slot && a->seq == b->seq;
}

/* Last chain first: a call's chains are independent (backend.h), as the GPU, which runs them
 * at once, needs; a list that leaned on their order would then fail the tests here too. A
 * chain's ops in order. A list in which an op reads a tier row that another op of the call
 * writes, other than a later op of its own chain, is refused: the GPU, which reads tier rows
 * through the read-only cache, could read the old row (a bug of the front end's, which the
 * tests then see). */
static int cpu_tier_rows(const m40llm_kvcache *c, int layer, const m40llm_row_op *ops, int n_ops,
                         const uint8_t *links, int n_chains, const void *k_in, const void *v_in,
                         int dtype, uint16_t *k_out, uint16_t *v_out) {
  for (int ch = 0, begin = 0; ch < n_chains; begin += links[ch++])
    for (int i = begin; i < begin + links[ch]; i++)
      for (int j = 0; j < n_ops; j++)
        if (j != i && !(j > i && j < begin + links[ch]) &&
            same_row(&ops[i], ops[i].from, ops[i].src, &ops[j], ops[j].to, ops[j].dst))
          return m40llm_fail(M40LLM_ERR_INVALID_ARGUMENT,
                             "row op %d reads tier %d slot %d of seq %d, which op %d of the same "
                             "call writes (a library bug)",
                             i, ops[i].from, ops[i].src, ops[i].seq, j);
  for (int ch = n_chains - 1, end = n_ops; ch >= 0; end -= links[ch--])
    for (int i = end - links[ch]; i < end; i++)
      for (int h = 0; h < c->opts.n_kv_heads; h++) {
        row_op(c, layer, &ops[i], 0, h, k_in, dtype, k_out);
        row_op(c, layer, &ops[i], 1, h, v_in, dtype, v_out);
      }
  return M40LLM_OK;
}

static int cpu_append(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                      int n_items, const void *k, const void *v, int dtype) {
  const size_t row =
      (size_t)c->opts.n_kv_heads * (size_t)c->opts.head_dim * m40llm_dtype_size(dtype);
  size_t off = 0;
  for (int i = 0; i < n_items; i++) {
    append_item(c, layer, &items[i], (const unsigned char *)k + off,
                (const unsigned char *)v + off, dtype);
    off += (size_t)items[i].n_tokens * row;
  }
  return M40LLM_OK;
}

/* Row (layer, seq, h, pos) of a tensor as attention reads it, in FP32 and as stored (rotated
 * where the tensor is): the FP16 copy of a protected position, else the decoded row. */
static void row_values(const m40llm_kvcache *c, const m40llm_kv_tensor *x, int layer, int seq,
                       int h, int pos, float *dst) {
  const m40llm_kvcache_options *o = &c->opts;
  const int d = o->head_dim;
  if (x->fp16 && m40llm_is_protected(c, layer, seq, pos)) {
    const uint16_t *r = kept_row(c, x == &c->v, layer, seq, h, pos);
    for (int i = 0; i < d; i++) dst[i] = m40llm_f16_to_f32(r[i]);
    return;
  }
  if (c->n_tiers > 0) {
    const uint32_t w = m40llm_tier_where_of(c, layer, seq)[pos];
    tier_get(c, m40llm_where_tier(w), x == &c->v, layer, seq, h, m40llm_where_slot(w), dst);
    return;
  }
  const size_t row = m40llm_kv_row(o, layer, seq, h, pos);
  x->layout.fmt->decode(dst, m40llm_kv_at(x, M40LLM_KV_CODES, row),
                        m40llm_kv_at(x, M40LLM_KV_PARAMS, row), d);
}

static void read_rows(const m40llm_kvcache *c, const m40llm_kv_tensor *x, uint16_t *out,
                      int layer, int seq, int pos, int n_tokens) {
  if (!out) return;
  const m40llm_kvcache_options *o = &c->opts;
  const int d = o->head_dim;
  float f[256];
  for (int t = 0; t < n_tokens; t++)
    for (int h = 0; h < o->n_kv_heads; h++) {
      uint16_t *dst = out + ((size_t)t * (size_t)o->n_kv_heads + (size_t)h) * (size_t)d;
      if (x->layout.fmt->format == M40LLM_KV_F16) { /* stored bits, NaN payloads included */
        const size_t row = m40llm_kv_row(o, layer, seq, h, pos + t);
        x->layout.fmt->read_f16(dst, m40llm_kv_at(x, M40LLM_KV_CODES, row), NULL, d);
        continue;
      }
      row_values(c, x, layer, seq, h, pos + t, f);
      if (x->rotated) m40llm_rotate_f32(f, d);
      for (int i = 0; i < d; i++) dst[i] = m40llm_f32_to_f16(f[i]);
    }
}

static int cpu_read_f16(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                        int seq, int pos, int n_tokens) {
  read_rows(c, &c->k, k_out, layer, seq, pos, n_tokens);
  read_rows(c, &c->v, v_out, layer, seq, pos, n_tokens);
  return M40LLM_OK;
}

/* A tiered cache's rows of (layer, src_seq) into dst_seq: each tier's rows and slot map (the
 * front end copies its own maps). */
static void fork_tiers(const m40llm_kvcache *c, int l, int dst_seq, int src_seq) {
  for (int t = 0; t < c->n_tiers; t++) {
    const size_t n = (size_t)m40llm_tier_counts(c, l, src_seq)[t];
    if (n > 0)
      memcpy(m40llm_tier_map_at(c, t, l, dst_seq), m40llm_tier_map_at(c, t, l, src_seq),
             n * sizeof(int32_t));
    for (int i = 0; i < 2; i++) {
      const m40llm_kv_tensor *x = tier_tensor(c, t, i);
      for (int h = 0; h < c->opts.n_kv_heads; h++)
        for (int p = 0; p < M40LLM_KV_PLANES; p++)
          if (x->plane[p] && n > 0)
            memcpy(m40llm_kv_at(x, p, m40llm_tier_row(c, t, l, dst_seq, h, 0)),
                   m40llm_kv_at(x, p, m40llm_tier_row(c, t, l, src_seq, h, 0)),
                   n * x->layout.row_bytes[p]);
    }
  }
}

static int cpu_fork(const m40llm_kvcache *c, int dst_seq, int src_seq) {
  const m40llm_kvcache_options *o = &c->opts;
  const m40llm_kv_tensor *tensors[2] = {&c->k, &c->v};
  const size_t d = (size_t)o->head_dim;
  for (int l = 0; l < o->n_layers; l++) {
    const size_t n = (size_t)*m40llm_len_slot(c, l, src_seq);
    for (int i = 0; i < 2; i++) {
      const m40llm_kv_tensor *x = tensors[i];
      for (int h = 0; h < o->n_kv_heads; h++) {
        const size_t src = m40llm_kv_row(o, l, src_seq, h, 0);
        const size_t dst = m40llm_kv_row(o, l, dst_seq, h, 0);
        for (int p = 0; p < M40LLM_KV_PLANES; p++)
          if (x->plane[p])
            memcpy(m40llm_kv_at(x, p, dst), m40llm_kv_at(x, p, src), n * x->layout.row_bytes[p]);
      }
      if (x->fp16) /* every head's slots of a (layer, seq) are one run */
        memcpy(x->fp16 + m40llm_kv_protected_row(o, c->slots, l, dst_seq, 0, 0) * d,
               x->fp16 + m40llm_kv_protected_row(o, c->slots, l, src_seq, 0, 0) * d,
               (size_t)o->n_kv_heads * (size_t)c->slots * d * sizeof(uint16_t));
    }
    if (c->n_tiers > 0) fork_tiers(c, l, dst_seq, src_seq);
  }
  return M40LLM_OK;
}

/* One query head against positions [begin, end) of K/V head h of (layer, seq), in double,
 * with a running (online) softmax so no per-position scratch is needed; q and the output in the
 * tensors' rotated frames (the caller rotates). A -inf score has weight 0; a row whose every
 * score is -inf yields zeros. */
static void attend_head(const m40llm_kvcache *c, int layer, int seq, int h, int begin, int end,
                        const double *q, double *out, double scale, float *row,
                        float *weights) {
  const int d = c->opts.head_dim;
  for (int i = 0; i < d; i++) out[i] = 0.0;
  double max = -INFINITY, sum = 0.0;
  for (int p = begin; p < end; p++) {
    row_values(c, &c->k, layer, seq, h, p, row);
    double s = 0.0;
    for (int i = 0; i < d; i++) s += q[i] * (double)row[i];
    s *= scale;
    if (s > max) {
      const double r = exp(max - s);
      sum *= r;
      for (int i = 0; i < d; i++) out[i] *= r;
      max = s;
    }
    /* A score of -inf (K holds an infinity) has weight 0, even while max is still -inf. */
    const double w = s == -INFINITY ? 0.0 : exp(s - max);
    sum += w;
    row_values(c, &c->v, layer, seq, h, p, row);
    for (int i = 0; i < d; i++) out[i] += w * (double)row[i];
  }
  /* Every score -inf (or no position): nothing had weight, the output is zeros. */
  for (int i = 0; i < d; i++) out[i] = sum > 0.0 ? out[i] / sum : 0.0;
  if (!weights) return;
  for (int p = begin; p < end; p++) { /* the scores again, now that max and sum are known */
    row_values(c, &c->k, layer, seq, h, p, row);
    double s = 0.0;
    for (int i = 0; i < d; i++) s += q[i] * (double)row[i];
    s *= scale;
    weights[p - begin] = (float)(s == -INFINITY || !(sum > 0.0) ? 0.0 : exp(s - max) / sum);
  }
}

/* Query row `row` (every head) of q against positions [begin, end) of (layer, seq); weights:
 * NULL, or this row's n_heads rows of weights_stride floats. */
static void attend_row(const m40llm_kvcache *c, int layer, int seq, int begin, int end,
                       size_t row, const void *q, void *out, int dtype, float scale,
                       float *weights, size_t weights_stride) {
  const m40llm_kvcache_options *o = &c->opts;
  const int group = o->n_heads / o->n_kv_heads;
  const int d = o->head_dim;
  double qd[256], acc[256];
  float kv[256];
  for (int h = 0; h < o->n_heads; h++) {
    const size_t r = (row * (size_t)o->n_heads + (size_t)h) * (size_t)d;
    for (int j = 0; j < d; j++) qd[j] = m40llm_dtype_load(q, dtype, r + (size_t)j);
    if (c->k.rotated) m40llm_rotate_f64(qd, d);
    attend_head(c, layer, seq, h / group, begin, end, qd, acc, (double)scale, kv,
                weights ? weights + (size_t)h * weights_stride : NULL);
    if (c->v.rotated) m40llm_rotate_f64(acc, d);
    for (int j = 0; j < d; j++) m40llm_dtype_store(out, dtype, r + (size_t)j, (float)acc[j]);
  }
}

/* Importance (m40llm_attn_export): each query head's weights into a scratch row, then, per
 * position, the largest over a K/V head's query heads added to the decayed value; an observe
 * call's largest over every query head added to the position's accumulator, and counted. */
static int cpu_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                         const void *q, void *out, int dtype, float scale,
                         const m40llm_attn_export *x) {
  const m40llm_kvcache_options *o = &c->opts;
  if (!x || (!x->importance && !x->observe)) {
    for (int i = 0; i < n_seqs; i++)
      attend_row(c, layer, seq_ids[i], 0, *m40llm_len_slot(c, layer, seq_ids[i]), (size_t)i, q,
                 out, dtype, scale,
                 x ? x->weights + (size_t)i * (size_t)o->n_heads * x->weights_stride : NULL,
                 x ? x->weights_stride : 0);
    return M40LLM_OK;
  }
  const size_t stride = x->observe ? (size_t)o->max_seq_len : x->importance_stride;
  float *w = stride ? m40llm_host_malloc((size_t)o->n_heads * stride * sizeof *w) : NULL;
  if (stride && !w)
    return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "allocating the weights of %d query heads",
                       o->n_heads);
  const int group = o->n_heads / o->n_kv_heads;
  for (int i = 0; i < n_seqs; i++) {
    const int len = *m40llm_len_slot(c, layer, seq_ids[i]);
    attend_row(c, layer, seq_ids[i], 0, len, (size_t)i, q, out, dtype, scale, w, stride);
    if (x->observe) {
      m40llm_imp_acc *acc = c->imp_acc + ((size_t)layer * (size_t)o->max_seqs +
                                          (size_t)seq_ids[i]) * (size_t)o->max_seq_len;
      for (int p = 0; p < len; p++) {
        float most = 0.0f;
        for (int h = 0; h < o->n_heads; h++)
          most = w[(size_t)h * stride + (size_t)p] > most ? w[(size_t)h * stride + (size_t)p]
                                                          : most;
        acc[p].sum += most;
        acc[p].calls++;
      }
      continue;
    }
    for (int g = 0; g < o->n_kv_heads; g++) {
      float *imp = x->importance + ((size_t)i * (size_t)o->n_kv_heads + (size_t)g) * stride;
      for (int p = 0; p < len; p++) {
        float most = 0.0f;
        for (int h = g * group; h < (g + 1) * group; h++)
          most = w[(size_t)h * stride + (size_t)p] > most ? w[(size_t)h * stride + (size_t)p]
                                                          : most;
        imp[p] = (float)((double)x->decay * (double)imp[p] + (double)most);
      }
    }
  }
  free(w);
  return M40LLM_OK;
}

/* Row t of an item sees positions up to its own, pos + t, and with a window only the last
 * `window` of them. */
static int cpu_attention_causal(const m40llm_kvcache *c, int layer,
                                const m40llm_append_item *items, int n_items, const void *q,
                                void *out, int dtype, float scale, int window) {
  size_t row = 0;
  for (int i = 0; i < n_items; i++)
    for (int t = 0; t < items[i].n_tokens; t++, row++) {
      const int end = items[i].pos + t + 1;
      const int begin = window > 0 && end > window ? end - window : 0;
      attend_row(c, layer, items[i].seq, begin, end, row, q, out, dtype, scale, NULL, 0);
    }
  return M40LLM_OK;
}

/* Calls complete before they return: the records are read where they are written. */
static int cpu_policy_alloc(m40llm_kvcache *c) {
  c->imp_records = c->imp_rank;
  return M40LLM_OK;
}

static void cpu_policy_free(m40llm_kvcache *c) { c->imp_records = NULL; }

/* The record of (layer, seq): each tier's least important rows by insertion, the window's
 * scores. */
static void rank(const m40llm_kvcache *c, int layer, int seq) {
  const m40llm_imp_acc *acc =
      c->imp_acc + ((size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq) *
                       (size_t)c->opts.max_seq_len;
  m40llm_imp_record *r = m40llm_imp_record_at(c, c->imp_rank, layer, seq);
  for (int t = 0; t < c->n_tiers; t++) {
    const int count = m40llm_tier_counts(c, layer, seq)[t];
    const int32_t *map = count > 0 ? m40llm_tier_map_at(c, t, layer, seq) : NULL;
    int n = 0;
    for (int s = 0; s < count; s++) {
      const int32_t p = map[s];
      const double sc = m40llm_imp_score(acc[p]);
      if (n == M40LLM_IMP_LOW && !m40llm_imp_below(sc, p, r->low_score[t][n - 1], r->low_pos[t][n - 1]))
        continue;
      int i = n < M40LLM_IMP_LOW ? n++ : n - 1;
      for (; i > 0 && m40llm_imp_below(sc, p, r->low_score[t][i - 1], r->low_pos[t][i - 1]); i--) {
        r->low_score[t][i] = r->low_score[t][i - 1];
        r->low_pos[t][i] = r->low_pos[t][i - 1];
      }
      r->low_score[t][i] = sc;
      r->low_pos[t][i] = p;
    }
    r->n_low[t] = n;
  }
  r->win_first = m40llm_window_begin(c, layer, seq);
  r->win_n = *m40llm_len_slot(c, layer, seq) - r->win_first;
  double *win = m40llm_imp_window(r);
  for (int i = 0; i < r->win_n; i++) win[i] = m40llm_imp_score(acc[r->win_first + i]);
}

/* The sequences' records (the observe call's attention has added its weights). */
static int cpu_tier_rank(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                         int n_seqs) {
  for (int i = 0; i < n_seqs; i++) rank(c, layer, seq_ids[i]);
  return M40LLM_OK;
}

static int cpu_tier_rank_wait(const m40llm_kvcache *c, int layer) {
  (void)c, (void)layer;
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
    .prepare_attention = cpu_prepare_attention,
    .attention_appends = NULL, /* append_attn's two calls are already one pass over the rows */
    .attention = cpu_attention,
    .attention_causal = cpu_attention_causal,
    .tier_rows = cpu_tier_rows,
    .policy_alloc = cpu_policy_alloc,
    .policy_free = cpu_policy_free,
    .tier_rank = cpu_tier_rank,
    .tier_rank_wait = cpu_tier_rank_wait,
    .graph_begin = NULL, /* calls complete before they return: nothing to capture */
    .graph_end = NULL,
    .graph_launch = NULL,
    .graph_destroy = NULL,
    .capturing = NULL,
};
