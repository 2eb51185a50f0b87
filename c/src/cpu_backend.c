/* The CPU backend: plain C over host memory. Attention accumulates in double, so it doubles as
 * the reference the GPU is tested against. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int m40llm_cpu_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                      const void *v, int n_tokens, int src_is_f32) {
  const m40llm_kvcache_options *o = &c->opts;
  const size_t d = (size_t)o->head_dim;
  for (int t = 0; t < n_tokens; t++) {
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t src = ((size_t)t * (size_t)o->n_kv_heads + (size_t)h) * d;
      const size_t dst = m40llm_kv_offset(o, layer, seq, h, pos + t);
      if (src_is_f32) {
        for (size_t i = 0; i < d; i++) {
          c->k[dst + i] = m40llm_f32_to_f16(((const float *)k)[src + i]);
          c->v[dst + i] = m40llm_f32_to_f16(((const float *)v)[src + i]);
        }
      } else {
        memcpy(c->k + dst, (const uint16_t *)k + src, d * sizeof(uint16_t));
        memcpy(c->v + dst, (const uint16_t *)v + src, d * sizeof(uint16_t));
      }
    }
  }
  return M40LLM_OK;
}

void m40llm_cpu_read(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                     int seq, int pos, int n_tokens) {
  const m40llm_kvcache_options *o = &c->opts;
  const size_t d = (size_t)o->head_dim;
  for (int t = 0; t < n_tokens; t++) {
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t dst = ((size_t)t * (size_t)o->n_kv_heads + (size_t)h) * d;
      const size_t src = m40llm_kv_offset(o, layer, seq, h, pos + t);
      if (k_out) memcpy(k_out + dst, c->k + src, d * sizeof(uint16_t));
      if (v_out) memcpy(v_out + dst, c->v + src, d * sizeof(uint16_t));
    }
  }
}

void m40llm_cpu_fork(const m40llm_kvcache *c, int dst_seq, int src_seq) {
  const m40llm_kvcache_options *o = &c->opts;
  for (int l = 0; l < o->n_layers; l++) {
    const size_t n = (size_t)*m40llm_len_slot(c, l, src_seq) * (size_t)o->head_dim;
    for (int h = 0; h < o->n_kv_heads; h++) {
      const size_t src = m40llm_kv_offset(o, l, src_seq, h, 0);
      const size_t dst = m40llm_kv_offset(o, l, dst_seq, h, 0);
      memcpy(c->k + dst, c->k + src, n * sizeof(uint16_t));
      memcpy(c->v + dst, c->v + src, n * sizeof(uint16_t));
    }
  }
}

/* One query head against one K/V head of length len, in double, with a running (online)
 * softmax so no per-position scratch is needed. */
static void attend_head(int d, const uint16_t *k, const uint16_t *v, int len, const float *q,
                        float *out, double scale, double *acc) {
  if (len == 0) {
    memset(out, 0, (size_t)d * sizeof(float));
    return;
  }
  double max = -INFINITY, sum = 0.0;
  for (int i = 0; i < d; i++) acc[i] = 0.0;
  for (int p = 0; p < len; p++) {
    double s = 0.0;
    for (int i = 0; i < d; i++) s += (double)q[i] * (double)m40llm_f16_to_f32(k[(size_t)p * d + i]);
    s *= scale;
    if (s > max) {
      const double r = exp(max - s);
      sum *= r;
      for (int i = 0; i < d; i++) acc[i] *= r;
      max = s;
    }
    const double w = exp(s - max);
    sum += w;
    for (int i = 0; i < d; i++) acc[i] += w * (double)m40llm_f16_to_f32(v[(size_t)p * d + i]);
  }
  for (int i = 0; i < d; i++) out[i] = (float)(acc[i] / sum);
}

void m40llm_cpu_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                          const float *q, float *out, float scale) {
  const m40llm_kvcache_options *o = &c->opts;
  const int group = o->n_heads / o->n_kv_heads;
  const size_t d = (size_t)o->head_dim;
  double acc[256];
  for (int i = 0; i < n_seqs; i++) {
    const int len = *m40llm_len_slot(c, layer, seq_ids[i]);
    for (int h = 0; h < o->n_heads; h++) {
      const size_t base = m40llm_kv_offset(o, layer, seq_ids[i], h / group, 0);
      const size_t row = ((size_t)i * (size_t)o->n_heads + (size_t)h) * d;
      attend_head(o->head_dim, c->k + base, c->v + base, len, q + row, out + row, (double)scale,
                  acc);
    }
  }
}
