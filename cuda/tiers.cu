// Tiered caches on CUDA (m40llm_kvcache_options.n_tiers > 0; the bookkeeping is the front
// end's, c/src/tiers.c): the row ops that write a tier's rows. (Their decode attention:
// attention_tiers.cu.)
#include "backend_cuda.h"
#include "kv_format.cuh"
#include "rotation.cuh"

namespace {

constexpr int kTierWarps = 4;
constexpr int kTierThreads = kTierWarps * 32;

// Row e (the element of its first dim) of a tensor in format KV, dims lane * 8 .. + 8 as FP32
// (code x scale + min, one FMA: the CPU backend's decode).
template <typename KV>
__device__ __forceinline__ void decode8(const KvPlanes &t, size_t e, float (&x)[8]) {
  const auto raw = KV::template load<8>(t, KV::at(t, e), 0);
  float f[8];
  KV::template widen<8>(raw, f);
  const float s = KV::template scale<8>(raw), m = KV::template min<8>(raw);
#pragma unroll
  for (int j = 0; j < 8; j++) x[j] = fmaf(f[j], s, m);
}

__device__ void decode_row(int format, const KvPlanes &t, size_t e, float (&x)[8]) {
  switch (format) {
    case M40LLM_KV_Q8: decode8<KvQ8>(t, e, x); break;
    case M40LLM_KV_Q4: decode8<KvQ4>(t, e, x); break;
    case M40LLM_KV_Q3: decode8<KvQ3>(t, e, x); break;
    default: decode8<KvQ2>(t, e, x); break;
  }
}

// x (the row in shared memory) encoded a group at a time, a lane an element.
__device__ void encode_row(int format, const KvMutPlanes &t, size_t e, const float *x, int D,
                           int lane) {
  for (int g = 0; g < D; g += 32) switch (format) {
      case M40LLM_KV_Q8: KvQ8::encode_lane(t, e + g, x[g + lane], lane); break;
      case M40LLM_KV_Q4: KvQ4::encode_lane(t, e + g, x[g + lane], lane); break;
      case M40LLM_KV_Q3: KvQ3::encode_lane(t, e + g, x[g + lane], lane); break;
      default: KvQ2::encode_lane(t, e + g, x[g + lane], lane); break;
    }
}

struct TierOps {
  m40llm_row_op op[M40LLM_TIER_OPS];
  uint8_t first[M40LLM_TIER_OPS];            // each chain's first op (backend.h's links)
  KvMutPlanes planes[M40LLM_MAX_TIERS][2];    // [tier][K, V]
  int32_t *map[M40LLM_MAX_TIERS];             // the tiers' slot maps (m40llm_row_op.pos)
  int row_bytes[M40LLM_MAX_TIERS][2][M40LLM_KV_PLANES];
  signed char format[M40LLM_MAX_TIERS][2];
  int rows[M40LLM_MAX_TIERS];
  __half *kept[2];                           // the FP16 slots of K and V
  const void *in[2];                         // appended rows (M40LLM_ROW_INPUT)
  __half *out[2];                            // read_f16's rows (M40LLM_ROW_OUTPUT), or null
  int n_ops, n_chains, layer, max_seqs, n_kv_heads, head_dim, n_sinks, window, slots, dtype;
  bool rotated[2];
  float rot_scale;

  __device__ size_t seq_head(int seq, int h) const {
    return ((size_t)layer * max_seqs + seq) * n_kv_heads + h;
  }
  __device__ size_t tier_elem(int t, int seq, int h, int slot) const {
    return (seq_head(seq, h) * rows[t] + slot) * head_dim;
  }
  __device__ size_t kept_elem(int seq, int h, int pos) const {
    return (seq_head(seq, h) * slots + m40llm_kv_protected_slot(n_sinks, window, pos)) * head_dim;
  }
};
static_assert(sizeof(TierOps) <= 4000, "TierOps travels as a kernel argument (4 KB on sm_52)");
static_assert(M40LLM_TIER_OPS <= 256, "a chain's first op is a byte");

__device__ float load_input(const void *p, int dtype, size_t i) {
  if (dtype == M40LLM_DTYPE_F16) return __half2float(static_cast<const __half *>(p)[i]);
  if (dtype == M40LLM_DTYPE_BF16)
    return __uint_as_float((unsigned)static_cast<const unsigned short *>(p)[i] << 16);
  return static_cast<const float *>(p)[i];
}

// One warp a (chain, K/V head, tensor), its ops in order: each row into shared memory as FP32
// in the stored frame, then out where it goes (a chain's next op may write the row this one
// read: the warp has read it by then; no op reads a row this launch writes, so the read-only
// path's loads are safe).
__global__ void __launch_bounds__(kTierThreads) tier_rows_kernel(const TierOps a) {
  __shared__ float stage[kTierWarps][256];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = a.head_dim;
  float *x = stage[warp];
  const int units = a.n_chains * a.n_kv_heads * 2;
  for (int u = blockIdx.x * kTierWarps + warp; u < units; u += gridDim.x * kTierWarps) {
    const int chain = u / (2 * a.n_kv_heads);
    const int end = chain + 1 < a.n_chains ? a.first[chain + 1] : a.n_ops;
    for (int k = a.first[chain]; k < end; k++) {
      const m40llm_row_op op = a.op[k];
      const int h = (u / 2) % a.n_kv_heads, kv = u % 2;
      if (op.to >= 0 && u % (2 * a.n_kv_heads) == 0 && lane == 0)
        a.map[op.to][((size_t)a.layer * a.max_seqs + op.seq) * a.rows[op.to] + op.dst] = op.pos;
      if (op.from >= 0 && op.from == op.to) {  // within a tier: the bytes
        for (int p = 0; p < M40LLM_KV_PLANES; p++) {
          const int rb = a.row_bytes[op.from][kv][p];
          uint8_t *base = static_cast<uint8_t *>(a.planes[op.from][kv].plane[p]);
          if (!base) continue;
          const size_t dst = a.tier_elem(op.from, op.seq, h, op.dst) / D * rb;
          const size_t src = a.tier_elem(op.from, op.seq, h, op.src) / D * rb;
          for (int b = lane; b < rb; b += 32) base[dst + b] = base[src + b];
        }
        __syncwarp();
        continue;
      }
      float v[8];  // dims lane + 32 e
      if (op.from == M40LLM_ROW_INPUT) {
        const size_t at = ((size_t)op.src * a.n_kv_heads + h) * D;
#pragma unroll
        for (int e = 0; e < 8; e++)
          v[e] = lane + 32 * e < D ? load_input(a.in[kv], a.dtype, at + lane + 32 * e) : 0.0f;
        if (a.rotated[kv]) warp_rotate(v, D, a.rot_scale);
#pragma unroll
        for (int e = 0; e < 8; e++)
          if (lane + 32 * e < D) x[lane + 32 * e] = v[e];
      } else if (op.from == M40LLM_ROW_KEPT) {
        const __half *s = a.kept[kv] + a.kept_elem(op.seq, h, op.src);
        for (int i = lane; i < D; i += 32) x[i] = __half2float(s[i]);
      } else if (lane < D / 8) {
        float f[8];
        KvPlanes t;
        for (int p = 0; p < M40LLM_KV_PLANES; p++) t.plane[p] = a.planes[op.from][kv].plane[p];
        decode_row(a.format[op.from][kv], t, a.tier_elem(op.from, op.seq, h, op.src) + lane * 8, f);
#pragma unroll
        for (int j = 0; j < 8; j++) x[lane * 8 + j] = f[j];
      }
      __syncwarp();
      if (op.to == M40LLM_ROW_OUTPUT) {
        if (a.out[kv]) {
#pragma unroll
          for (int e = 0; e < 8; e++) v[e] = lane + 32 * e < D ? x[lane + 32 * e] : 0.0f;
          if (a.rotated[kv]) warp_rotate(v, D, a.rot_scale);
          __half *o = a.out[kv] + ((size_t)op.dst * a.n_kv_heads + h) * D;
#pragma unroll
          for (int e = 0; e < 8; e++)
            if (lane + 32 * e < D) o[lane + 32 * e] = __float2half_rn(v[e]);
        }
      } else if (op.to == M40LLM_ROW_KEPT) {
        __half *s = a.kept[kv] + a.kept_elem(op.seq, h, op.dst);
        for (int i = lane; i < D; i += 32) s[i] = __float2half_rn(x[i]);
      } else {
        encode_row(a.format[op.to][kv], a.planes[op.to][kv], a.tier_elem(op.to, op.seq, h, op.dst),
                   x, D, lane);
      }
      __syncwarp();  // the row is read before the next one is staged
    }
  }
}

}  // namespace

int m40llm_cuda_tier_rows(const m40llm_kvcache *c, int layer, const m40llm_row_op *ops,
                          int n_ops, const uint8_t *links, int n_chains, const void *k_in,
                          const void *v_in, int dtype, uint16_t *k_out, uint16_t *v_out) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  TierOps a;
  memcpy(a.op, ops, (size_t)n_ops * sizeof *ops);
  for (int ch = 0, i = 0; ch < n_chains; i += links[ch++]) a.first[ch] = (uint8_t)i;
  a.n_chains = n_chains;
  for (int t = 0; t < c->n_tiers; t++) {
    const m40llm_kv_tensor *x[2] = {&c->tier_k[t], &c->tier_v[t]};
    for (int kv = 0; kv < 2; kv++) {
      a.planes[t][kv] = kv_mut_planes(*x[kv]);
      // a tier of no rows has no planes, nor a layout: no op names it
      a.format[t][kv] = x[kv]->layout.fmt ? (signed char)x[kv]->layout.fmt->format : 0;
      for (int p = 0; p < M40LLM_KV_PLANES; p++) a.row_bytes[t][kv][p] = (int)x[kv]->layout.row_bytes[p];
    }
    a.rows[t] = o->tiers[t].rows;
    a.map[t] = c->tier_map[t];
  }
  a.kept[0] = reinterpret_cast<__half *>(c->k.fp16);
  a.kept[1] = reinterpret_cast<__half *>(c->v.fp16);
  a.in[0] = k_in;
  a.in[1] = v_in;
  a.out[0] = reinterpret_cast<__half *>(k_out);
  a.out[1] = reinterpret_cast<__half *>(v_out);
  a.n_ops = n_ops;
  a.layer = layer;
  a.max_seqs = o->max_seqs;
  a.n_kv_heads = o->n_kv_heads;
  a.head_dim = o->head_dim;
  a.n_sinks = c->n_sinks;
  a.window = c->window;
  a.slots = c->slots;
  a.dtype = dtype;
  a.rotated[0] = c->k.rotated;
  a.rotated[1] = c->v.rotated;
  a.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));
  const int units = n_chains * o->n_kv_heads * 2;
  tier_rows_kernel<<<(units + kTierWarps - 1) / kTierWarps, kTierThreads, 0,
                     cuda_state(c->ctx)->stream>>>(a);
  M40LLM_CUDA_CHECK_LAUNCH("tier_rows_kernel");
  return M40LLM_OK;
}
