// Appending K/V rows: FP32 -> FP16 rounding (round-to-nearest-even) or a plain FP16 copy, from
// the caller's [token][kv_head][dim] rows into the cache's [kv_head][pos][dim] layout.
#include "common.cuh"

namespace {

__device__ __forceinline__ __half to_half(float x) { return __float2half_rn(x); }
__device__ __forceinline__ __half to_half(__half x) { return x; }

template <typename T>
__global__ void append_kernel(const T *__restrict__ k, const T *__restrict__ v,
                              __half *__restrict__ cache_k, __half *__restrict__ cache_v,
                              size_t first, size_t head_stride, size_t n, int n_kv_heads,
                              int head_dim) {
  allow_dependent_launch();
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t d = i % head_dim;
    const size_t th = i / head_dim;
    const size_t dst = first + (th % n_kv_heads) * head_stride + (th / n_kv_heads) * head_dim + d;
    cache_k[dst] = to_half(k[i]);
    cache_v[dst] = to_half(v[i]);
  }
}

}  // namespace

extern "C" int m40llm_cuda_append(const m40llm_kvcache *c, int layer, int seq, int pos,
                                  const void *k, const void *v, int n_tokens, int src_is_f32) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const size_t n = (size_t)n_tokens * o->n_kv_heads * o->head_dim;
  const size_t first = m40llm_kv_offset(o, layer, seq, 0, pos);
  const size_t head_stride = (size_t)o->max_seq_len * o->head_dim;
  const int threads = 256;
  const unsigned blocks = (unsigned)((n + threads - 1) / threads < 4096 ? (n + threads - 1) / threads : 4096);
  __half *ck = reinterpret_cast<__half *>(c->k);
  __half *cv = reinterpret_cast<__half *>(c->v);
  cudaStream_t s = c->ctx->cuda->stream;
  if (src_is_f32) {
    append_kernel<float><<<blocks, threads, 0, s>>>(static_cast<const float *>(k),
                                                    static_cast<const float *>(v), ck, cv, first,
                                                    head_stride, n, o->n_kv_heads, o->head_dim);
  } else {
    append_kernel<__half><<<blocks, threads, 0, s>>>(static_cast<const __half *>(k),
                                                     static_cast<const __half *>(v), ck, cv,
                                                     first, head_stride, n, o->n_kv_heads,
                                                     o->head_dim);
  }
  M40LLM_CUDA_CHECK_LAUNCH("append_kernel");
  return M40LLM_OK;
}
