/* Internal declarations shared by the C front end, the CPU backend and the CUDA backend. */
#ifndef M40LLM_INTERNAL_H
#define M40LLM_INTERNAL_H

#include "m40llm.h"

#ifdef __cplusplus
extern "C" {
#endif

struct m40llm_cuda_state; /* defined by the CUDA backend */

struct m40llm_context {
  int backend; /* M40LLM_BACKEND_CUDA or M40LLM_BACKEND_CPU */
  int device;
  struct m40llm_cuda_state *cuda;
};

struct m40llm_kvcache {
  m40llm_context *ctx;
  m40llm_kvcache_options opts;
  uint16_t *k; /* backend memory, [layer][seq][kv_head][pos][dim] */
  uint16_t *v;
  /* Authoritative lengths, [layer][seq], on the host: every change goes through this API in
   * host order, so they always match what the stream will see. */
  int *lens;
};

/* Element offset of (layer, seq, kv_head, pos, 0). */
static inline size_t m40llm_kv_offset(const m40llm_kvcache_options *o, int layer, int seq,
                                      int kv_head, int pos) {
  return ((((size_t)layer * (size_t)o->max_seqs + (size_t)seq) * (size_t)o->n_kv_heads +
           (size_t)kv_head) * (size_t)o->max_seq_len + (size_t)pos) * (size_t)o->head_dim;
}

static inline int *m40llm_len_slot(const m40llm_kvcache *c, int layer, int seq) {
  return &c->lens[(size_t)layer * (size_t)c->opts.max_seqs + (size_t)seq];
}

/* Records a failure for m40llm_last_error_message() and returns status. */
int m40llm_fail(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* IEEE binary16 conversions, round-to-nearest-even (what CUDA's __float2half_rn does). */
uint16_t m40llm_f32_to_f16(float f);
float m40llm_f16_to_f32(uint16_t h);

/* ---- CPU backend ---- */
int m40llm_cpu_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                      const void *v, int n_tokens, int src_is_f32);
void m40llm_cpu_read(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                     int seq, int pos, int n_tokens);
void m40llm_cpu_fork(const m40llm_kvcache *c, int dst_seq, int src_seq);
void m40llm_cpu_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, int n_seqs,
                          const float *q, float *out, float scale);

/* ---- CUDA backend (c/src/no_cuda.c answers M40LLM_ERR_NO_DEVICE when built without it) ---- */
enum { M40LLM_COPY_H2D, M40LLM_COPY_D2H, M40LLM_COPY_D2D };
int m40llm_cuda_count(int *out_count);
int m40llm_cuda_init(m40llm_context *ctx, int device, void *user_stream);
void m40llm_cuda_fini(m40llm_context *ctx);
int m40llm_cuda_synchronize(m40llm_context *ctx);
void *m40llm_cuda_stream(const m40llm_context *ctx);
int m40llm_cuda_device_info(m40llm_device_info *out, const m40llm_context *ctx);
int m40llm_cuda_malloc(void **out, m40llm_context *ctx, size_t bytes);
int m40llm_cuda_free(m40llm_context *ctx, void *ptr);
int m40llm_cuda_memcpy(m40llm_context *ctx, void *dst, const void *src, size_t bytes, int kind);
int m40llm_cuda_memset(m40llm_context *ctx, void *dst, int value, size_t bytes);
/* Grows the context's attention scratch so calls on this cache never allocate. */
int m40llm_cuda_reserve_for(m40llm_kvcache *c);
int m40llm_cuda_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                       const void *v, int n_tokens, int src_is_f32);
int m40llm_cuda_read(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                     int seq, int pos, int n_tokens);
int m40llm_cuda_fork(const m40llm_kvcache *c, int dst_seq, int src_seq);
/* n_seqs <= M40LLM_PLAN_MAX_ITEMS; lens[i] is the length of seq_ids[i] in this layer. */
int m40llm_cuda_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                          const int32_t *lens, int n_seqs, const float *q, float *out,
                          float scale);

#ifdef __cplusplus
}
#endif

#endif
