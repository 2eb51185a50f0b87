// Appending K/V rows: the caller's [token][kv_head][dim] FP32 or FP16 rows, encoded by the
// cache's K and V formats into its [kv_head][pos][dim] rows.
#include "backend_cuda.h"
#include "common.cuh"
#include "kv_format.cuh"
#include "rotation.cuh"
#include "tuning.cuh"

namespace {

// An F16 cache's rows, element-parallel. P: the cache's KvPair of formats. Each thread takes R elements of one token's K/V head row (R
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

// A quantized cache's rows: one warp a (token, K/V head) row, rotated in registers where the
// tensor is (the same FP32 operations as the CPU backend), staged in shared memory as FP32,
// then encoded in groups, one lane a group; a protected position's FP16 copy goes to
// its slot. P: the cache's KvPair of formats (quantized ones: their encode run is the group).
constexpr int kAppendRowWarps = kAppendThreads / 32;

struct AppendRows {
  KvMutPlanes k, v;
  __half *k16, *v16;  // the FP16 slots, or null
  SeqRows at;
  bool rot_k, rot_v;
};

template <typename F, typename T>
__device__ __forceinline__ void append_row(float *x, const T *src, const KvMutPlanes &planes,
                                           __half *slot, size_t dst, bool rotate,
                                           const AppendRows &r, int lane) {
  const int D = r.at.head_dim;
  float v[8];  // dims lane + 32 e (head_dim <= 256)
#pragma unroll
  for (int e = 0; e < 8; e++) v[e] = lane + 32 * e < D ? (float)src[lane + 32 * e] : 0.0f;
  if (rotate) warp_rotate(v, D, r.at.rot_scale);
#pragma unroll
  for (int e = 0; e < 8; e++)
    if (lane + 32 * e < D) x[lane + 32 * e] = v[e];
  __syncwarp();
  for (int g = lane; g < D / F::kEncodeRun; g += 32) {
    float v[F::kEncodeRun];
#pragma unroll
    for (int i = 0; i < F::kEncodeRun; i++) v[i] = x[g * F::kEncodeRun + i];
    F::encode(planes, dst + (size_t)g * F::kEncodeRun, v);
  }
  if (slot)
    for (int i = lane; i < D; i += 32) slot[i] = __float2half_rn(x[i]);
  __syncwarp();  // the row is read before the next one is staged
}

template <typename P, typename T>
__global__ void __launch_bounds__(kAppendThreads)
    append_rows_kernel(const T *__restrict__ k, const T *__restrict__ v, const AppendRows r) {
  allow_dependent_launch();
  __shared__ float stage[kAppendRowWarps][2][256];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const SeqRows &at = r.at;
  for (int row = blockIdx.x * kAppendRowWarps + warp; row < at.n_tokens * at.n_kv_heads;
       row += gridDim.x * kAppendRowWarps) {
    const int h = row % at.n_kv_heads, p = at.pos + row / at.n_kv_heads;
    const size_t dst = at.row(h, p);
    // The positions kept in FP16: sinks, and the window as it stands after this append.
    const bool kept = r.k16 && (p < at.n_sinks || p >= at.pos + at.n_tokens - at.window);
    const size_t slot = kept ? at.slot(h, p) : 0;
    const size_t src = (size_t)row * at.head_dim;
    append_row<typename P::K>(stage[warp][0], k + src, r.k, kept ? r.k16 + slot : nullptr, dst,
                              r.rot_k, r, lane);
    append_row<typename P::V>(stage[warp][1], v + src, r.v, kept ? r.v16 + slot : nullptr, dst,
                              r.rot_v, r, lane);
  }
}

}  // namespace

namespace {

template <typename P>
int append_rows(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                const void *v, int n_tokens, int src_is_f32, P) {
  const m40llm_kvcache_options *o = &c->opts;
  AppendRows r;
  r.k = kv_mut_planes(c->k);
  r.v = kv_mut_planes(c->v);
  r.k16 = reinterpret_cast<__half *>(c->k.fp16);
  r.v16 = reinterpret_cast<__half *>(c->v.fp16);
  r.at = seq_rows(c, layer, seq, pos, n_tokens);
  r.rot_k = c->k.rotated;
  r.rot_v = c->v.rotated;
  const size_t want = ((size_t)n_tokens * o->n_kv_heads + kAppendRowWarps - 1) / kAppendRowWarps;
  const unsigned blocks = (unsigned)(want < kAppendMaxBlocks ? want : kAppendMaxBlocks);
  cudaStream_t s = cuda_state(c->ctx)->stream;
  if (src_is_f32)
    append_rows_kernel<P, float><<<blocks, kAppendThreads, 0, s>>>(
        static_cast<const float *>(k), static_cast<const float *>(v), r);
  else
    append_rows_kernel<P, __half><<<blocks, kAppendThreads, 0, s>>>(
        static_cast<const __half *>(k), static_cast<const __half *>(v), r);
  M40LLM_CUDA_CHECK_LAUNCH("append_rows_kernel");
  return M40LLM_OK;
}

}  // namespace

int m40llm_cuda_append(const m40llm_kvcache *c, int layer, int seq, int pos, const void *k,
                       const void *v, int n_tokens, int src_is_f32) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  return with_kv_pair(c->k.layout.fmt->format, c->v.layout.fmt->format, [&](auto pair) -> int {
    using P = decltype(pair);
    if constexpr (P::K::kScaled || P::V::kScaled) {
      return append_rows(c, layer, seq, pos, k, v, n_tokens, src_is_f32, P{});
    } else {
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
    }
  });
}
