// Decode attention: one FP32 query row per sequence against that sequence's FP16 K/V, FP32
// arithmetic throughout (sm_52 has no fast half math).
//
// split kernel: one block per (sequence, split of its positions, K/V head, tile of that head's
//   query heads). It walks its positions in tiles with an online softmax, so shared memory does
//   not grow with the context. Every K/V row is read once per block and serves all the block's
//   query heads (GQA). A sequence with one split writes its output directly; otherwise the
//   block writes (max, sum, unnormalised output) partials.
// combine kernel: merges a sequence's partials with the online-softmax rule.
// The host side picks the split kernel per cache: this FP32 one, or on sm_80+ builds (head_dim a
// multiple of 16 up to 128) the tensor-core one in attention_mma.cu, which writes the same
// partials.
//
// Scores live in the log2 domain (q is pre-multiplied by scale * log2(e)) so exp is exp2f.
#include <math.h>

#include "attention.cuh"
#include "tuning.cuh"

namespace {

// A row's softmax weights for all GT heads, in as few shared loads as alignment allows.
template <int GT>
__device__ __forceinline__ void load_weights(const float *p, float (&w)[GT]) {
  if constexpr (GT % 4 == 0) {
#pragma unroll
    for (int g = 0; g < GT; g += 4) {
      const float4 t = *reinterpret_cast<const float4 *>(p + g);
      w[g] = t.x, w[g + 1] = t.y, w[g + 2] = t.z, w[g + 3] = t.w;
    }
  } else if constexpr (GT == 2) {
    const float2 t = *reinterpret_cast<const float2 *>(p);
    w[0] = t.x, w[1] = t.y;
  } else {
    w[0] = p[0];
  }
}

// Shared memory of the split kernel, in floats: q [GT][D] and the weight tile [T][GT] while
// looping, then the per-row-group output partials [row_groups][GT][D] for the final reduction.
__host__ __device__ constexpr int pv_row_groups(int head_dim, int cols) {
  return kAttnThreads / (head_dim / cols);
}

constexpr int split_smem_floats(int gt, int dmax, int head_dim) {
  return gt * (dmax + tile_rows(gt, dmax)) > pv_row_groups(head_dim, pv_columns(gt)) * gt * head_dim
             ? gt * (dmax + tile_rows(gt, dmax))
             : pv_row_groups(head_dim, pv_columns(gt)) * gt * head_dim;
}

// GT: query heads per block (power of two <= kMaxGroupTile); heads past the group get a zero q
// and are never written. DMAX: head_dim class (head_dim <= DMAX, a multiple of 8).
template <int GT, int DMAX>
__global__ void __launch_bounds__(kAttnThreads, kAttnMinBlocksPerSm)
    attn_split_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  constexpr int T = tile_rows(GT, DMAX);      // positions per tile
  constexpr int LPR = kAttnThreads / T;       // lanes per K row in the score pass (2..16)
  constexpr int KC = DMAX / 8 / LPR;          // 16-byte K chunks per lane, at most
  constexpr int COLS = pv_columns(GT);        // V columns per thread in the output pass
  constexpr int VR = T * DMAX / (kAttnThreads * COLS);  // V rows per thread, at most
  constexpr int NS = (T + 31) / 32;           // scores per lane in the softmax pass
  constexpr int GH = heads_per_pass(GT);      // heads a score or output pass takes at once
  using VRaw = typename HalfVec<COLS>::Raw;
  static_assert(LPR >= 2 && LPR <= 32 && KC >= 1, "tile shape");

  extern __shared__ float smem[];
  __shared__ float s_max[GT], s_sum[GT], s_alpha[GT];
  const int D = a.head_dim;
  // q, pre-scaled into the log2 domain, as [GT][2][DMAX / 8][4]: dims 0-3 of every 8-dim chunk,
  // then dims 4-7, so the lanes of a K row read consecutive 16-byte words (no bank conflicts),
  // at compile-time offsets.
  float *sq = smem;
  float *sp = smem + GT * DMAX;  // [T][GT]: a position's weights for every head together
  const int tid = threadIdx.x;

  const SplitBlock b = split_block(a, plan, GT);
  wait_for_prerequisite_grid();
  if (plan.max_splits > 1) allow_dependent_launch();  // the combine kernel: see below
  const int p_begin = b.p_begin, p_end = b.p_end, nh = b.nh;
  const __half *K = b.k;
  const __half *V = b.v;

  const float *q = a.q + ((size_t)b.item * a.n_heads + b.h0) * D;
  for (int i = tid; i < GT * D; i += kAttnThreads) {
    const int g = i / D, d = i % D;
    sq[g * DMAX + (d & 4 ? DMAX / 2 : 0) + (d >> 3) * 4 + (d & 3)] = g < nh ? q[i] * a.q_scale : 0.0f;
  }
  if (tid < GT) {
    s_max[tid] = -INFINITY;
    s_sum[tid] = 0.0f;
  }

  // Score pass: LPR lanes per K row, each with up to KC 16-byte chunks of it.
  const int k_row = tid / LPR, k_lane = tid % LPR;
  const int chunks = D / 8;
  // Output pass: COLS columns per thread; row groups stride over the tile's positions.
  const int pv_tpr = D / COLS;
  const int row_groups = kAttnThreads / pv_tpr;
  const int rg = tid / pv_tpr;
  const int col = (tid % pv_tpr) * COLS;
  const bool pv_active = rg < row_groups;
  float o[GT][COLS];
#pragma unroll
  for (int g = 0; g < GT; g++)
#pragma unroll
    for (int i = 0; i < COLS; i++) o[g][i] = 0.0f;

  // Per-thread cursors, advanced a tile at a time: the loop body computes no 64-bit products.
  const size_t tile_step = (size_t)T * D;
  const int v_step = row_groups * D;
  const __half *kp = K + (size_t)(p_begin + k_row) * D + k_lane * 8;
  const __half *vp = V + (size_t)(p_begin + rg) * D + col;
  const float *qp = sq + k_lane * 4;

  for (int t0 = p_begin; t0 < p_end; t0 += T, kp += tile_step, vp += tile_step) {
    const int rows = min(T, p_end - t0);
    // Every load of the tile goes out before anything waits on one: one memory latency per
    // tile instead of one per row batch.
    uint4 kraw[KC];
#pragma unroll
    for (int j = 0; j < KC; j++)
      if (k_row < rows && k_lane + j * LPR < chunks) kraw[j] = load_raw<8>(kp + j * LPR * 8);
    VRaw vraw[VR];
#pragma unroll
    for (int i = 0; i < VR; i++)
      if (pv_active && rg + i * row_groups < rows) vraw[i] = load_raw<COLS>(vp + i * v_step);
    __syncthreads();  // q is staged, and the previous tile's weights are consumed

#pragma unroll
    for (int g0 = 0; g0 < GT; g0 += GH) {
      float acc[GH];
#pragma unroll
      for (int g = 0; g < GH; g++) acc[g] = 0.0f;
#pragma unroll
      for (int j = 0; j < KC; j++) {
        const int c = k_lane + j * LPR;
        if (k_row < rows && c < chunks) {
          float kf[8];
          widen<8>(kraw[j], kf);
#pragma unroll
          for (int g = 0; g < GH; g++) {
            const float *qg = qp + (g0 + g) * DMAX + j * LPR * 4;
            const float4 qa = *reinterpret_cast<const float4 *>(qg);
            const float4 qb = *reinterpret_cast<const float4 *>(qg + DMAX / 2);
            float s = acc[g];
            s = fmaf(qa.x, kf[0], s);
            s = fmaf(qa.y, kf[1], s);
            s = fmaf(qa.z, kf[2], s);
            s = fmaf(qa.w, kf[3], s);
            s = fmaf(qb.x, kf[4], s);
            s = fmaf(qb.y, kf[5], s);
            s = fmaf(qb.z, kf[6], s);
            s = fmaf(qb.w, kf[7], s);
            acc[g] = s;
          }
        }
      }
#pragma unroll
      for (int g = 0; g < GH; g++) {
#pragma unroll
        for (int off = 1; off < LPR; off <<= 1) acc[g] += __shfl_xor_sync(0xffffffffu, acc[g], off);
      }
      if (k_lane == 0) {
#pragma unroll
        for (int g = 0; g < GH; g++) sp[k_row * GT + g0 + g] = k_row < rows ? acc[g] : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax over the tile: one warp per query head.
    const int lane = tid & 31;
    for (int g = tid >> 5; g < GT; g += kAttnThreads / 32) {
      float s[NS];
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < NS; j++) {
        const int r = lane + 32 * j;
        s[j] = r < T ? sp[r * GT + g] : -INFINITY;
        tile_max = fmaxf(tile_max, s[j]);
      }
      tile_max = warp_max(tile_max);
      const float m_old = s_max[g];
      const float m_new = fmaxf(m_old, tile_max);  // finite: every tile has a real row
      const float alpha = exp2f(m_old - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NS; j++) {
        const int r = lane + 32 * j;
        s[j] = exp2f(s[j] - m_new);
        sum += s[j];
        if (r < T) sp[r * GT + g] = s[j];
      }
      sum = warp_sum(sum);
      __syncwarp();  // every lane has read s_max[g] before lane 0 replaces it (shuffles don't fence)
      if (lane == 0) {
        s_max[g] = m_new;
        s_sum[g] = s_sum[g] * alpha + sum;
        s_alpha[g] = alpha;
      }
    }
    __syncthreads();

    if (pv_active) {
#pragma unroll
      for (int g = 0; g < GT; g++) {
        const float alpha = s_alpha[g];
#pragma unroll
        for (int i = 0; i < COLS; i++) o[g][i] *= alpha;
      }
#pragma unroll
      for (int i = 0; i < VR; i++) {
        const int r = rg + i * row_groups;
        if (r < rows) {
          float vf[COLS];
          widen<COLS>(vraw[i], vf);
#pragma unroll
          for (int g0 = 0; g0 < GT; g0 += GH) {
            float w[GH];
            load_weights<GH>(sp + r * GT + g0, w);
#pragma unroll
            for (int g = 0; g < GH; g++) {
#pragma unroll
              for (int c = 0; c < COLS; c++) o[g0 + g][c] = fmaf(w[g], vf[c], o[g0 + g][c]);
            }
          }
        }
      }
    }
  }
  // A one-pass plan's next kernel is most likely the next call's split kernel: let in any
  // earlier, its blocks would hold SM slots through this loop (B32 32/8 D64 L512 on an H100:
  // 14.4 us a call, 14.8 let in after the wait). A combine kernel is small: let in at once.
  if (plan.max_splits == 1) allow_dependent_launch();

  __syncthreads();  // q and weights are dead: reuse their space for the row-group reduction
  float *red = smem;  // [row_group][GT][D]
  if (pv_active) {
#pragma unroll
    for (int g = 0; g < GT; g++)
#pragma unroll
      for (int i = 0; i < COLS; i++) red[(rg * GT + g) * D + col + i] = o[g][i];
  }
  __syncthreads();
  // The block's coordinates again rather than kept in registers through the loop (on sm_52 they
  // would be spilled).
  const SplitBlock fin = split_block(a, plan, GT);
  for (int idx = tid; idx < fin.nh * D; idx += kAttnThreads) {
    const int g = idx / D, d = idx % D;
    float acc = 0.0f;
    for (int r = 0; r < row_groups; r++) acc += red[(r * GT + g) * D + d];
    store_split_result(a, fin, fin.h0 + g, d, acc, s_max[g], s_sum[g]);
  }
}

// acc += w * v, per component.
__device__ __forceinline__ void fma4(float w, const float4 &v, float4 &acc) {
  acc.x = fmaf(w, v.x, acc.x);
  acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z);
  acc.w = fmaf(w, v.w, acc.w);
}

// Partials entry p's (max, sum) and this lane's float4 words lane + 32 k of its output (words
// past head_dim / 4 are left unset: their lanes write nothing). A split past its item's end
// (real false) reads as (-inf, 0): its merge weight exp2(-inf) is 0.
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

// Plans of more than kCombineFewSplits splits, or head_dim above kCombineFewMaxDim: one block
// per (item, query head); items with a single split were finished by the split kernel. Each
// warp merges every 8th split with the online-softmax rule, lanes covering the head's dims 4 at
// a time, kCombineBatch splits at a time: their loads go out together (written as one loop, the
// compiler reused one split's registers for the next, a memory round trip per split), so 32
// splits take one round trip. The warps' (max, sum, output) then merge in shared memory. Each
// split holds at least one position, so every partial max is finite.
constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineBatch = 4;  // 64 registers at most on sm_52: 50% occupancy

__global__ void __launch_bounds__(kCombineThreads)
    attn_combine_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  __shared__ float s_m[kCombineWarps], s_l[kCombineWarps];
  __shared__ float4 s_acc[kCombineWarps][64];  // head_dim <= 256 = 64 float4
  const int item = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int first = plan.split_begin[item];
  const int n = plan.split_begin[item + 1] - first;
  wait_for_prerequisite_grid();
  allow_dependent_launch();
  if (n == 1) return;

  const int D4 = a.head_dim / 4;
  float m = -INFINITY, l = 0.0f;
  float4 acc[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
  for (int s0 = warp; s0 < n; s0 += kCombineWarps * kCombineBatch) {
    float ms[kCombineBatch], ls[kCombineBatch];
    float4 v[kCombineBatch][2];
    float m_new = m;
#pragma unroll
    for (int b = 0; b < kCombineBatch; b++) {
      const int s = s0 + b * kCombineWarps;
      load_partial(a, s < n, (size_t)(first + s) * a.n_heads + h, lane, ms[b], ls[b], v[b]);
      m_new = fmaxf(m_new, ms[b]);
    }
    const float alpha = exp2f(m - m_new);  // split s0 is real: m_new is finite
    m = m_new;
    l *= alpha;
#pragma unroll
    for (int k = 0; k < 2; k++) {
      acc[k].x *= alpha;
      acc[k].y *= alpha;
      acc[k].z *= alpha;
      acc[k].w *= alpha;
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; b++) {
      if (s0 + b * kCombineWarps < n) {
        const float w = exp2f(ms[b] - m_new);
        l = fmaf(w, ls[b], l);
#pragma unroll
        for (int k = 0; k < 2; k++)
          if (lane + 32 * k < D4) fma4(w, v[b][k], acc[k]);
      }
    }
  }
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
#pragma unroll
  for (int k = 0; k < 2; k++)
    if (lane + 32 * k < D4) s_acc[warp][lane + 32 * k] = acc[k];
  __syncthreads();

  // A warp without splits has max -inf and weight 0.
  float wt[kCombineWarps];
  float mx = -INFINITY, sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; w++) mx = fmaxf(mx, s_m[w]);
#pragma unroll
  for (int w = 0; w < kCombineWarps; w++) {
    wt[w] = s_m[w] == -INFINITY ? 0.0f : exp2f(s_m[w] - mx);
    sum = fmaf(wt[w], s_l[w], sum);
  }
  const float inv_l = 1.0f / sum;
  for (int d4 = tid; d4 < D4; d4 += kCombineThreads) {
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kCombineWarps; w++) fma4(wt[w], s_acc[w][d4], t);
    // out is the caller's: only 4-byte alignment is promised.
    float *dst = a.out + ((size_t)item * a.n_heads + h) * a.head_dim + d4 * 4;
    dst[0] = t.x * inv_l;
    dst[1] = t.y * inv_l;
    dst[2] = t.z * inv_l;
    dst[3] = t.w * inv_l;
  }
}

// Plans of at most kCombineFewSplits splits per item (tuning.cuh) at head_dim <= 128: one warp
// per (item, query head), lane d4 taking dims 4 d4 .. 4 d4 + 3, loads every split's (max, sum,
// output) at once and merges them in registers: one memory round trip and no barrier, and
// kCombineFewHeads heads per block, so a batch's merge is a quarter of the blocks and fits in
// one wave. 64 registers: 50% occupancy on sm_52.
constexpr int kCombineFewHeads = 4;
constexpr int kCombineFewMaxDim = 128;

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
  float l = 0.0f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int s = 0; s < N; s++) {
    if (s < n) {
      const float w = exp2f(ms[s] - m);
      l = fmaf(w, ls[s], l);
      fma4(w, v[s][0], acc);
    }
  }
  if (!active) return;
  const float inv_l = 1.0f / l;
  // out is the caller's: only 4-byte alignment is promised.
  float *dst = a.out + ((size_t)item * a.n_heads + h) * a.head_dim + 4 * lane;
  dst[0] = acc.x * inv_l;
  dst[1] = acc.y * inv_l;
  dst[2] = acc.z * inv_l;
  dst[3] = acc.w * inv_l;
}

// How a cache's query heads map onto blocks: each K/V head's group of query heads in tiles of
// gt (a power of two up to kMaxGroupTile), units blocks per (sequence, split).
struct Grouping {
  int group, gt, head_tiles, units;
};

Grouping grouping_for(const m40llm_kvcache_options *o) {
  Grouping g;
  g.group = o->n_heads / o->n_kv_heads;
  g.gt = 1;
  while (g.gt < g.group && g.gt < kMaxGroupTile) g.gt <<= 1;
  g.head_tiles = (g.group + g.gt - 1) / g.gt;
  g.units = o->n_kv_heads * g.head_tiles;
  return g;
}

int log2_small(int x) { return x >= 8 ? 3 : x >= 4 ? 2 : x >= 2 ? 1 : 0; }

int dmax_for(int head_dim) {
  for (int dmax : kHeadDimClasses)
    if (head_dim <= dmax) return dmax;
  return 256;
}

size_t split_smem_bytes(int gt, int head_dim) {
  return split_smem_floats(gt, dmax_for(head_dim), head_dim) * sizeof(float);
}

template <int GT>
SplitKernel split_kernel_for_dmax(int dmax) {
  return dmax == 64 ? attn_split_kernel<GT, 64>
                    : dmax == 128 ? attn_split_kernel<GT, 128> : attn_split_kernel<GT, 256>;
}

SplitKernel split_kernel_for(int gt, int head_dim) {
  const int dmax = dmax_for(head_dim);
  switch (gt) {
    case 1: return split_kernel_for_dmax<1>(dmax);
    case 2: return split_kernel_for_dmax<2>(dmax);
    case 4: return split_kernel_for_dmax<4>(dmax);
    default: return split_kernel_for_dmax<8>(dmax);
  }
}

// The split kernel a cache's launches use, with its block shape and how many blocks fill the GPU.
struct SplitPass {
  SplitKernel kernel;
  int threads;
  size_t smem;
  int tile;    // positions a block consumes per step: split chunks are multiples of it
  int target;  // SMs x resident blocks x waves
  int stages;  // AttnArgs::stages
  bool dependent;  // launched as a programmatic dependent of the kernel before it
};

// The tensor-core kernel's dynamic shared memory: its warps' outputs for the merge, or, where
// it stages K/V steps, that many steps per warp, which the outputs reuse after the loop.
size_t mma_smem_bytes(int head_dim, int warps, int stages) {
  const size_t outputs = (size_t)warps * kMaxGroupTile * head_dim * sizeof(float);
  const size_t staged = (size_t)stages * warps * 2 * kMmaRows * head_dim * sizeof(__half);
  return staged > outputs ? staged : outputs;
}

// Steps per warp a staged image keeps in flight: as many as fit with mma_min_blocks() blocks
// on an SM, from 2 (fewer resident blocks rather than no overlap) up to kMmaMaxStages; 0 where
// not even two fit in a block (one step staged at a time would not overlap loads with math).
int mma_stages_for(const m40llm_cuda_state *st, int head_dim, int warps, size_t static_smem) {
  const size_t step = mma_smem_bytes(head_dim, warps, 1);
  const size_t block_max = st->smem_per_block - static_smem;
  const size_t per_block = st->smem_per_sm / mma_min_blocks(head_dim, warps);
  const size_t share = per_block > st->smem_reserved_per_block + static_smem
                           ? per_block - st->smem_reserved_per_block - static_smem
                           : 0;
  int stages = (int)(share / step);
  if (stages < 2) stages = 2;
  if (stages > kMmaMaxStages) stages = kMmaMaxStages;
  while (stages > 0 && mma_smem_bytes(head_dim, warps, stages) > block_max) stages--;
  return stages >= 2 ? stages : 0;
}

// The tensor-core kernel, staged or not, where this build has it for this GPU (sm_80+; a
// compute_52-only build runs the FP32 kernel on every GPU, and only sm_90+ images stage). The
// first call per kernel sizes its shared memory and asks its occupancy. No kernel: null.
int mma_pass(m40llm_cuda_state *st, int head_dim, bool staged, int warps, SplitPass *out) {
  *out = SplitPass{nullptr, 32 * warps, 0, kMmaRows * warps, 0, 0, false};
  const SplitKernel k = attn_mma_kernel_for(head_dim, staged, warps);
  if (!k || st->cc_major < (staged ? 9 : 8) || (staged && !M40LLM_MMA_BULK_BUILT))
    return M40LLM_OK;
  auto &info = st->mma[staged][warps < mma_warps(head_dim)][head_dim / 16];
  if (info.usable == 0) {
    cudaFuncAttributes attr;
    M40LLM_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
    const int stages = staged ? mma_stages_for(st, head_dim, warps, attr.sharedSizeBytes) : 0;
    if (attr.ptxVersion < (staged ? 90 : 80) || (staged && stages == 0)) {
      info.usable = -1;
      return M40LLM_OK;
    }
    const size_t smem = mma_smem_bytes(head_dim, warps, stages);
    M40LLM_CUDA_TRY(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int occ = 0;
    M40LLM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, 32 * warps, smem));
    info.usable = 1;
    info.stages = (signed char)stages;
    info.smem = (int)smem;
    info.occupancy = occ > 1 ? occ : 1;
    info.dependent = attr.ptxVersion >= 90;
  }
  if (info.usable < 0) return M40LLM_OK;
  out->kernel = k;
  out->smem = (size_t)info.smem;
  out->stages = info.stages;
  out->target = st->sm_count * info.occupancy * kMmaWaves;
  out->dependent = info.dependent;
  return M40LLM_OK;
}

// Whether attention.cu's kernels may launch as programmatic dependents: sm_90+, where this
// build's images there have the wait (a compute_52-only build's have not). One file is built
// for one architecture list, so the combine kernel's image answers for the FP32 split kernel's.
int attention_cu_dependent(m40llm_cuda_state *st, bool *out) {
  if (st->dependent == 0) {
    st->dependent = -1;
    if (st->cc_major >= 9) {
      cudaFuncAttributes attr;
      M40LLM_CUDA_TRY(cudaFuncGetAttributes(&attr, attn_combine_kernel));
      if (attr.ptxVersion >= 90) st->dependent = 1;
    }
  }
  *out = st->dependent > 0;
  return M40LLM_OK;
}

// Launches a kernel, as a programmatic dependent of the kernel before it where `dependent`.
template <typename Kernel>
int launch(m40llm_cuda_state *st, const char *what, Kernel kernel, dim3 grid, int threads,
           size_t smem, bool dependent, const AttnArgs &a, const m40llm_attn_plan &plan) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st->stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, a, plan);
  return err == cudaSuccess ? M40LLM_OK : m40llm_cuda_error(err, what);
}

int launch_combine(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan,
                   int n_seqs, int n_heads) {
  bool dependent = false;
  const int rc = attention_cu_dependent(st, &dependent);
  if (rc != M40LLM_OK) return rc;
  const bool few = plan.max_splits <= kCombineFewSplits && a.head_dim <= kCombineFewMaxDim;
  if (few) {
    const dim3 grid((unsigned)n_seqs, (unsigned)((n_heads + kCombineFewHeads - 1) / kCombineFewHeads));
    return launch(st, "launching attn_combine_few_kernel", attn_combine_few_kernel, grid,
                  32 * kCombineFewHeads, 0, dependent, a, plan);
  }
  return launch(st, "launching attn_combine_kernel", attn_combine_kernel,
                dim3((unsigned)n_seqs, (unsigned)n_heads), kCombineThreads, 0, dependent, a, plan);
}

// The split passes for a cache: the tensor-core kernel where this build and GPU have it (from
// kMmaMinGroup query heads per K/V head: MHA too by default), else the FP32 kernel.
//   pass    the kernel for plans that fit: mma_warps() warps a block, at head_dims
//           kMmaStagedMinDim..kMmaStagedMaxDim with K/V staged where the GPU can
//   direct  the same loading through registers, for plans whose splits are too short for
//           staging to pay
//   fine    the same in blocks of half the warps, for plans of more blocks than a wave
// Each is the one before it where there is no other.
struct SplitPasses {
  SplitPass pass, direct, fine;
};

int split_passes_for(m40llm_cuda_state *st, const m40llm_kvcache_options *o, const Grouping &g,
                     SplitPasses *p) {
  bool cu_dependent = false;  // asked before any launch of a call, the combine's included
  int rc = attention_cu_dependent(st, &cu_dependent);
  if (rc != M40LLM_OK) return rc;
  if (g.group >= kMmaMinGroup) {
    const int hd = o->head_dim, warps = mma_warps(hd);
    const bool stage = hd >= kMmaStagedMinDim && hd <= kMmaStagedMaxDim;
    rc = mma_pass(st, hd, false, warps, &p->direct);
    if (rc == M40LLM_OK && p->direct.kernel && stage) rc = mma_pass(st, hd, true, warps, &p->pass);
    if (rc == M40LLM_OK && p->direct.kernel) rc = mma_pass(st, hd, false, warps / 2, &p->fine);
    if (rc != M40LLM_OK) return rc;
    if (p->direct.kernel) {
      if (!stage || !p->pass.kernel) p->pass = p->direct;
      if (!p->fine.kernel) p->fine = p->direct;
      return M40LLM_OK;
    }
  }
  SplitPass &pass = p->pass;
  pass = SplitPass{split_kernel_for(g.gt, o->head_dim), kAttnThreads,
                   split_smem_bytes(g.gt, o->head_dim), tile_rows(g.gt, dmax_for(o->head_dim)),
                   0, 0, cu_dependent};
  int &occ = st->occupancy[log2_small(g.gt)][o->head_dim / 8];
  if (occ == 0) {
    M40LLM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, pass.kernel,
                                                                  pass.threads, pass.smem));
    if (occ < 1) occ = 1;
  }
  pass.target = st->sm_count * occ * kAttnWaves;
  p->direct = p->fine = pass;
  return M40LLM_OK;
}

int ensure_workspace(m40llm_context *ctx, size_t bytes) {
  m40llm_cuda_state *st = ctx->cuda;
  if (bytes <= st->workspace_bytes) return M40LLM_OK;
  M40LLM_CUDA_TRY(cudaStreamSynchronize(st->stream));
  M40LLM_CUDA_TRY(cudaFree(st->workspace));
  st->workspace = nullptr;
  st->workspace_bytes = 0;
  void *p = nullptr;
  M40LLM_CUDA_TRY(cudaMalloc(&p, bytes));
  st->workspace = p;
  st->workspace_bytes = bytes;
  return M40LLM_OK;
}

size_t partial_bytes(int splits, int n_heads, int head_dim) {
  return (size_t)splits * n_heads * ((size_t)head_dim + 2) * sizeof(float);
}

}  // namespace

extern "C" int m40llm_cuda_reserve_for(m40llm_kvcache *c) {
  M40LLM_CUDA_ENTER(c->ctx);
  const m40llm_kvcache_options *o = &c->opts;
  const Grouping g = grouping_for(o);
  SplitPasses p;
  const int rc = split_passes_for(c->ctx->cuda, o, g, &p);
  if (rc != M40LLM_OK) return rc;
  // The bound attention_plan.h promises, for any pass's plans.
  int target = p.pass.target > p.direct.target ? p.pass.target : p.direct.target;
  if (p.fine.target > target) target = p.fine.target;
  const int max_splits = 3 * ((target + g.units - 1) / g.units) + 1;
  return ensure_workspace(c->ctx, partial_bytes(max_splits, o->n_heads, o->head_dim));
}

extern "C" int m40llm_cuda_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                                     const int32_t *lens, int n_seqs, const float *q, float *out,
                                     float scale) {
  m40llm_context *ctx = c->ctx;
  M40LLM_CUDA_ENTER(ctx);
  m40llm_cuda_state *st = ctx->cuda;
  const m40llm_kvcache_options *o = &c->opts;
  const Grouping g = grouping_for(o);

  SplitPasses passes;
  int rc = split_passes_for(st, o, g, &passes);
  if (rc != M40LLM_OK) return rc;
  SplitPass pass = passes.pass;
  m40llm_attn_plan plan;
  const auto build = [&] {
    const int min_chunk = kSplitRowsPerHead * g.gt > pass.tile ? kSplitRowsPerHead * g.gt : pass.tile;
    m40llm_attn_plan_build(&plan, seq_ids, lens, n_seqs, g.units, pass.target, st->sm_count,
                           min_chunk, pass.tile);
  };
  build();
  if (pass.stages > 0 && plan.chunk < kMmaStagedMinSteps * pass.tile) {
    pass = passes.direct;  // as many blocks as it fits: its splits are no longer
    build();
  }
  if (pass.stages == 0 && passes.fine.threads < pass.threads && plan.chunk <= kMmaFineMaxChunk &&
      (int64_t)plan.total_splits * g.units > pass.target) {
    pass = passes.fine;
    build();
  }

  AttnArgs a;
  const size_t layer_offset = m40llm_kv_offset(o, layer, 0, 0, 0);
  a.k = reinterpret_cast<const __half *>(c->k) + layer_offset;
  a.v = reinterpret_cast<const __half *>(c->v) + layer_offset;
  a.q = q;
  a.out = out;
  a.part_o = a.part_m = a.part_l = nullptr;
  if (plan.max_splits > 1) {
    rc = ensure_workspace(ctx, partial_bytes(plan.total_splits, o->n_heads, o->head_dim));
    if (rc != M40LLM_OK) return rc;
    const size_t n_part = (size_t)plan.total_splits * o->n_heads;
    a.part_o = static_cast<float *>(st->workspace);
    a.part_m = a.part_o + n_part * o->head_dim;
    a.part_l = a.part_m + n_part;
  }
  a.seq_stride = (size_t)o->n_kv_heads * o->max_seq_len * o->head_dim;
  a.head_stride = (size_t)o->max_seq_len * o->head_dim;
  a.n_heads = o->n_heads;
  a.group = g.group;
  a.head_tiles = g.head_tiles;
  a.head_dim = o->head_dim;
  a.q_scale = scale * kLog2e;
  a.stages = pass.stages;

  const dim3 grid((unsigned)plan.total_splits, (unsigned)g.units);
  rc = launch(st, "launching the attention split kernel", pass.kernel, grid, pass.threads,
              pass.smem, pass.dependent, a, plan);
  if (rc != M40LLM_OK) return rc;
  if (plan.max_splits > 1) return launch_combine(st, a, plan, n_seqs, o->n_heads);
  return M40LLM_OK;
}
