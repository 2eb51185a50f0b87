// Reading K/V rows out as FP16 for a quantized format (F16 rows are copied as they are, in
// backend.cu): each thread decodes 8 elements of one token's K/V head row through the format
// and rounds them to FP16, into the caller's [token][kv_head][dim] rows.
#include "backend_cuda.h"
#include "common.cuh"
#include "kv_format.cuh"
#include "tuning.cuh"

namespace {

template <typename KV>
__global__ void read_kernel(KvPlanes t, __half *__restrict__ out, size_t first, size_t head_stride,
                            size_t chunks, int n_kv_heads, int head_dim) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < chunks;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t e = i * 8;  // the chunk's first element in the output rows
    const size_t d = e % head_dim;
    const size_t th = e / head_dim;
    const size_t src = first + (th % n_kv_heads) * head_stride + (th / n_kv_heads) * head_dim + d;
    const auto r = KV::template load<8>(t, KV::add(KV::at(t, 0), (ptrdiff_t)src), 0);
    float f[8];
    KV::template widen<8>(r, f);
    const float s = KV::template scale<8>(r), m = KV::template min<8>(r);
#pragma unroll
    for (int j = 0; j < 8; j++) out[e + j] = __float2half_rn(KV::kScaled ? fmaf(f[j], s, m) : f[j]);
  }
}

}  // namespace

int m40llm_cuda_read_decoded(const m40llm_kvcache *c, const m40llm_kv_tensor &t, uint16_t *out,
                             int layer, int seq, int pos, int n_tokens) {
  const m40llm_kvcache_options *o = &c->opts;
  return with_kv_format(t.layout.fmt->format, [&](auto kv) -> int {
    using KV = decltype(kv);
    const size_t chunks = (size_t)n_tokens * o->n_kv_heads * o->head_dim / 8;
    const size_t want = (chunks + kAppendThreads - 1) / kAppendThreads;
    const unsigned blocks = (unsigned)(want < kAppendMaxBlocks ? want : kAppendMaxBlocks);
    read_kernel<KV><<<blocks, kAppendThreads, 0, cuda_state(c->ctx)->stream>>>(
        kv_planes_at(t, 0), reinterpret_cast<__half *>(out),
        m40llm_kv_row(o, layer, seq, 0, pos) * o->head_dim, (size_t)o->max_seq_len * o->head_dim,
        chunks, o->n_kv_heads, o->head_dim);
    M40LLM_CUDA_CHECK_LAUNCH("read_kernel");
    return M40LLM_OK;
  });
}
