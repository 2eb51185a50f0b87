// The combine kernels: merge the (max, sum, unnormalised output) partials that the split
// kernels of every family write for a sequence with several splits, with the online-softmax
// rule, into the normalised output. Items with a single split were finished by the split
// kernel and are skipped.
#include <math.h>

#include "attention.cuh"

namespace {

// Partials entry p's (max, sum) and this lane's float4 words lane + 32 k of its output (words
// past head_dim / 4 are left unset: their lanes write nothing). A split past its item's end
// (real false) reads as (-inf, 0): its merge weight is 0.
template <int K>
__device__ __forceinline__ void load_partial(const AttnArgs &a, bool real, size_t p, int lane,
                                             float &m, float &l, float4 (&v)[K]) {
  m = -INFINITY;
  l = 0.0f;
  if (!real) return;
  m = a.part_m[p];
  l = a.part_l[p];
  const int d4 = a.head_dim / 4;
  const float4 *po = reinterpret_cast<const float4 *>(a.part_o) + p * d4;
#pragma unroll
  for (int k = 0; k < K; k++)
    if (lane + 32 * k < d4) v[k] = po[lane + 32 * k];
}

// Output word d4 of (item, query head h): t x inv_l.
__device__ __forceinline__ void store_word(const AttnArgs &a, int item, int h, int d4, float4 t,
                                           float inv_l) {
  store4(a.out + ((size_t)item * a.n_heads + h) * a.head_dim + d4 * 4,
         make_float4(t.x * inv_l, t.y * inv_l, t.z * inv_l, t.w * inv_l));
}

// Plans of more than kCombineFewSplits splits, or head_dim above kCombineFewMaxDim: one block
// per (item, query head). Each of its W warps merges every W-th split, lanes covering the
// head's dims 4 at a time (K words a lane: 1 up to head_dim 128, else 2), combine_batch(K)
// splits at a time: their loads go out together (written as one loop, the compiler reused one
// split's registers for the next, a memory round trip per split). The warps' states and outputs
// then merge in shared memory. W is kCombineWarps, or kCombineWideWarps where 8 warps would take
// more than one round trip and the grid leaves SMs idle (combine_wide in tuning.cuh).
template <int K, int W>
__global__ void __launch_bounds__(32 * W, W == kCombineWarps ? kCombineMinBlocksPerSm : 1)
    attn_combine_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  static_assert(W == kCombineWarps || W == 32, "the wide merge takes a warp's state a lane");
  constexpr int B = combine_batch(K);
  __shared__ SoftmaxState s_state[W];
  __shared__ float4 s_acc[W][32 * K];
  const int item = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int first = plan.split_begin[item];
  const int n = plan.split_begin[item + 1] - first;
  wait_for_prerequisite_grid();
  allow_dependent_launch();
  if (n == 1) return;

  const int D4 = a.head_dim / 4;
  SoftmaxState st = SoftmaxState::empty();
  float4 acc[K];
#pragma unroll
  for (int k = 0; k < K; k++) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = warp; s0 < n; s0 += W * B) {
    float ms[B], ls[B];
    float4 v[B][K];
    float batch_max = -INFINITY;
#pragma unroll
    for (int b = 0; b < B; b++) {
      const int s = s0 + b * W;
      load_partial(a, s < n, (size_t)(first + s) * a.n_heads + h, lane, ms[b], ls[b], v[b]);
      batch_max = fmaxf(batch_max, ms[b]);
    }
    const float alpha = st.raise(batch_max);
#pragma unroll
    for (int k = 0; k < K; k++) {
      acc[k].x *= alpha;
      acc[k].y *= alpha;
      acc[k].z *= alpha;
      acc[k].w *= alpha;
    }
#pragma unroll
    for (int b = 0; b < B; b++) {
      if (s0 + b * W < n) {
        const float w = st.add_partial(ms[b], ls[b]);
#pragma unroll
        for (int k = 0; k < K; k++)
          if (lane + 32 * k < D4) fma4(w, v[b][k], acc[k]);
      }
    }
  }
  if (lane == 0) s_state[warp] = st;
#pragma unroll
  for (int k = 0; k < K; k++)
    if (lane + 32 * k < D4) s_acc[warp][lane + 32 * k] = acc[k];
  __syncthreads();

  if constexpr (W == kCombineWarps) {
    // Each thread that stores a word takes every warp's weight in turn.
    if (tid >= D4) return;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; w++) mx = fmaxf(mx, s_state[w].m);
    SoftmaxState all = SoftmaxState::at_max(mx);
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < W; w++) fma4(all.add_partial(s_state[w].m, s_state[w].l), s_acc[w][tid], t);
    store_word(a, item, h, tid, t, all.inv_sum());
  } else {
    // At 32 warps a chain of 32 weights a thread would be the block's longest: the warps that
    // hold a word of the output merge the states with lane w taking warp w's, and each weight is
    // shuffled from its lane.
    if (warp * 32 >= D4) return;
    const SoftmaxState mine = s_state[lane];
    float mx = mine.m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    SoftmaxState all = SoftmaxState::at_max(mx);
    const float wt = all.add_partial(mine.m, mine.l);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) all.l += __shfl_xor_sync(0xffffffffu, all.l, o);
    const int d4 = tid < D4 ? tid : 0;
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < W; w++) fma4(__shfl_sync(0xffffffffu, wt, w), s_acc[w][d4], t);
    if (tid < D4) store_word(a, item, h, tid, t, all.inv_sum());
  }
}

// Plans of at most kCombineFewSplits splits per item at head_dim <= kCombineFewMaxDim: one warp
// per (item, query head), lane d4 taking dims 4 d4 .. 4 d4 + 3, loads every split's partials at
// once and merges them in registers: one memory round trip and no barrier, and
// kCombineFewHeads heads per block, so a batch's merge fits in one wave. 64 registers: 50%
// occupancy on sm_52.
__global__ void __launch_bounds__(32 * kCombineFewHeads, 8)
    attn_combine_few_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  const int item = blockIdx.x, lane = threadIdx.x & 31;
  const int h = blockIdx.y * kCombineFewHeads + (threadIdx.x >> 5);
  const int first = plan.split_begin[item];
  const int n = plan.split_begin[item + 1] - first;
  wait_for_prerequisite_grid();
  allow_dependent_launch();
  if (n == 1 || h >= a.n_heads) return;

  constexpr int N = kCombineFewSplits > 0 ? kCombineFewSplits : 1;
  const bool active = lane < a.head_dim / 4;
  float ms[N], ls[N];
  float4 v[N][1];
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < N; s++) {
    load_partial(a, s < n, (size_t)(first + s) * a.n_heads + h, lane, ms[s], ls[s], v[s]);
    m = fmaxf(m, ms[s]);
  }
  SoftmaxState st = SoftmaxState::at_max(m);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int s = 0; s < N; s++)
    if (s < n) fma4(st.add_partial(ms[s], ls[s]), v[s][0], acc);
  if (!active) return;
  const float inv_l = st.inv_sum();
  store4(a.out + ((size_t)item * a.n_heads + h) * a.head_dim + 4 * lane,
         make_float4(acc.x * inv_l, acc.y * inv_l, acc.z * inv_l, acc.w * inv_l));
}

}  // namespace

int combine_prepare(m40llm_cuda_state *st, bool *dependent) {
  // One file is built for one architecture list: any of its kernels' images answers for all.
  return kernel_waits(st, reinterpret_cast<const void *>(attn_combine_kernel<1, kCombineWarps>),
                      &st->combine_dependent, dependent);
}

int combine_launch(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan,
                   bool dependent) {
  const unsigned items = (unsigned)plan.n_items;
  if (plan.max_splits <= kCombineFewSplits && a.head_dim <= kCombineFewMaxDim) {
    const dim3 grid(items, (unsigned)((a.n_heads + kCombineFewHeads - 1) / kCombineFewHeads));
    return launch_attention_kernel(st->stream, "launching attn_combine_few_kernel",
                                   attn_combine_few_kernel, grid, 32 * kCombineFewHeads, 0,
                                   dependent, a, plan);
  }
  const int words = a.head_dim <= 128 ? 1 : 2;
  const bool wide = combine_wide(plan.max_splits, words, (long long)items * a.n_heads, st->sm_count);
  const int warps = wide ? kCombineWideWarps : kCombineWarps;
  return launch_attention_kernel(
      st->stream, "launching attn_combine_kernel",
      words == 1 ? (wide ? attn_combine_kernel<1, kCombineWideWarps>
                         : attn_combine_kernel<1, kCombineWarps>)
                 : (wide ? attn_combine_kernel<2, kCombineWideWarps>
                         : attn_combine_kernel<2, kCombineWarps>),
      dim3(items, (unsigned)a.n_heads), 32 * warps, 0, dependent, a, plan);
}
