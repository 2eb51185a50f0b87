// Appending K/V rows: the caller's [token][kv_head][dim] FP32 or FP16 rows, encoded by the
// cache's K and V formats into its [kv_head][pos][dim] rows.
#include "backend_cuda.h"
#include "common.cuh"
#include "kv_format.cuh"
#include "tuning.cuh"

namespace {

// P: the cache's KvPair of formats. Each thread takes R elements of one token's K/V head row (R
// the larger of the formats' encode runs: head_dim is a multiple of it) and encodes them in the
// formats' runs.
template <typename P, typename T>
__global__ void append_kernel(const T *__restrict__ k, const T *__restrict__ v, KvMutPlanes ck,
                              KvMutPlanes cv, size_t first, size_t head_stride, size_t runs,
                              int n_kv_heads, int head_dim) {
  allow_dependent_launch();
  using KF = typename P::K;
  using VF = typename P::V;
  constexpr int R = KF::kEncodeRun > VF::kEncodeRun ? KF::kEncodeRun : VF::kEncodeRun;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < runs;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t e = i * R;  // the run's first element in the caller's rows
    const size_t d = e % head_dim;
    const size_t th = e / head_dim;
    const size_t dst = first + (th % n_kv_heads) * head_stride + (th / n_kv_heads) * head_dim + d;
    T xk[R], xv[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
      xk[j] = k[e + j];
      xv[j] = v[e + j];
    }
#pragma unroll
    for (int j = 0; j < R; j += KF::kEncodeRun)
      KF::encode(ck, dst + j, *reinterpret_cast<const T(*)[KF::kEncodeRun]>(xk + j));
#pragma unroll
    for (int j = 0; j < R; j += VF::kEncodeRun)
      VF::encode(cv, dst + j, *reinterpret_cast<const T(*)[VF::kEncodeRun]>(xv + j));
  }
}

}  // namespace

int m40llm_cuda_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                       const void *v, int n_tokens, int src_is_f32) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  return with_kv_pair(c->k.layout.fmt->format, c->v.layout.fmt->format, [&](auto pair) -> int {
    using P = decltype(pair);
    constexpr int R = P::K::kEncodeRun > P::V::kEncodeRun ? P::K::kEncodeRun : P::V::kEncodeRun;
    const size_t runs = (size_t)n_tokens * o->n_kv_heads * o->head_dim / R;
    const size_t first = m40llm_kv_row(o, layer, seq, 0, pos) * o->head_dim;
    const size_t head_stride = (size_t)o->max_seq_len * o->head_dim;
    const size_t want = (runs + kAppendThreads - 1) / kAppendThreads;
    const unsigned blocks = (unsigned)(want < kAppendMaxBlocks ? want : kAppendMaxBlocks);
    const KvMutPlanes ck = kv_mut_planes(c->k), cv = kv_mut_planes(c->v);
    cudaStream_t s = cuda_state(c->ctx)->stream;
    if (src_is_f32)
      append_kernel<P, float><<<blocks, kAppendThreads, 0, s>>>(
          static_cast<const float *>(k), static_cast<const float *>(v), ck, cv, first,
          head_stride, runs, o->n_kv_heads, o->head_dim);
    else
      append_kernel<P, __half><<<blocks, kAppendThreads, 0, s>>>(
          static_cast<const __half *>(k), static_cast<const __half *>(v), ck, cv, first,
          head_stride, runs, o->n_kv_heads, o->head_dim);
    M40LLM_CUDA_CHECK_LAUNCH("append_kernel");
    return M40LLM_OK;
  });
}
