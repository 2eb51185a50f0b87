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
  const __half *slots;  // this layer's and sequence's first FP16 slot, or null
  size_t first, head_stride, slot_head_stride;
  int pos, n_tokens, n_kv_heads, head_dim;
  int n_sinks, window, window_begin;  // protected positions: < n_sinks, >= window_begin
  bool rotated;
  float rot_scale;
};

template <typename KV>
__global__ void __launch_bounds__(kAppendThreads)
    read_kernel(const ReadRows r, __half *__restrict__ out) {
  __shared__ float stage[kReadWarps][256];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = r.head_dim;
  float *x = stage[warp];
  for (int row = blockIdx.x * kReadWarps + warp; row < r.n_tokens * r.n_kv_heads;
       row += gridDim.x * kReadWarps) {
    const int t = row / r.n_kv_heads, h = row % r.n_kv_heads, p = r.pos + t;
    if (r.slots && (p < r.n_sinks || p >= r.window_begin)) {
      const __half *s = r.slots + (size_t)h * r.slot_head_stride +
                        (size_t)m40llm_kv_protected_slot(r.n_sinks, r.window, p) * D;
      for (int i = lane; i < D; i += 32) x[i] = __half2float(s[i]);
    } else if (lane < D / 8) {
      const size_t e = r.first + (size_t)h * r.head_stride + (size_t)p * D + lane * 8;
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
    if (r.rotated) warp_rotate(v, D, r.rot_scale);
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
    r.slots = t.fp16 ? reinterpret_cast<const __half *>(t.fp16) +
                           m40llm_kv_protected_row(o, c->slots, layer, seq, 0, 0) * o->head_dim
                     : nullptr;
    r.first = m40llm_kv_row(o, layer, seq, 0, 0) * o->head_dim;
    r.head_stride = (size_t)o->max_seq_len * o->head_dim;
    r.slot_head_stride = (size_t)c->slots * o->head_dim;
    r.pos = pos;
    r.n_tokens = n_tokens;
    r.n_kv_heads = o->n_kv_heads;
    r.head_dim = o->head_dim;
    r.n_sinks = c->n_sinks;
    r.window = c->window;
    r.window_begin = m40llm_window_begin(c, layer, seq);
    r.rotated = t.rotated;
    r.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));
    const size_t want = ((size_t)n_tokens * o->n_kv_heads + kReadWarps - 1) / kReadWarps;
    const unsigned blocks = (unsigned)(want < kAppendMaxBlocks ? want : kAppendMaxBlocks);
    read_kernel<KV><<<blocks, kAppendThreads, 0, cuda_state(c->ctx)->stream>>>(
        r, reinterpret_cast<__half *>(out));
    M40LLM_CUDA_CHECK_LAUNCH("read_kernel");
    return M40LLM_OK;
  });
}
