// Tiered caches on CUDA (m40llm_kvcache_options.n_tiers > 0; the bookkeeping is the front
// end's, c/src/tiers.c): the row ops that write a tier's rows, and decode attention over the
// tiers. Attention runs one launch per part of a cache (its FP16 slots, then each tier, whose
// formats are the kernel's template arguments), each block a split of one (sequence, part)
// writing its (max, sum, output) partial, and one combine that merges every part and split of
// a sequence. A first version: one warp a K/V row, lanes over dims, not yet tuned like the
// uniform caches' kernels.
#include "attention.cuh"
#include "backend_cuda.h"

namespace {

constexpr int kTierWarps = 4;
constexpr int kTierThreads = kTierWarps * 32;
constexpr int kTierHeads = 8;     // query heads a block takes (a tile of a K/V head's group)
constexpr int kTierItems = 64;    // sequences a launch takes: their runs travel as an argument
constexpr int kTierMaxSplits = 64;    // blocks a (sequence, part) at most
constexpr int kTierPartialRows = 2048; // partials a launch at most: the workspace's room

// ---- Row ops ----

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
  KvMutPlanes planes[M40LLM_MAX_TIERS][2];    // [tier][K, V]
  int row_bytes[M40LLM_MAX_TIERS][2][M40LLM_KV_PLANES];
  signed char format[M40LLM_MAX_TIERS][2];
  int rows[M40LLM_MAX_TIERS];
  __half *kept[2];                           // the FP16 slots of K and V
  const void *in[2];                         // appended rows (M40LLM_ROW_INPUT)
  __half *out[2];                            // read_f16's rows (M40LLM_ROW_OUTPUT), or null
  int n_ops, layer, max_seqs, n_kv_heads, head_dim, n_sinks, window, slots, dtype;
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

__device__ float load_input(const void *p, int dtype, size_t i) {
  if (dtype == M40LLM_DTYPE_F16) return __half2float(static_cast<const __half *>(p)[i]);
  if (dtype == M40LLM_DTYPE_BF16)
    return __uint_as_float((unsigned)static_cast<const unsigned short *>(p)[i] << 16);
  return static_cast<const float *>(p)[i];
}

// One warp a (op, K/V head, tensor): the row into shared memory as FP32 in the stored frame,
// then out where it goes.
__global__ void __launch_bounds__(kTierThreads) tier_rows_kernel(const TierOps a) {
  __shared__ float stage[kTierWarps][256];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = a.head_dim;
  float *x = stage[warp];
  const int units = a.n_ops * a.n_kv_heads * 2;
  for (int u = blockIdx.x * kTierWarps + warp; u < units; u += gridDim.x * kTierWarps) {
    const m40llm_row_op op = a.op[u / (2 * a.n_kv_heads)];
    const int h = (u / 2) % a.n_kv_heads, kv = u % 2;
    if (op.from >= 0 && op.from == op.to) {  // within a tier: the bytes
      for (int p = 0; p < M40LLM_KV_PLANES; p++) {
        const int rb = a.row_bytes[op.from][kv][p];
        uint8_t *base = static_cast<uint8_t *>(a.planes[op.from][kv].plane[p]);
        if (!base) continue;
        const size_t dst = a.tier_elem(op.from, op.seq, h, op.dst) / D * rb;
        const size_t src = a.tier_elem(op.from, op.seq, h, op.src) / D * rb;
        for (int b = lane; b < rb; b += 32) base[dst + b] = base[src + b];
      }
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

// ---- Attention ----

struct TierAttn {
  KvPlanes k, v;     // the part's planes: a tier's, or the FP16 slots (as F16 planes)
  const float *q;    // [item][n_heads][head_dim] of this launch's items
  float *part_o, *part_m, *part_l;
  int layer, max_seqs, n_kv_heads, n_heads, group, head_tiles, head_dim;
  int rows;          // rows a (layer, seq, K/V head) of the part's planes
  int part, n_parts, splits, n_items;
  float q_scale;     // scale x log2(e)
  bool rot_k;
  float rot_scale;
  int seq[kTierItems];
  int first[kTierItems][3], count[kTierItems][3];  // each item's runs of rows in the part
};

// The element of row i (of the item's rows in this part, its runs in order) of K/V head kvh.
__device__ __forceinline__ size_t part_row(const TierAttn &a, int item, size_t base, int i) {
  int r = 0;
  while (r < 2 && i >= a.count[item][r]) i -= a.count[item][r++];
  return (base + a.first[item][r] + i) * a.head_dim;
}

// A block per (item, K/V head and tile of its query heads, split of the item's rows in this
// part). A warp takes 32 rows at a time: for the scores a lane a row (its K decoded 8 dims at
// a time, q broadcast from shared memory: 32 rows' loads in flight, no shuffle per row), one
// online-softmax step a head for the 32, then for the output the lanes over dims, each row's
// V and weights taken in turn. The warps' states are merged into the split's partial.
template <typename P>
__global__ void __launch_bounds__(kTierThreads) tier_attn_kernel(const TierAttn a) {
  __shared__ float qs[kTierHeads][256];
  __shared__ float ms[kTierWarps][kTierHeads], ls[kTierWarps][kTierHeads];
  __shared__ float os[kTierWarps][kTierHeads][256];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = a.head_dim;
  const int item = blockIdx.x, kvh = blockIdx.y / a.head_tiles;
  const int h0 = kvh * a.group + (blockIdx.y % a.head_tiles) * kTierHeads;
  const int nh = min(kTierHeads, (kvh + 1) * a.group - h0);
  for (int h = warp; h < nh; h += kTierWarps) {  // q in K's frame, scaled for exp2
    float v[8];
    const float *qh = a.q + ((size_t)item * a.n_heads + h0 + h) * D;
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] = lane + 32 * e < D ? qh[lane + 32 * e] : 0.0f;
    if (a.rot_k) warp_rotate(v, D, a.rot_scale);
#pragma unroll
    for (int e = 0; e < 8; e++)
      if (lane + 32 * e < D) qs[h][lane + 32 * e] = v[e] * a.q_scale;
  }
  __syncthreads();
  const int total = a.count[item][0] + a.count[item][1] + a.count[item][2];
  const int chunk = (total + a.splits - 1) / a.splits;
  const int begin = min(total, (int)blockIdx.z * chunk), end = min(total, begin + chunk);
  const size_t base = (((size_t)a.layer * a.max_seqs + a.seq[item]) * a.n_kv_heads + kvh) * a.rows;
  SoftmaxState st[kTierHeads];
  float o[kTierHeads][8];
#pragma unroll
  for (int h = 0; h < kTierHeads; h++) {
    st[h] = SoftmaxState::empty();
#pragma unroll
    for (int j = 0; j < 8; j++) o[h][j] = 0.0f;
  }
  const bool dims = lane < D / 8;
  for (int i0 = begin + warp * 32; i0 < end; i0 += kTierWarps * 32) {
    const int i = i0 + lane, n = min(32, end - i0);
    const size_t e = i < end ? part_row(a, item, base, i) : 0;
    float s[kTierHeads];
#pragma unroll
    for (int h = 0; h < kTierHeads; h++) s[h] = 0.0f;
    if (i < end)
      for (int c = 0; c < D; c += 8) {
        float x[8];
        decode8<typename P::K>(a.k, e + c, x);
#pragma unroll
        for (int h = 0; h < kTierHeads; h++)
          if (h < nh)
#pragma unroll
            for (int t = 0; t < 8; t++) s[h] = fmaf(qs[h][c + t], x[t], s[h]);
      }
    float w[kTierHeads];
#pragma unroll
    for (int h = 0; h < kTierHeads; h++) {
      const float x = i < end ? s[h] : -INFINITY;
      float mx = x;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float alpha = st[h].raise(mx);
      w[h] = x == -INFINITY ? 0.0f : st[h].weight(x);
      float sum = w[h];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      st[h].l += sum;
#pragma unroll
      for (int t = 0; t < 8; t++) o[h][t] *= alpha;
    }
    for (int j = 0; j < n; j++) {
      const size_t ej = __shfl_sync(0xffffffffu, e, j);
      float y[8] = {};
      if (dims) decode8<typename P::V>(a.v, ej + lane * 8, y);
#pragma unroll
      for (int h = 0; h < kTierHeads; h++) {
        const float wj = __shfl_sync(0xffffffffu, w[h], j);
#pragma unroll
        for (int t = 0; t < 8; t++) o[h][t] = fmaf(wj, y[t], o[h][t]);
      }
    }
  }
  if (lane == 0)
#pragma unroll
    for (int h = 0; h < kTierHeads; h++) ms[warp][h] = st[h].m, ls[warp][h] = st[h].l;
  if (dims)
#pragma unroll
    for (int h = 0; h < kTierHeads; h++)
#pragma unroll
      for (int t = 0; t < 8; t++) os[warp][h][lane * 8 + t] = o[h][t];
  __syncthreads();
  const size_t row = ((size_t)item * a.n_parts + a.part) * a.splits + blockIdx.z;
  for (int hd = threadIdx.x; hd < nh * D; hd += kTierThreads) {
    const int h = hd / D, d = hd % D;
    float m = -INFINITY;
    for (int w = 0; w < kTierWarps; w++) m = fmaxf(m, ms[w][h]);
    SoftmaxState s = SoftmaxState::at_max(m);
    float acc = 0.0f;
    for (int w = 0; w < kTierWarps; w++) acc = fmaf(s.add_partial(ms[w][h], ls[w][h]), os[w][h][d], acc);
    const size_t p = row * a.n_heads + h0 + h;
    a.part_o[p * D + d] = acc;
    if (d == 0) a.part_m[p] = s.m, a.part_l[p] = s.l;
  }
}

// A warp per (item, query head): every part's and split's partial merged, normalised, rotated
// back from V's frame.
__global__ void __launch_bounds__(kTierThreads) tier_combine_kernel(const TierAttn a, float *out,
                                                                    bool rot_v) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = a.head_dim;
  const int unit = blockIdx.x * kTierWarps + warp;
  if (unit >= a.n_items * a.n_heads) return;
  const int item = unit / a.n_heads, h = unit % a.n_heads, n = a.n_parts * a.splits;
  const size_t first = (size_t)item * n;
  float m = -INFINITY;
  for (int r = 0; r < n; r++) m = fmaxf(m, a.part_m[(first + r) * a.n_heads + h]);
  SoftmaxState s = SoftmaxState::at_max(m);
  float v[8] = {};
  for (int r = 0; r < n; r++) {
    const size_t p = (first + r) * a.n_heads + h;
    const float w = s.add_partial(a.part_m[p], a.part_l[p]);
#pragma unroll
    for (int e = 0; e < 8; e++)
      if (lane + 32 * e < D) v[e] = fmaf(w, a.part_o[p * D + lane + 32 * e], v[e]);
  }
  const float inv = s.inv_sum();
#pragma unroll
  for (int e = 0; e < 8; e++) v[e] *= inv;
  if (rot_v) warp_rotate(v, D, a.rot_scale);
  float *o = out + ((size_t)item * a.n_heads + h) * D;
#pragma unroll
  for (int e = 0; e < 8; e++)
    if (lane + 32 * e < D) o[lane + 32 * e] = v[e];
}

// Calls f(KvPair<K, V>{}) for a tier's formats (K Q8 or Q4; V Q8, Q4, Q3 or Q2: the front end's
// rule for tiers).
template <typename F>
int with_tier_pair(int k, int v, F &&f) {
  auto with_v = [&](auto kf) -> int {
    using K = decltype(kf);
    switch (v) {
      case M40LLM_KV_Q8: return f(KvPair<K, KvQ8>{});
      case M40LLM_KV_Q4: return f(KvPair<K, KvQ4>{});
      case M40LLM_KV_Q3: return f(KvPair<K, KvQ3>{});
      default: return f(KvPair<K, KvQ2>{});
    }
  };
  return k == M40LLM_KV_Q8 ? with_v(KvQ8{}) : with_v(KvQ4{});
}

template <typename P>
int launch_part(m40llm_cuda_state *st, const TierAttn &a) {
  const dim3 grid((unsigned)a.n_items, (unsigned)(a.n_kv_heads * a.head_tiles), (unsigned)a.splits);
  tier_attn_kernel<P><<<grid, kTierThreads, 0, st->stream>>>(a);
  M40LLM_CUDA_CHECK_LAUNCH("tier_attn_kernel");
  return M40LLM_OK;
}

int parts_of(const m40llm_kvcache *c) { return 1 + c->n_tiers; }

}  // namespace

size_t m40llm_cuda_tier_workspace_bytes(const m40llm_kvcache *c) {
  return attn_partial_bytes(kTierPartialRows, c->opts.n_heads, c->opts.head_dim);
}

int m40llm_cuda_tier_rows(const m40llm_kvcache *c, int layer, const m40llm_row_op *ops,
                          int n_ops, const void *k_in, const void *v_in, int dtype,
                          uint16_t *k_out, uint16_t *v_out) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  TierOps a;
  memcpy(a.op, ops, (size_t)n_ops * sizeof *ops);
  for (int t = 0; t < c->n_tiers; t++) {
    const m40llm_kv_tensor *x[2] = {&c->tier_k[t], &c->tier_v[t]};
    for (int kv = 0; kv < 2; kv++) {
      a.planes[t][kv] = kv_mut_planes(*x[kv]);
      a.format[t][kv] = (signed char)x[kv]->layout.fmt->format;
      for (int p = 0; p < M40LLM_KV_PLANES; p++) a.row_bytes[t][kv][p] = (int)x[kv]->layout.row_bytes[p];
    }
    a.rows[t] = o->tiers[t].rows;
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
  const int units = n_ops * o->n_kv_heads * 2;
  tier_rows_kernel<<<(units + kTierWarps - 1) / kTierWarps, kTierThreads, 0,
                     cuda_state(c->ctx)->stream>>>(a);
  M40LLM_CUDA_CHECK_LAUNCH("tier_rows_kernel");
  return M40LLM_OK;
}

int m40llm_cuda_tier_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                               int n_seqs, const float *q, float *out, float scale) {
  m40llm_cuda_state *st = cuda_state(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  void *ws = nullptr;
  int rc = m40llm_cuda_workspace(st, m40llm_cuda_tier_workspace_bytes(c), &ws);
  if (rc != M40LLM_OK) return rc;
  const size_t row = (size_t)o->n_heads * o->head_dim;
  TierAttn a;
  a.layer = layer;
  a.max_seqs = o->max_seqs;
  a.n_kv_heads = o->n_kv_heads;
  a.n_heads = o->n_heads;
  a.group = o->n_heads / o->n_kv_heads;
  a.head_tiles = (a.group + kTierHeads - 1) / kTierHeads;
  a.head_dim = o->head_dim;
  a.n_parts = parts_of(c);
  a.q_scale = scale * kLog2e;
  a.rot_k = c->k.rotated;
  a.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));
  for (int first = 0; first < n_seqs && rc == M40LLM_OK; first += kTierItems) {
    a.n_items = n_seqs - first < kTierItems ? n_seqs - first : kTierItems;
    a.q = q + (size_t)first * row;
    // Splits enough for a few blocks an SM, within the workspace's partials.
    const long long blocks = (long long)a.n_items * a.n_kv_heads * a.head_tiles * a.n_parts;
    long long want = (8LL * st->sm_count + blocks - 1) / blocks;
    const long long room = kTierPartialRows / ((long long)a.n_items * a.n_parts);
    if (want > room) want = room;
    a.splits = (int)(want < 1 ? 1 : want > kTierMaxSplits ? kTierMaxSplits : want);
    const size_t rows = (size_t)a.n_items * a.n_parts * a.splits;
    a.part_o = static_cast<float *>(ws);
    a.part_m = a.part_o + rows * o->n_heads * o->head_dim;
    a.part_l = a.part_m + rows * o->n_heads;
    for (int i = 0; i < a.n_items; i++) a.seq[i] = seq_ids[first + i];
    // Part 0: the FP16 slots (sinks, the window's ring runs), as F16 planes of `slots` rows.
    for (int i = 0; i < a.n_items; i++) {
      const int seq = a.seq[i];
      const m40llm_attn_parts parts =
          m40llm_attn_item_parts(*m40llm_len_slot(c, layer, seq), m40llm_window_begin(c, layer, seq),
                                 c->n_sinks, c->window > 0 ? c->window : 1);
      for (int r = 0; r < 3; r++) {
        a.first[i][r] = parts.first[r];
        a.count[i][r] = c->slots > 0 ? parts.count[r] : 0;
      }
    }
    a.part = 0;
    a.rows = c->slots;
    a.k.plane[M40LLM_KV_CODES] = c->k.fp16;
    a.v.plane[M40LLM_KV_CODES] = c->v.fp16;
    a.k.plane[M40LLM_KV_PARAMS] = a.v.plane[M40LLM_KV_PARAMS] = nullptr;
    rc = launch_part<KvPair<KvF16, KvF16>>(st, a);  // no slots: empty partials
    for (int t = 0; t < c->n_tiers && rc == M40LLM_OK; t++) {
      for (int i = 0; i < a.n_items; i++) {
        a.first[i][0] = 0;
        a.count[i][0] = m40llm_tier_counts(c, layer, a.seq[i])[t];
        a.count[i][1] = a.count[i][2] = 0;
      }
      a.part = 1 + t;
      a.rows = o->tiers[t].rows;
      a.k = kv_planes_at(c->tier_k[t], 0);
      a.v = kv_planes_at(c->tier_v[t], 0);
      rc = with_tier_pair(o->tiers[t].k_format, o->tiers[t].v_format,
                          [&](auto pair) { return launch_part<decltype(pair)>(st, a); });
    }
    if (rc != M40LLM_OK) break;
    const unsigned units = (unsigned)(a.n_items * o->n_heads);
    tier_combine_kernel<<<(units + kTierWarps - 1) / kTierWarps, kTierThreads, 0, st->stream>>>(
        a, out + (size_t)first * row, c->v.rotated);
    M40LLM_CUDA_CHECK_LAUNCH("tier_combine_kernel");
  }
  return rc;
}
