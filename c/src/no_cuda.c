/* The CUDA backend's entry points in a build without a CUDA toolkit: no device is ever
 * available, so the front end never reaches the others; they still answer cleanly. */
#include "internal.h"

#define NO_CUDA m40llm_fail(M40LLM_ERR_NO_DEVICE, "m40llm was built without CUDA")

int m40llm_cuda_count(int *out_count) {
  *out_count = 0;
  return M40LLM_OK;
}
int m40llm_cuda_init(m40llm_context *ctx, int device, void *user_stream) {
  (void)ctx, (void)device, (void)user_stream;
  return NO_CUDA;
}
void m40llm_cuda_fini(m40llm_context *ctx) { (void)ctx; }
int m40llm_cuda_synchronize(m40llm_context *ctx) {
  (void)ctx;
  return NO_CUDA;
}
void *m40llm_cuda_stream(const m40llm_context *ctx) {
  (void)ctx;
  return NULL;
}
int m40llm_cuda_device_info(m40llm_device_info *out, const m40llm_context *ctx) {
  (void)out, (void)ctx;
  return NO_CUDA;
}
int m40llm_cuda_malloc(void **out, m40llm_context *ctx, size_t bytes) {
  (void)out, (void)ctx, (void)bytes;
  return NO_CUDA;
}
int m40llm_cuda_free(m40llm_context *ctx, void *ptr) {
  (void)ctx, (void)ptr;
  return NO_CUDA;
}
int m40llm_cuda_memcpy(m40llm_context *ctx, void *dst, const void *src, size_t bytes, int kind) {
  (void)ctx, (void)dst, (void)src, (void)bytes, (void)kind;
  return NO_CUDA;
}
int m40llm_cuda_memset(m40llm_context *ctx, void *dst, int value, size_t bytes) {
  (void)ctx, (void)dst, (void)value, (void)bytes;
  return NO_CUDA;
}
int m40llm_cuda_reserve_for(m40llm_kvcache *c) {
  (void)c;
  return NO_CUDA;
}
int m40llm_cuda_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                       const void *v, int n_tokens, int src_is_f32) {
  (void)c, (void)layer, (void)seq, (void)pos, (void)k, (void)v, (void)n_tokens, (void)src_is_f32;
  return NO_CUDA;
}
int m40llm_cuda_read(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out, int layer,
                     int seq, int pos, int n_tokens) {
  (void)c, (void)k_out, (void)v_out, (void)layer, (void)seq, (void)pos, (void)n_tokens;
  return NO_CUDA;
}
int m40llm_cuda_fork(const m40llm_kvcache *c, int dst_seq, int src_seq) {
  (void)c, (void)dst_seq, (void)src_seq;
  return NO_CUDA;
}
int m40llm_cuda_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                          const int32_t *lens, int n_seqs, const float *q, float *out,
                          float scale) {
  (void)c, (void)layer, (void)seq_ids, (void)lens, (void)n_seqs, (void)q, (void)out, (void)scale;
  return NO_CUDA;
}
