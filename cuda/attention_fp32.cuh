// The FP32 split kernel: one FP32 query row per sequence against that sequence's K/V, FP32
// arithmetic throughout (sm_52 has no fast half math), on every GPU; the M40's kernel.
//
// One block per (sequence, split of its positions, K/V head, tile of that head's query heads).
// It walks its positions in tiles with an online softmax, so shared memory does not grow with
// the context. Every K/V row is read once per block and serves all the block's query heads
// (GQA). A sequence with one split writes its output directly; otherwise the block writes
// (max, sum, unnormalised output) partials for the combine (attention_combine.cu).
//
// Scores live in the log2 domain (q is pre-multiplied by scale * log2(e)) so exp is exp2f.
//
// The template and its helpers; attention_fp32.cu instantiates it for the plain calls,
// attention_fp32_scores.cu for the calls with weights (each half of the instances in a
// translation unit of its own, so that builds compile them in parallel).
#pragma once

#include <math.h>

#include "attention.cuh"

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

// Sums each of the N values of acc over LPR adjacent lanes (both powers of two): each halving
// sends half the values a lane holds and keeps the other half, so N heads take N - 1 +
// log2(LPR / N) shuffles, not N log2(LPR). N <= LPR: returns value k_lane / (LPR / N). N > LPR:
// leaves values k_lane x (N / LPR) + i in acc[i], i < N / LPR (and returns acc[0]).
template <int N, int LPR>
__device__ __forceinline__ float lane_sums(float (&acc)[N], int k_lane) {
#pragma unroll
  for (int n = N, off = LPR / 2; n > 1 && off > 0; n >>= 1, off >>= 1) {
    const bool upper = k_lane & off;  // keeps the upper half of its n values
#pragma unroll
    for (int i = 0; i < n / 2; i++) {
      const float send = upper ? acc[i] : acc[i + n / 2];
      const float keep = upper ? acc[i + n / 2] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
  float x = acc[0];
#pragma unroll
  for (int off = LPR / N / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Scores for m40llm_kvcache_attn_weights_ex come from instances of their own (kScores): a
// branch on plan.weights in the tile loop cost the sm_52 kernels 3-5% more issue slots and made
// some spill, a tax on every call for what a few ask for.

// Shared memory of the split kernel, in floats: q [GT][D] and the weight tile [T][GT] while
// looping; then the per-row-group output partials [row_groups][GT][D] for the final reduction.
__host__ __device__ constexpr int pv_row_groups(int head_dim, int cols) {
  return kAttnThreads / (head_dim / cols);
}
// Where a thread holds 32 accumulators (8 heads x 4 V columns), the upper half of the row groups
// adds its partials into the lower half's before the reduction: 16 KB at head_dim 128 and 256,
// not 32, which would leave sm_52 3 blocks an SM where the registers allow 4.
__host__ __device__ constexpr bool halve_partials(int gt, int cols) { return gt * cols >= 32; }
__host__ __device__ constexpr int partial_row_groups(int head_dim, int cols, int gt) {
  return pv_row_groups(head_dim, cols) / (halve_partials(gt, cols) ? 2 : 1);
}

// Formats with a min (Q4, Q3, Q2) are dequantized in registers, value = factor x scale + min,
// one FMA an element from the biased factors (kv_format.cuh: no FP32 instruction to widen them):
// K always (a chunk's 8 FMAs, against the sums' subtract an element and 2 multiply-adds a head),
// and V where a row's COLS columns are fewer than twice its GT heads (against GT multiplies of
// the weights by the scale and GT multiply-adds of the min's sum, o_min, a row; at 2 heads and 4
// columns the sum took fewer slots on sm_52). The sums keep exact codes: over biased ones they
// would cancel kBias x sum(w) against the min.
template <typename F>
__host__ __device__ constexpr bool dequant_v(int gt, int cols) {
  return F::kHasMin && cols < 2 * gt;
}

// A group's factors as the kernel multiplies them, with the scale and the min that go with them:
// biased where the kernel dequantizes (kBiased), else exact codes.
template <typename F, bool kBiased, int N, typename R>
__device__ __forceinline__ void factors(const R &raw, float (&f)[N], float &scale, float &min) {
  scale = F::template scale<N>(raw);
  min = F::template min<N>(raw);
  if constexpr (kBiased && F::kHasMin) {
    F::template widen_biased<N>(raw, f);
    min = fmaf(-F::kBias, scale, min);
  } else {
    F::template widen<N>(raw, f);
  }
}

// 8-head tiles of 64 registers (not wide) whose K and V both have a min spill at a compile-time
// head_dim on sm_52: they take the run-time one's kernel (kernel_for_d).
__host__ __device__ constexpr bool narrow_both_min_spills(int gt) { return gt > 4; }

// V columns a thread of a kernel over V format VF takes (tuning.cuh's pv_columns; a wide tile
// over a V of 4 bits or fewer takes 4: whole bytes of each plane, which a cursor loads, and
// fewer parameters and loads a value).
template <typename VF>
__host__ __device__ constexpr int v_columns(int gt, int dmax, bool exact) {
  if constexpr (VF::kScaled) {
    return wide_tile(gt, dmax, exact) && VF::kCodeBits <= 4 ? 4 : pv_columns(gt, exact);
  } else {
    return pv_columns(gt, false);
  }
}

// Quantized tiles at a compile-time head_dim take twice the rows on sm_5x/6x (tuning.cuh's
// tile_rows): up to 4 heads, except where V is Q8 beside 4 heads (its 32 + 8 bytes of codes and
// scales a thread spilled, 3-6% slower: compute_52 on an H100, B8 32/8 D128 L8K); and wide 8-head
// tiles, F16 ones too, whose score pass's two rows a lane (score_rows) start from 4 chunks of a
// row a lane (over a Q4 V at head_dim 128, before the two rows, they were 0.99-1.02x the time;
// with them 0.87-0.95x).
template <typename P>
__host__ __device__ constexpr bool dense_tiles(int gt, int dmax, bool exact) {
  if constexpr (P::K::kScaled || P::V::kScaled) {
    return exact && (gt <= 2 || (gt <= 4 && P::V::kCodeBits < 8) || wide_tile(gt, dmax, exact));
  } else {
    return wide_tile(gt, dmax, exact);
  }
}

// cols: the kernel's V columns a thread (v_columns); dense: dense_tiles.
constexpr int split_smem_floats(int gt, int dmax, int head_dim, int cols, bool dense) {
  return gt * (dmax + tile_rows(gt, dmax, false, false, dense)) >
                 partial_row_groups(head_dim, cols, gt) * gt * head_dim
             ? gt * (dmax + tile_rows(gt, dmax, false, false, dense))
             : partial_row_groups(head_dim, cols, gt) * gt * head_dim;
}

// Where the q of head g keeps dim d in shared memory: [GT][2][DMAX / 8][4], dims 0-3 of every
// 8-dim chunk, then dims 4-7, so the lanes of a K row read consecutive 16-byte words (no bank
// conflicts), at compile-time offsets.
template <int DMAX>
struct QIndex {
  __device__ int operator()(int d) const { return (d & 4 ? DMAX / 2 : 0) + (d >> 3) * 4 + (d & 3); }
};

// A thread's walk over K or V, advanced by whole quantization groups. kAddresses: the format's
// Cursor (addresses: loads at constant offsets, no index arithmetic; on sm_52 a quantized load
// from an index costs about 10 integer instructions), else its Ptr (an index: 2 registers where
// a quantized cursor takes 4; 8-head tiles of 64 registers spill with cursors).
template <typename F, bool kAddresses>
struct Walk;
template <typename F>
struct Walk<F, true> {
  typename F::Cursor c;
  __device__ Walk(const KvPlanes &t, typename F::Ptr p) : c(F::cursor(t, p)) {}
  __device__ void step(ptrdiff_t n) { c = F::step(c, n); }
  template <int N>
  __device__ typename F::template Raw<N> load(const KvPlanes &, int n) const {
    return F::template load_at<N>(c, n);
  }
};
template <typename F>
struct Walk<F, false> {
  typename F::Ptr p;
  __device__ Walk(const KvPlanes &, typename F::Ptr p_) : p(p_) {}
  __device__ void step(ptrdiff_t n) { p = F::add(p, n); }
  template <int N>
  __device__ typename F::template Raw<N> load(const KvPlanes &t, int n) const {
    return F::template load<N>(t, p, n);
  }
};

// Kernels of up to 4 heads, or a wide tile (tuning.cuh), at a head_dim of its class: address
// walks, no per-row branch, and for a quantized cache the kept parts of protected tokens in the
// same launch (8-head tiles in 64 registers and runtime head_dims spill with any of these on
// sm_52).
__host__ __device__ constexpr bool lean_kernel(int gt, int dmax, bool exact) {
  return (gt <= 4 || wide_tile(gt, dmax, exact)) && exact;
}

// A lean quantized kernel's split as runs of rows: runs[0] the codes' positions, runs[1-3] the
// kept parts' FP16 slot rows ([begin, end), empty where begin >= end). A split of a PARTS or TIER
// plan is one run (a kept part's where kept); a MIXED plan's (mixed) cuts its range of the
// item's rows, numbered as attention_plan.h says (the kept rows, then the codes), into them.
__device__ __forceinline__ void split_runs(const m40llm_attn_plan &plan, bool mixed, int item,
                                           int p_begin, int p_end, bool kept, int (&runs)[4][2]) {
  if (!mixed) {
#pragma unroll
    for (int k = 0; k < 4; k++) runs[k][0] = runs[k][1] = p_begin;
    runs[kept ? 1 : 0][1] = p_end;
    return;
  }
  m40llm_attn_parts parts =
      m40llm_attn_item_parts(plan.len[item], plan.window_begin[item], plan.sinks, plan.window);
  // Where the kept slots are one run (a full ring, or one from the ring's start: all but after a
  // truncation), the kept rows are taken in slot order, as one part: a split's tiles then end at
  // fewer part boundaries.
  if (parts.count[1] + parts.count[2] == plan.window ||
      (parts.first[1] == plan.sinks && parts.count[2] == 0)) {
    parts.count[0] += parts.count[1] + parts.count[2];
    parts.count[1] = parts.count[2] = 0;
  }
  int r = 0;  // the part's first row in the split's numbering
#pragma unroll
  for (int k = 0; k < 4; k++) {
    const int lo = max(p_begin, r), hi = max(min(p_end, r + parts.count[k]), lo);
    runs[(k + 1) % 4][0] = parts.first[k] + lo - r;
    runs[(k + 1) % 4][1] = parts.first[k] + hi - r;
    r += parts.count[k];
  }
}

// P: the KvPair of K and V formats. GT: query heads per block (power of two <= kMaxGroupTile);
// heads past the group get a zero q and are never written. DMAX: head_dim class (head_dim <=
// DMAX, a multiple of 8).
//
// Quantized formats: a lane's 8-dim K chunk and a thread's COLS V columns lie in one group, so
// the scale (and min) apply once per chunk: Q8's score += scale * (q . codes), and o += (w *
// scale) * codes (or scaled codes) with sum(w * min) kept apart and added to o at the end where
// V has a min and is not dequantized (dequant_v).
//
// Rotated K/V (a.rot_k, a.rot_v): q is rotated on its way into shared memory and the output
// back before it is stored, a warp a head (rotation.cuh). Protected tokens: a lean kernel reads
// the FP16 slots itself, the kept rows in the codes' splits (M40LLM_PLAN_MIXED) or, where the
// splits are short (kFp32MixedMinRows), it exports scores or it runs a tier's launch, in splits
// of their own (M40LLM_PLAN_PARTS, M40LLM_PLAN_TIER); otherwise the plan gives them splits of
// their own (m40llm_attn_plan_protect) and a call is two launches over it, the F16 instance for
// the FP16 slots, then this kernel for the codes, and each block of a split that is the other
// launch's returns at once.
template <typename P, int GT, int DMAX, bool kExact, bool kScores>
__global__ void __launch_bounds__(kAttnThreads, attn_min_blocks(wide_tile(GT, DMAX, kExact)))
    attn_fp32_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
  constexpr bool kQuant = P::K::kScaled || P::V::kScaled;
  constexpr bool kWide = wide_tile(GT, DMAX, kExact);
  constexpr int T = tile_rows(GT, DMAX, kQuant && !kExact, kWide, dense_tiles<P>(GT, DMAX, kExact));
  constexpr int KR = score_rows(kWide, T, DMAX);  // K rows a lane takes in the score pass
  constexpr int LPR = kAttnThreads * KR / T;  // lanes per K row in the score pass (2..16)
  constexpr int KC = DMAX / 8 / LPR;          // 16-byte K chunks per lane, at most
  // V columns per thread in the output pass (split_smem_floats sizes for them: wide_v)
  constexpr int COLS = v_columns<typename P::V>(GT, DMAX, kExact);
  constexpr int VR = T * DMAX / (kAttnThreads * COLS);  // V rows per thread, at most
  constexpr int GH = heads_per_pass(GT, kWide);  // heads a score or output pass takes at once
  constexpr int kSoftPasses = (GT * T + kAttnThreads - 1) / kAttnThreads;  // softmax, per thread
  using KF = typename P::K;
  using VF = typename P::V;
  constexpr bool kLean = lean_kernel(GT, DMAX, kExact);
  // A block of a lean quantized kernel walks runs of rows of two pairs of tensors, the codes and
  // the FP16 slots, one tile loop after the other: their thread coordinates are read afresh for
  // each (held through the first loop for the second, they spilled on sm_52).
  constexpr bool kRuns = kLean && kQuant;
  // The softmax rescales lazily in wide tiles, whose 8 heads' scores made it 11% of a tile's
  // issue slots. Tiles of up to 4 heads keep the eager pass: in their 64 registers the lazy one
  // ran 2-4% slower through the compute_52 PTX on an H100 (group 4, head_dim 128). So do the
  // instances that export scores: natively (sm_90), B8 8/1 D256 L8K with weights, one block an
  // SM, went from 95 to 109 us with it.
  constexpr bool kLazy = kWide && !kScores;
  // Scores at a tier's slot map's positions: tiers are of quantized pairs, so F16's instances
  // (which run kept parts only in a tiered call) leave the map's cost out of every score. The
  // same map masks a tier's rows at or past the item's full_len (a causal call's query row sees
  // the positions before its own and its own only; in a decode call every row is before it).
  constexpr bool kMapped = kScores && KF::kScaled && VF::kScaled;
  static_assert(LPR >= 2 && LPR <= 32 && KC >= 1 && T <= 32, "tile shape");
  static_assert(KR == 1 || kLean, "a lane's second row is checked against the tile's end only "
                                  "where rows past it read as zeros");

  extern __shared__ float smem[];
  __shared__ SoftmaxState s_state[GT];
  __shared__ __align__(16) float s_alpha[GT];
  __shared__ float s_lsum[kLazy ? GT * T : 1];  // each (head, tile row)'s share of its sum
  __shared__ long long s_scores;  // plan.weights: where row p_begin of the block's first head goes
  __shared__ int s_split;         // M40LLM_PLAN_TIER: the block's split in the call
  __shared__ const int32_t *s_map;  // a tier's rows: their positions, or null
  __shared__ int s_limit;           // with s_map: the first position the item does not see
  // A lean quantized kernel's kept runs of rows (split_runs' 1-3: FP16 slot rows); s_slot0: the
  // block's first FP16 slot.
  __shared__ int s_runs[kRuns ? 3 : 1][2];
  __shared__ size_t s_slot0;
  const int D = kExact ? DMAX : a.head_dim;  // compile-time offsets where head_dim is its class's
  float *sq = smem;              // q, pre-scaled into the log2 domain, at QIndex<DMAX>
  float *sp = smem + GT * DMAX;  // [T][GT]: a position's weights for every head together
  const int tid = threadIdx.x;

  const SplitBlock<P> b = split_block<P, true, true, false>(a, plan, GT);
  if (tid == 0 && plan.role == M40LLM_PLAN_TIER) s_split = tier_split_number(plan);
  wait_for_prerequisite_grid();
  // The other launch's rows. (After the wait: a grid all of whose blocks return must still end
  // after the grid before it, which a programmatic dependent of it relies on.)
  if (b.skip) return;
  if (plan.max_splits > 1) allow_dependent_launch();  // the combine kernel: see below
  write_appended_row<P>(a, plan, b);
  const int p_begin = b.p_begin, p_end = b.p_end, nh = b.nh;

  const float *q = a.q + ((size_t)b.item * a.n_heads + b.h0) * D;
  if (a.rot_k) {  // a warp a head, rotated in registers on the way in
    for (int g = tid >> 5; g < GT; g += kAttnThreads / 32) {
      float v[DMAX / 32];
#pragma unroll
      for (int e = 0; e < DMAX / 32; e++) {
        const int d = (tid & 31) + 32 * e;
        v[e] = g < nh && d < D ? q[g * D + d] * a.q_scale : 0.0f;
      }
      warp_rotate(v, D, a.rot_scale);
#pragma unroll
      for (int e = 0; e < DMAX / 32; e++) {
        const int d = (tid & 31) + 32 * e;
        if (d < D) sq[g * DMAX + QIndex<DMAX>()(d)] = v[e];
      }
    }
  } else {
    for (int i = tid; i < GT * D; i += kAttnThreads) {
      const int g = i / D, d = i % D;
      sq[g * DMAX + QIndex<DMAX>()(d)] = g < nh ? q[i] * a.q_scale : 0.0f;
    }
  }
  if (tid < GT) s_state[tid] = SoftmaxState::empty();
  if (kLazy)
    for (int i = tid; i < GT * T; i += kAttnThreads) s_lsum[i] = 0.0f;
  // Exported scores (m40llm_kvcache_attn_weights_ex): the block's place in the caller's rows
  // from shared memory, so that no register holds it through the loop when there are none.
  if (kScores && tid == 0) {
    s_scores = ((long long)b.item * a.n_heads + b.h0) * plan.weights_stride +
               split_pos_shift(plan, b.item, b.split);
    if (kMapped) {
      s_map = plan.role == M40LLM_PLAN_TIER && !b.kept
                  ? plan.map + (size_t)plan.seq[b.item] * plan.map_stride
                  : nullptr;
      s_limit = plan.full_len[b.item];
    }
  }

  // Score pass (a thread's k_row and k_lane: in the tile loop): LPR lanes per K row, each with
  // up to KC 16-byte chunks of it and of the rows T / KR, 2T / KR, ... after it.
  const int chunks = D / 8;
  // Output pass: COLS columns per thread; row groups stride over the tile's positions.
  const int pv_tpr = D / COLS;
  const int row_groups = kAttnThreads / pv_tpr;
  const int rg = tid / pv_tpr;
  const int col = (tid % pv_tpr) * COLS;
  const bool pv_active = rg < row_groups;
  constexpr bool kSumMin = VF::kHasMin && !dequant_v<VF>(GT, COLS);
  float o[GT][COLS];
  float o_min[kSumMin ? GT : 1];  // sum(w * min) over the rows, per head
#pragma unroll
  for (int g = 0; g < GT; g++) {
#pragma unroll
    for (int i = 0; i < COLS; i++) o[g][i] = 0.0f;
    if constexpr (kSumMin) o_min[g] = 0.0f;
  }

  // Per-thread walks, advanced a tile at a time: the loop body computes no 64-bit products,
  // and every step (a tile, a row group, a K chunk) is whole quantization groups.
  if constexpr (KF::kScaled) static_assert(LPR * 8 % KF::kGroup == 0, "K chunks a group apart");
  const ptrdiff_t tile_step = (ptrdiff_t)T * D;
  const int v_step = row_groups * D;

  // The tile loop over rows [begin, end) of one pair of tensors: the cache's K and V, or (a lean
  // kernel's kept rows) the FP16 slots. Inside it KF, VF and the min flags are that pair's; kw
  // and vw walk it from begin.
  const auto tiles = [&](auto k_format, auto v_format, auto kw, auto vw, int begin, int end) {
    const int tid = kRuns ? opaque_thread() : (int)threadIdx.x;
    const int k_row = tid / LPR, k_lane = tid % LPR;
    const int rg = tid / pv_tpr;
    const bool pv_active = rg < row_groups;
    const float *qp = sq + k_lane * 4;
    using KF = decltype(k_format);
    using VF = decltype(v_format);
    using KRaw = typename KF::template Raw<8>;
    using VRaw = typename VF::template Raw<COLS>;
    constexpr bool kDequantV = dequant_v<VF>(GT, COLS);
    // This run's rows add to o_min; every run's rescale scales it (the kernel's kSumMin).
    constexpr bool kRunSumMin = VF::kHasMin && !kDequantV;
    for (int t0 = begin; t0 < end; t0 += T, kw.step(tile_step), vw.step(tile_step)) {
      const int rows = min(T, end - t0);
      // Every load of the tile goes out before anything waits on one: one memory latency per
      // tile instead of one per row batch. kLean: rows past the tile's end read as zeros (every
      // format decodes them to 0): their scores are replaced by -inf and their weights are 0, so
      // the passes below need no per-row branch.
      KRaw kraw[KR][KC];
#pragma unroll
      for (int r = 0; r < KR; r++) {
#pragma unroll
        for (int j = 0; j < KC; j++) {
          const bool live = k_row + r * (T / KR) < rows && k_lane + j * LPR < chunks;
          if (live) kraw[r][j] = kw.template load<8>(a.k, r * (T / KR) * D + j * LPR * 8);
          else if (kLean) kraw[r][j] = KRaw{};
        }
      }
      VRaw vraw[VR];
      auto vwi = vw;  // a step a row: no product per row and tile
#pragma unroll
      for (int i = 0; i < VR; i++, vwi.step(v_step)) {
        const bool live = pv_active && rg + i * row_groups < rows;
        if (live) vraw[i] = vwi.template load<COLS>(a.v, 0);
        else if (kLean) vraw[i] = VRaw{};
      }
      __syncthreads();  // q is staged, and the previous tile's weights are consumed

#pragma unroll
      for (int g0 = 0; g0 < GT; g0 += GH) {
        float acc[KR][GH];
#pragma unroll
        for (int r = 0; r < KR; r++)
#pragma unroll
          for (int g = 0; g < GH; g++) acc[r][g] = 0.0f;
#pragma unroll
        for (int j = 0; j < KC; j++) {
          const int c = k_lane + j * LPR;
          if ((kLean || k_row < rows) && c < chunks) {  // q past head_dim is not staged
            float kf[KR][8], k_scale[KR], k_min[KR];
#pragma unroll
            for (int r = 0; r < KR; r++) {
              factors<KF, true>(kraw[r][j], kf[r], k_scale[r], k_min[r]);
              if constexpr (KF::kHasMin) {
#pragma unroll
                for (int i = 0; i < 8; i++) kf[r][i] = fmaf(kf[r][i], k_scale[r], k_min[r]);
              }
            }
#pragma unroll
            for (int g = 0; g < GH; g++) {
              const float *qg = qp + (g0 + g) * DMAX + j * LPR * 4;
              const float4 qa = *reinterpret_cast<const float4 *>(qg);
              const float4 qb = *reinterpret_cast<const float4 *>(qg + DMAX / 2);
#pragma unroll
              for (int r = 0; r < KR; r++) {
                constexpr bool kScaleSum = KF::kScaled && !KF::kHasMin;  // else kf holds values
                float s = kScaleSum ? 0.0f : acc[r][g];
                s = fmaf(qa.x, kf[r][0], s);
                s = fmaf(qa.y, kf[r][1], s);
                s = fmaf(qa.z, kf[r][2], s);
                s = fmaf(qa.w, kf[r][3], s);
                s = fmaf(qb.x, kf[r][4], s);
                s = fmaf(qb.y, kf[r][5], s);
                s = fmaf(qb.z, kf[r][6], s);
                s = fmaf(qb.w, kf[r][7], s);
                if constexpr (kScaleSum) s = fmaf(k_scale[r], s, acc[r][g]);
                acc[r][g] = s;
              }
            }
          }
        }
        // Each of a row's LPR / GH lane runs ends with one head's whole score (8 heads over 4
        // lanes: each lane with 2), row by row.
        constexpr int kRun = GH < LPR ? LPR / GH : 1, kPer = GH > LPR ? GH / LPR : 1;
#pragma unroll
        for (int r = 0; r < KR; r++) {
          const float score = lane_sums<GH, LPR>(acc[r], k_lane);
          const int row = k_row + r * (T / KR);
          if (k_lane % kRun == 0) {
#pragma unroll
            for (int i = 0; i < kPer; i++)
              sp[row * GT + g0 + k_lane / kRun * kPer + i] =
                  row < rows ? (kPer == 1 ? score : acc[r][i]) : -INFINITY;
          }
        }
      }
      __syncthreads();

      // Online softmax over the tile: a thread a (head, position), T adjacent lanes a head, so
      // that every lane of a busy warp has a weight to work out. Whether any head's max rose
      // comes back from the barrier: the output is rescaled only then (alpha is exactly 1
      // otherwise). kLazy: a head's max moves only when a score of the warp's heads passes it by
      // more than kSoftmaxSlack (its weights stay under 2^kSoftmaxSlack), so most tiles take no
      // reduction and no rescale, and each thread adds its position's weight to its own share of
      // the sum (s_lsum), summed once after the loop.
      bool raised = false;
#pragma unroll
      for (int pass = 0; pass < kSoftPasses; pass++) {
        const int i0 = (tid & ~31) + pass * kAttnThreads;
        if (i0 >= GT * T) break;  // whole warps: every lane of a busy one takes part
        const int i = i0 + (tid & 31);
        const bool mine = i < GT * T;
        const int g = mine ? i / T : 0, r = i % T;
        float x = mine ? sp[r * GT + g] : -INFINITY;
        if (kScores && mine && r < rows) {
          const int32_t *map = kMapped ? s_map : nullptr;
          const int pos = map ? map[t0 + r] : t0 + r;
          if (map && pos >= s_limit) x = -INFINITY;
          if (g < nh && plan.weights) plan.weights[s_scores + g * plan.weights_stride + pos] = x;
        }
        if constexpr (kLazy) {
          float m = s_state[g].m, alpha = 1.0f;
          if (__any_sync(0xffffffffu, x > m + kSoftmaxSlack)) {
            float tile_max = x;
#pragma unroll
            for (int off = T / 2; off > 0; off >>= 1)
              tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
            const float m_new = fmaxf(m, tile_max);
            alpha = exp2f(m - SoftmaxState::reference(m_new));
            m = m_new;
            raised |= mine && alpha != 1.0f;
            __syncwarp();  // every lane has read s_state[g] before its first lane replaces it
            if (mine && r == 0) s_state[g].m = m;
          }
          if (mine) {
            const float w = exp2_ftz(x - SoftmaxState::reference(m));
            sp[r * GT + g] = w;
            s_lsum[i] = fmaf(s_lsum[i], alpha, w);
            if (r == 0) s_alpha[g] = alpha;
          }
        } else {
          float tile_max = x;
#pragma unroll
          for (int off = T / 2; off > 0; off >>= 1)
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
          SoftmaxState st = s_state[g];
          const float alpha = st.raise(tile_max);
          const float w = st.weight(x);
          float sum = w;
#pragma unroll
          for (int off = T / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
          st.l += sum;
          raised |= mine && alpha != 1.0f;
          __syncwarp();  // every lane has read s_state[g] before its head's first lane replaces it
          if (mine) {
            sp[r * GT + g] = w;
            if (r == 0) {
              s_state[g] = st;
              s_alpha[g] = alpha;
            }
          }
        }
      }
      raised = __syncthreads_or(raised);

      if (pv_active) {
        if (raised) {
          float alpha[GT];
          load_weights<GT>(s_alpha, alpha);
#pragma unroll
          for (int g = 0; g < GT; g++) {
#pragma unroll
            for (int i = 0; i < COLS; i++) o[g][i] *= alpha[g];
            if constexpr (kSumMin) o_min[g] *= alpha[g];
          }
        }
#pragma unroll
        for (int i = 0; i < VR; i++) {
          const int r = rg + i * row_groups;  // past the tile only where head_dim < DMAX
          if (kLean ? kExact || r < T : r < rows) {
            float vf[COLS], v_scale, v_min;
            factors<VF, kDequantV>(vraw[i], vf, v_scale, v_min);
            if constexpr (kDequantV) {  // values in registers
#pragma unroll
              for (int c = 0; c < COLS; c++) vf[c] = fmaf(vf[c], v_scale, v_min);
            }
            // Otherwise the scale goes on whichever is fewer: this row's COLS codes, or its GT
            // weights.
            constexpr bool kScaleCodes = VF::kScaled && !kDequantV && COLS < GT;
            constexpr bool kScaleWeights = VF::kScaled && !kDequantV && !kScaleCodes;
            if constexpr (kScaleCodes) {
#pragma unroll
              for (int c = 0; c < COLS; c++) vf[c] *= v_scale;
            }
#pragma unroll
            for (int g0 = 0; g0 < GT; g0 += GH) {
              float w[GH];
              load_weights<GH>(sp + r * GT + g0, w);
#pragma unroll
              for (int g = 0; g < GH; g++) {
                const float wv = kScaleWeights ? w[g] * v_scale : w[g];
#pragma unroll
                for (int c = 0; c < COLS; c++) o[g0 + g][c] = fmaf(wv, vf[c], o[g0 + g][c]);
                if constexpr (kRunSumMin) o_min[g0 + g] = fmaf(w[g], v_min, o_min[g0 + g]);
              }
            }
          }
        }
      }
    }
  };
  // A run's walks from its first row (one pair of tensors: the cache's, or the FP16 slots).
  const auto run_tiles = [&](auto k_format, auto v_format, auto kp, auto vp, int begin, int end) {
    const int tid = kRuns ? opaque_thread() : (int)threadIdx.x;
    const int k_row = tid / LPR, k_lane = tid % LPR;
    const int rg = tid / pv_tpr;
    const int col = (tid % pv_tpr) * COLS;
    using KF = decltype(k_format);
    using VF = decltype(v_format);
    const size_t row = (size_t)begin * D;
    tiles(k_format, v_format,
          Walk<KF, kLean>(a.k, KF::add(kp, row + (size_t)k_row * D + k_lane * 8)),
          Walk<VF, kLean>(a.v, VF::add(vp, row + (size_t)rg * D + col)), begin, end);
  };
  if constexpr (kRuns) {
    // The codes' run first, its bounds in registers; the kept runs from shared memory (on sm_52
    // registers held through a tile loop are spilled), published by the codes' loop's barriers
    // (a barrier before the first tile's loads would wait out every thread's q loads).
    int runs[4][2];
    split_runs(plan, !kScores && plan.role == M40LLM_PLAN_MIXED, b.item, p_begin, p_end, b.kept,
               runs);
    if (tid == 0) {
#pragma unroll
      for (int k = 1; k < 4; k++) s_runs[k - 1][0] = runs[k][0], s_runs[k - 1][1] = runs[k][1];
      if (plan.kept_k)  // this layer's FP16 slots, [seq][kv_head][slot][dim]
        s_slot0 = ((size_t)plan.seq[b.item] * (a.n_heads / a.group) + block_kv_head()) *
                  (size_t)(plan.sinks + plan.window) * D;
    }
    if (runs[0][0] < runs[0][1]) run_tiles(KF{}, VF{}, b.k, b.v, runs[0][0], runs[0][1]);
    else __syncthreads();
#pragma unroll 1
    for (int k = 0; k < 3; k++) {
      const int begin = s_runs[k][0], end = s_runs[k][1];
      if (begin < end)
        run_tiles(KvF16{}, KvF16{}, static_cast<const __half *>(plan.kept_k) + s_slot0,
                  static_cast<const __half *>(plan.kept_v) + s_slot0, begin, end);
    }
  } else {
    run_tiles(KF{}, VF{}, b.k, b.v, p_begin, p_end);
  }
  // A one-pass plan's next kernel is most likely the next call's split kernel: let in any
  // earlier, its blocks would hold SM slots through this loop (B32 32/8 D64 L512 on an H100:
  // 14.4 us a call, 14.8 let in after the wait). A combine kernel is small: let in at once.
  if (plan.max_splits == 1) allow_dependent_launch();

  __syncthreads();  // q and weights are dead: reuse their space for the row-group reduction
  if (kLazy && tid < GT) {  // each head's sum from its rows' shares (the next barrier orders it)
    float l = 0.0f;
    for (int r = 0; r < T; r++) l += s_lsum[tid * T + r];
    s_state[tid].l = l;
  }
  float *red = smem;  // [partial row group][GT][D]
  constexpr bool kHalve = halve_partials(GT, COLS);
  const int red_groups = kHalve ? row_groups / 2 : row_groups;
  const int red_rg = rg < red_groups ? rg : rg - red_groups;
#pragma unroll
  for (int half = kHalve ? 1 : 0; half >= 0; half--) {  // kHalve: the upper row groups first
    if (pv_active && (rg >= red_groups) == (half == 1)) {
#pragma unroll
      for (int g = 0; g < GT; g++)
#pragma unroll
        for (int i = 0; i < COLS; i++) {
          float &x = red[(red_rg * GT + g) * D + col + i];
          const float mine = kSumMin ? o[g][i] + o_min[g] : o[g][i];
          x = kHalve && half == 0 ? x + mine : mine;
        }
    }
    __syncthreads();
  }
  // The block's coordinates again rather than kept in registers through the loop (on sm_52 they
  // would be spilled).
  SplitBlock<P> fin = split_block<P, false, false>(a, plan, GT);
  if (plan.role == M40LLM_PLAN_TIER) {  // from shared memory, as s_scores
    fin.split = s_split;
    fin.n_splits = plan.max_splits;
  }
  // With exported scores, attn_weights_kernel takes every split's (max, sum), a lone one too.
  if (kScores && fin.n_splits == 1 && tid < fin.nh)
    store_split_stats(a, fin.split, fin.h0 + tid, s_state[tid]);
  if (a.rot_v) {
    // The output rotated back from V's frame (the transform is linear: partials may be rotated
    // before the combine): the rows summed into row group 0's place, then a warp a head.
    for (int idx = tid; idx < fin.nh * D; idx += kAttnThreads) {
      float acc = 0.0f;
      for (int r = 0; r < red_groups; r++) acc += red[r * GT * D + idx];
      red[idx] = acc;
    }
    __syncthreads();
    for (int g = tid >> 5; g < fin.nh; g += kAttnThreads / 32) {
      float v[DMAX / 32];
#pragma unroll
      for (int e = 0; e < DMAX / 32; e++) {
        const int d = (tid & 31) + 32 * e;
        v[e] = d < D ? red[g * D + d] : 0.0f;
      }
      warp_rotate(v, D, a.rot_scale);
#pragma unroll
      for (int e = 0; e < DMAX / 32; e++) {
        const int d = (tid & 31) + 32 * e;
        if (d < D) store_split_result(a, fin, fin.h0 + g, d, v[e], s_state[g]);
      }
    }
    return;
  }
  for (int idx = tid; idx < fin.nh * D; idx += kAttnThreads) {
    const int g = idx / D, d = idx % D;
    float acc = 0.0f;
    for (int r = 0; r < red_groups; r++) acc += red[(r * GT + g) * D + d];
    store_split_result(a, fin, fin.h0 + g, d, acc, s_state[g]);
  }
}


int dmax_for(int head_dim) {
  for (int dmax : kHeadDimClasses)
    if (head_dim <= dmax) return dmax;
  return 256;
}

// A head_dim equal to its class's gets a kernel of its own (every offset a constant: fewer
// instructions and registers), except narrow_both_min_spills'. kScores: the instances that export
// scores.
template <typename P, int GT, int DMAX, bool kScores>
SplitKernel kernel_for_d(int head_dim) {
  if constexpr (wide_tile(GT, DMAX, true) ||
                !(P::K::kHasMin && P::V::kHasMin && narrow_both_min_spills(GT))) {
    if (head_dim == DMAX) return attn_fp32_kernel<P, GT, DMAX, true, kScores>;
  }
  return attn_fp32_kernel<P, GT, DMAX, false, kScores>;
}

template <typename P, int GT, bool kScores>
SplitKernel kernel_for_dmax(int dmax, int head_dim) {
  return dmax == 64    ? kernel_for_d<P, GT, 64, kScores>(head_dim)
         : dmax == 128 ? kernel_for_d<P, GT, 128, kScores>(head_dim)
                       : kernel_for_d<P, GT, 256, kScores>(head_dim);
}

template <typename P, bool kScores>
SplitKernel kernel_for(int gt, int head_dim) {
  const int dmax = dmax_for(head_dim);
  switch (gt) {
    case 1: return kernel_for_dmax<P, 1, kScores>(dmax, head_dim);
    case 2: return kernel_for_dmax<P, 2, kScores>(dmax, head_dim);
    case 4: return kernel_for_dmax<P, 4, kScores>(dmax, head_dim);
    default: return kernel_for_dmax<P, 8, kScores>(dmax, head_dim);
  }
}

}  // namespace

// The kernel of a plain call (attention_fp32.cu; a tier's pair that no uniform cache has:
// attention_fp32_tiers.cu), and of a call with weights (attention_fp32_scores.cu; the tier
// pairs': attention_fp32_tiers_scores.cu).
template <typename P>
SplitKernel fp32_plain_kernel(int gt, int head_dim) {
  return kernel_for<P, false>(gt, head_dim);
}
template <typename P>
SplitKernel fp32_scores_kernel(int gt, int head_dim) {
  return kernel_for<P, true>(gt, head_dim);
}
