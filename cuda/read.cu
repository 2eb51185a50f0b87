// Reading a quantized tensor's rows out as FP16 (F16 rows are copied as they are, in
// backend.cu): one warp a (token, K/V head) row, as attention reads it (a protected position's
// FP16 copy, else the codes decoded through the format, 8 elements a lane), staged in shared
// memory as FP32, rotated back where the tensor is rotated (the CPU backend's FP32 operations),
// and rounded to FP16 into the caller's [token][kv_head][dim] rows.
#include "backend_cuda.h"
#include "common.cuh"
#include "kv_format.cuh"
#include "rotation.cuh"
#include "tuning.cuh"

namespace {

constexpr int kReadWarps = kAppendThreads / 32;

struct ReadRows {
  KvPlanes t;
  const __half *slots;  // the tensor's FP16 slots, or null
  SeqRows at;
  int window_begin;  // protected positions: below at.n_sinks, and from here
  bool rotated;
};

template <typename KV>
__global__ void __launch_bounds__(kAppendThreads)
    read_kernel(const ReadRows r, __half *__restrict__ out) {
  __shared__ float stage[kReadWarps][256];
  const SeqRows &at = r.at;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = at.head_dim;
  float *x = stage[warp];
  for (int row = blockIdx.x * kReadWarps + warp; row < at.n_tokens * at.n_kv_heads;
       row += gridDim.x * kReadWarps) {
    const int h = row % at.n_kv_heads, p = at.pos + row / at.n_kv_heads;
    if (r.slots && (p < at.n_sinks || p >= r.window_begin)) {
      const __half *s = r.slots + at.slot(h, p);
      for (int i = lane; i < D; i += 32) x[i] = __half2float(s[i]);
    } else if (lane < D / 8) {
      const size_t e = at.row(h, p) + lane * 8;
      const auto raw = KV::template load<8>(r.t, KV::at(r.t, e), 0);
      float f[8];
      KV::template widen<8>(raw, f);
      const float s = KV::template scale<8>(raw), m = KV::template min<8>(raw);
#pragma unroll
      for (int j = 0; j < 8; j++) x[lane * 8 + j] = fmaf(f[j], s, m);
    }
    __syncwarp();
    float v[8];  // dims lane + 32 e (head_dim <= 256)
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = lane + 32 * e < D ? x[lane + 32 * e] : 0.0f;
    if (r.rotated) warp_rotate(v, D, at.rot_scale);
#pragma unroll
    for (int e = 0; e < 8; e++)
      if (lane + 32 * e < D) out[(size_t)row * D + lane + 32 * e] = __float2half_rn(v[e]);
    __syncwarp();  // the row is read before the next one is staged
  }
}

}  // namespace

int m40llm_cuda_read_decoded(const m40llm_kvcache *c, const m40llm_kv_tensor &t, uint16_t *out,
                             int layer, int seq, int pos, int n_tokens) {
  const m40llm_kvcache_options *o = &c->opts;
  return with_kv_format(t.layout.fmt->format, [&](auto kv) -> int {
    using KV = decltype(kv);
    ReadRows r;
    r.t = kv_planes_at(t, 0);
    r.slots = reinterpret_cast<const __half *>(t.fp16);
    r.at = seq_rows(c, layer, seq, pos, n_tokens);
    r.window_begin = m40llm_window_begin(c, layer, seq);
    r.rotated = t.rotated;
    const size_t want = ((size_t)n_tokens * o->n_kv_heads + kReadWarps - 1) / kReadWarps;
    const unsigned blocks = (unsigned)(want < kAppendMaxBlocks ? want : kAppendMaxBlocks);
    read_kernel<KV><<<blocks, kAppendThreads, 0, cuda_state(c->ctx)->stream>>>(
        r, reinterpret_cast<__half *>(out));
    M40LLM_CUDA_CHECK_LAUNCH("read_kernel");
    return M40LLM_OK;
  });
}
