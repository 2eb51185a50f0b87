// The CUDA backend's host side: devices, the context's stream, memory, and the copies behind
// read and fork. Kernels live in append.cu, attention.cu and attention_mma.cu.
#include <stdio.h>
#include <string.h>

#include <new>

#include "common.cuh"

int m40llm_cuda_error(cudaError_t err, const char *what) {
  (void)cudaGetLastError();  // clears the error unless it is sticky
  const int status =
      err == cudaErrorMemoryAllocation ? M40LLM_ERR_OUT_OF_MEMORY : M40LLM_ERR_CUDA;
  return m40llm_fail(status, "%s failed: %s (%s)", what, cudaGetErrorName(err),
                     cudaGetErrorString(err));
}

extern "C" int m40llm_cuda_count(int *out_count) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: zero devices, not an error
    n = 0;
  }
  *out_count = n;
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_init(m40llm_context *ctx, int device, void *user_stream) {
  m40llm_cuda_state *st = new (std::nothrow) m40llm_cuda_state();
  if (!st) return m40llm_fail(M40LLM_ERR_OUT_OF_MEMORY, "allocating the CUDA state");
  int rc = M40LLM_OK;
  cudaDeviceProp prop;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
  if (err == cudaSuccess && !user_stream) err = cudaStreamCreate(&st->stream);
  if (err != cudaSuccess) {
    rc = m40llm_cuda_error(err, "initialising the CUDA device");
    delete st;
    return rc;
  }
  if (user_stream) st->stream = static_cast<cudaStream_t>(user_stream);
  st->owns_stream = user_stream == nullptr;
  st->sm_count = prop.multiProcessorCount;
  st->cc_major = prop.major;
  st->smem_per_sm = prop.sharedMemPerMultiprocessor;
  st->smem_per_block = prop.sharedMemPerBlockOptin;
  st->smem_reserved_per_block = prop.reservedSharedMemPerBlock;
  ctx->cuda = st;
  return M40LLM_OK;
}

extern "C" void m40llm_cuda_fini(m40llm_context *ctx) {
  m40llm_cuda_state *st = ctx->cuda;
  if (!st) return;
  // Teardown cannot report failures; a broken context still releases what it can.
  (void)cudaSetDevice(ctx->device);
  (void)cudaStreamSynchronize(st->stream);
  (void)cudaFree(st->workspace);
  if (st->owns_stream) (void)cudaStreamDestroy(st->stream);
  (void)cudaGetLastError();
  delete st;
  ctx->cuda = nullptr;
}

extern "C" int m40llm_cuda_synchronize(m40llm_context *ctx) {
  M40LLM_CUDA_ENTER(ctx);
  M40LLM_CUDA_TRY(cudaStreamSynchronize(ctx->cuda->stream));
  return M40LLM_OK;
}

extern "C" void *m40llm_cuda_stream(const m40llm_context *ctx) { return ctx->cuda->stream; }

extern "C" int m40llm_cuda_device_info(m40llm_device_info *out, const m40llm_context *ctx) {
  M40LLM_CUDA_ENTER(ctx);
  cudaDeviceProp prop;
  M40LLM_CUDA_TRY(cudaGetDeviceProperties(&prop, ctx->device));
  size_t free_bytes = 0, total_bytes = 0;
  M40LLM_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  m40llm_device_info info = M40LLM_DEVICE_INFO_INIT;
  info.backend = M40LLM_BACKEND_CUDA;
  info.device = ctx->device;
  snprintf(info.name, sizeof info.name, "%s", prop.name);
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.total_memory = total_bytes;
  info.free_memory = free_bytes;
  *out = info;
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_malloc(void **out, m40llm_context *ctx, size_t bytes) {
  M40LLM_CUDA_ENTER(ctx);
  void *p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    char what[64];
    snprintf(what, sizeof what, "cudaMalloc(%zu bytes)", bytes);
    return m40llm_cuda_error(err, what);
  }
  *out = p;
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_free(m40llm_context *ctx, void *ptr) {
  M40LLM_CUDA_ENTER(ctx);
  M40LLM_CUDA_TRY(cudaStreamSynchronize(ctx->cuda->stream));
  M40LLM_CUDA_TRY(cudaFree(ptr));
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_memcpy(m40llm_context *ctx, void *dst, const void *src, size_t bytes,
                                  int kind) {
  M40LLM_CUDA_ENTER(ctx);
  cudaStream_t s = ctx->cuda->stream;
  const cudaMemcpyKind k = kind == M40LLM_COPY_H2D   ? cudaMemcpyHostToDevice
                           : kind == M40LLM_COPY_D2H ? cudaMemcpyDeviceToHost
                                                     : cudaMemcpyDeviceToDevice;
  M40LLM_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, k, s));
  // Host copies return when done: the caller may reuse or read its host buffer at once.
  if (kind != M40LLM_COPY_D2D) M40LLM_CUDA_TRY(cudaStreamSynchronize(s));
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_memset(m40llm_context *ctx, void *dst, int value, size_t bytes) {
  M40LLM_CUDA_ENTER(ctx);
  M40LLM_CUDA_TRY(cudaMemsetAsync(dst, value, bytes, ctx->cuda->stream));
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_read(const m40llm_kvcache *c, uint16_t *k_out, uint16_t *v_out,
                                int layer, int seq, int pos, int n_tokens) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const size_t row = (size_t)o->head_dim * sizeof(uint16_t);
  // Each K/V head's rows are contiguous in the cache and interleaved by head in the output.
  for (int h = 0; h < o->n_kv_heads; h++) {
    const size_t src = m40llm_kv_offset(o, layer, seq, h, pos);
    const size_t dst = (size_t)h * o->head_dim;
    if (k_out)
      M40LLM_CUDA_TRY(cudaMemcpy2DAsync(k_out + dst, row * o->n_kv_heads, c->k + src, row, row,
                                        n_tokens, cudaMemcpyDeviceToDevice, c->ctx->cuda->stream));
    if (v_out)
      M40LLM_CUDA_TRY(cudaMemcpy2DAsync(v_out + dst, row * o->n_kv_heads, c->v + src, row, row,
                                        n_tokens, cudaMemcpyDeviceToDevice, c->ctx->cuda->stream));
  }
  return M40LLM_OK;
}

extern "C" int m40llm_cuda_fork(const m40llm_kvcache *c, int dst_seq, int src_seq) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const size_t pitch = (size_t)o->max_seq_len * o->head_dim * sizeof(uint16_t);
  for (int l = 0; l < o->n_layers; l++) {
    const size_t width = (size_t)*m40llm_len_slot(c, l, src_seq) * o->head_dim * sizeof(uint16_t);
    if (width == 0) continue;
    const size_t src = m40llm_kv_offset(o, l, src_seq, 0, 0);
    const size_t dst = m40llm_kv_offset(o, l, dst_seq, 0, 0);
    M40LLM_CUDA_TRY(cudaMemcpy2DAsync(c->k + dst, pitch, c->k + src, pitch, width, o->n_kv_heads,
                                      cudaMemcpyDeviceToDevice, c->ctx->cuda->stream));
    M40LLM_CUDA_TRY(cudaMemcpy2DAsync(c->v + dst, pitch, c->v + src, pitch, width, o->n_kv_heads,
                                      cudaMemcpyDeviceToDevice, c->ctx->cuda->stream));
  }
  return M40LLM_OK;
}
