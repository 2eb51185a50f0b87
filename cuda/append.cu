// Appending K/V rows: the caller's [token][kv_head][dim] FP32, FP16 or BF16 rows of one or more
// sequences of a layer (packed in item order), encoded by the cache's K and V formats into its
// [kv_head][pos][dim] rows. A launch takes up to kAppendMaxItems sequences, described by a table
// in its arguments: a batch of decode tokens is one launch.
#include "backend_cuda.h"
#include "common.cuh"
#include "kv_format.cuh"
#include "rotation.cuh"
#include "tuning.cuh"

namespace {

// The caller's elements: FP32, FP16 (which an F16 cache keeps bit for bit) or bfloat16, which
// is widened to FP32 (exactly) in registers and then takes FP32's path.
struct Bf16 {
  unsigned short bits;
};
template <typename T>
struct Src {
  using Reg = T;
  __device__ static T at(const T *p, size_t i) { return p[i]; }
};
template <>
struct Src<Bf16> {
  using Reg = float;
  __device__ static float at(const Bf16 *p, size_t i) {
    return __uint_as_float((unsigned)p[i].bits << 16);
  }
};

// Sequences per launch: the table travels as a kernel argument (4 KB of them on sm_52).
constexpr int kAppendMaxItems = 128;

// Where a launch writes: the layer's rows (its sequence 0), how far apart sequences lie, and the
// launch's items: item i writes its sequence seq[i] from position pos[i] with the launch's
// tokens [tok[i], tok[i + 1]) (the caller's rows from the launch's k and v).
struct AppendDst {
  SeqRows layer;
  size_t seq_stride, slot_seq_stride;  // elements
  int n_items;
  int seq[kAppendMaxItems], pos[kAppendMaxItems];
  size_t tok[kAppendMaxItems + 1];

  // The item that token t belongs to.
  __device__ int item_of(size_t t) const {
    int lo = 0, hi = n_items - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tok[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
  // Item i's rows: its sequence's, positions [pos[i], pos[i] + its tokens).
  __device__ SeqRows rows(int i) const {
    SeqRows at = layer;
    at.first += (size_t)seq[i] * seq_stride;
    at.slot_first += (size_t)seq[i] * slot_seq_stride;
    at.pos = pos[i];
    at.n_tokens = (int)(tok[i + 1] - tok[i]);
    return at;
  }
};

// An F16 cache's rows, element-parallel. P: the cache's KvPair of formats. Each thread takes R
// elements of one token's K/V head row (R the larger of the formats' encode runs: head_dim is a
// multiple of it) and encodes them in the formats' runs.
template <typename P, typename T>
__global__ void append_kernel(const T *__restrict__ k, const T *__restrict__ v, KvMutPlanes ck,
                              KvMutPlanes cv, const AppendDst d, size_t runs) {
  allow_dependent_launch();
  using KF = typename P::K;
  using VF = typename P::V;
  constexpr int R = KF::kEncodeRun > VF::kEncodeRun ? KF::kEncodeRun : VF::kEncodeRun;
  const int D = d.layer.head_dim, H = d.layer.n_kv_heads;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < runs;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t e = i * R;  // the run's first element in the caller's rows
    const size_t th = e / D, t = th / H;
    const int item = d.item_of(t);
    const SeqRows at = d.rows(item);
    const size_t dst = at.row((int)(th % H), at.pos + (int)(t - d.tok[item])) + e % D;
    using Reg = typename Src<T>::Reg;
    Reg xk[R], xv[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
      xk[j] = Src<T>::at(k, e + j);
      xv[j] = Src<T>::at(v, e + j);
    }
#pragma unroll
    for (int j = 0; j < R; j += KF::kEncodeRun)
      KF::encode(ck, dst + j, *reinterpret_cast<const Reg(*)[KF::kEncodeRun]>(xk + j));
#pragma unroll
    for (int j = 0; j < R; j += VF::kEncodeRun)
      VF::encode(cv, dst + j, *reinterpret_cast<const Reg(*)[VF::kEncodeRun]>(xv + j));
  }
}

// A quantized cache's rows: one warp a (token, K/V head) row, rotated in registers where the
// tensor is (the same FP32 operations as the CPU backend), staged in shared memory as FP32,
// then encoded a group at a time, a lane an element; a protected position's FP16 copy goes to
// its slot. P: the cache's KvPair of formats (quantized ones: their encode run is the group).
constexpr int kAppendRowWarps = kAppendThreads / 32;

struct AppendRows {
  KvMutPlanes k, v;
  __half *k16, *v16;  // the FP16 slots, or null
  bool rot_k, rot_v;
  AppendDst d;
};

template <typename F, typename T>
__device__ __forceinline__ void append_row(float *x, const T *src, const KvMutPlanes &planes,
                                           __half *slot, size_t dst, bool rotate,
                                           const SeqRows &at, int lane) {
  const int D = at.head_dim;
  float v[8];  // dims lane + 32 e (head_dim <= 256)
#pragma unroll
  for (int e = 0; e < 8; e++)
    v[e] = lane + 32 * e < D ? (float)Src<T>::at(src, lane + 32 * e) : 0.0f;
  if (rotate) warp_rotate(v, D, at.rot_scale);
#pragma unroll
  for (int e = 0; e < 8; e++)
    if (lane + 32 * e < D) x[lane + 32 * e] = v[e];
  __syncwarp();
  for (int g = 0; g < D; g += F::kGroup) F::encode_lane(planes, dst + g, x[g + lane], lane);
  if (slot)
    for (int i = lane; i < D; i += 32) slot[i] = __float2half_rn(x[i]);
  __syncwarp();  // the row is read before the next one is staged
}

// Four blocks an SM on sm_52 (64 registers), as before batching added the item search.
template <typename P, typename T>
__global__ void __launch_bounds__(kAppendThreads, 4)
    append_rows_kernel(const T *__restrict__ k, const T *__restrict__ v, const AppendRows r) {
  allow_dependent_launch();
  __shared__ float stage[kAppendRowWarps][2][256];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const AppendDst &d = r.d;
  const int H = d.layer.n_kv_heads;
  const size_t rows = d.tok[d.n_items] * H;
  for (size_t row = blockIdx.x * (size_t)kAppendRowWarps + warp; row < rows;
       row += (size_t)gridDim.x * kAppendRowWarps) {
    const size_t t = row / H;
    const int item = d.item_of(t);
    const SeqRows at = d.rows(item);
    const int h = (int)(row % H), p = at.pos + (int)(t - d.tok[item]);
    const size_t dst = at.row(h, p);
    // The positions kept in FP16: sinks, and the window as it stands after this append.
    const bool kept = r.k16 && (p < at.n_sinks || p >= at.pos + at.n_tokens - at.window);
    const size_t slot = kept ? at.slot(h, p) : 0;
    const size_t src = row * at.head_dim;
    append_row<typename P::K>(stage[warp][0], k + src, r.k, kept ? r.k16 + slot : nullptr, dst,
                              r.rot_k, at, lane);
    append_row<typename P::V>(stage[warp][1], v + src, r.v, kept ? r.v16 + slot : nullptr, dst,
                              r.rot_v, at, lane);
  }
}

unsigned grid_for(size_t units, int per_block) {
  const size_t want = (units + per_block - 1) / per_block;
  return (unsigned)(want < kAppendMaxBlocks ? want : kAppendMaxBlocks);
}

// One launch over d's items, from the launch's rows k and v.
template <typename P, typename T>
int launch(const m40llm_kvcache *c, const AppendDst &d, const T *k, const T *v) {
  cudaStream_t s = cuda_state(c->ctx)->stream;
  const size_t tokens = d.tok[d.n_items];
  if constexpr (P::K::kScaled || P::V::kScaled) {
    AppendRows r;
    r.k = kv_mut_planes(c->k);
    r.v = kv_mut_planes(c->v);
    r.k16 = reinterpret_cast<__half *>(c->k.fp16);
    r.v16 = reinterpret_cast<__half *>(c->v.fp16);
    r.rot_k = c->k.rotated;
    r.rot_v = c->v.rotated;
    r.d = d;
    append_rows_kernel<P, T><<<grid_for(tokens * d.layer.n_kv_heads, kAppendRowWarps),
                               kAppendThreads, 0, s>>>(k, v, r);
    M40LLM_CUDA_CHECK_LAUNCH("append_rows_kernel");
  } else {
    constexpr int R = P::K::kEncodeRun > P::V::kEncodeRun ? P::K::kEncodeRun : P::V::kEncodeRun;
    const size_t runs = tokens * d.layer.n_kv_heads * d.layer.head_dim / R;
    append_kernel<P, T><<<grid_for(runs, kAppendThreads), kAppendThreads, 0, s>>>(
        k, v, kv_mut_planes(c->k), kv_mut_planes(c->v), d, runs);
    M40LLM_CUDA_CHECK_LAUNCH("append_kernel");
  }
  return M40LLM_OK;
}

template <typename P, typename T>
int append_items(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                 int n_items, const T *k, const T *v) {
  const m40llm_kvcache_options *o = &c->opts;
  AppendDst d;
  d.layer = seq_rows(c, layer, 0, 0, 0);
  d.seq_stride = m40llm_kv_row(o, 0, 1, 0, 0) * o->head_dim;
  d.slot_seq_stride = m40llm_kv_protected_row(o, c->slots, 0, 1, 0, 0) * o->head_dim;
  const size_t row = (size_t)o->n_kv_heads * o->head_dim;  // elements of a token
  for (int first = 0; first < n_items; first += kAppendMaxItems) {
    d.n_items = n_items - first < kAppendMaxItems ? n_items - first : kAppendMaxItems;
    d.tok[0] = 0;
    for (int i = 0; i < d.n_items; i++) {
      d.seq[i] = items[first + i].seq;
      d.pos[i] = items[first + i].pos;
      d.tok[i + 1] = d.tok[i] + (size_t)items[first + i].n_tokens;
    }
    const int rc = launch<P>(c, d, k, v);
    if (rc != M40LLM_OK) return rc;
    k += d.tok[d.n_items] * row;
    v += d.tok[d.n_items] * row;
  }
  return M40LLM_OK;
}

}  // namespace

int m40llm_cuda_append(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                       int n_items, const void *k, const void *v, int dtype) {
  M40LLM_CUDA_ENTER(c->ctx);
  return with_kv_pair(c->k.layout.fmt->format, c->v.layout.fmt->format, [&](auto pair) -> int {
    using P = decltype(pair);
    if (dtype == M40LLM_DTYPE_F16)
      return append_items<P>(c, layer, items, n_items, static_cast<const __half *>(k),
                             static_cast<const __half *>(v));
    if (dtype == M40LLM_DTYPE_BF16)
      return append_items<P>(c, layer, items, n_items, static_cast<const Bf16 *>(k),
                             static_cast<const Bf16 *>(v));
    return append_items<P>(c, layer, items, n_items, static_cast<const float *>(k),
                           static_cast<const float *>(v));
  });
}
