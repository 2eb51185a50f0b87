// The FP32 causal kernels: several query rows per sequence against the positions each sees
// (m40llm_kvcache_attn_causal_f32q), FP32 arithmetic throughout, on every GPU (the M40's).
//
// A block holds a tile of BM query vectors (BR rows x GT heads of one K/V head's group) in
// shared memory and walks the positions they see in tiles of BN: each K tile and then V tile is
// decoded once into FP32 in shared memory (a protected position from its FP16 slot) and serves
// every query vector of the block. The output stays in registers and the online softmax runs
// per query vector. Tiles wholly visible to every row skip the mask; positions no row sees are
// never loaded. Scores are in the log2 domain (q is pre-multiplied by scale * log2(e)). At
// head_dim 64 a tile's loads are issued a pass early into registers (TileChunks: V's over the
// score pass, the next tile's K over the output pass), so that its latency is not waited out
// between two barriers; at 128 and 256 the registers are not there.
//
// Two kernels share that frame. At head_dim class 64, causal_warp_kernel: a warp takes
// kCausalWarpVectors query vectors, the same for every lane, against a tile of 32 positions, a
// lane each for the scores, then the vectors' outputs a few dims a lane. Its q and weight loads
// from shared memory are broadcasts, so each K or V word a lane loads serves 8 vectors' FFMAs,
// and a vector's softmax is one warp's shuffles in registers. At head_dim classes 128 and 256,
// and at 64 for items of few rows (speculative rows: a 64-vector block would be mostly empty),
// causal_wide_kernel: 16 query vectors a block, the tile in stages of up to 128 dims (at 256 q
// and a whole tile would pass 48 KB), each warp a quarter of a stage's dims for every score and
// 32 dims of the outputs, a lane 4 x 4 of each (its loads shared by 4 or 8 lanes: one
// shared-memory wavefront).
#include <math.h>

#include "attention_causal.cuh"

namespace {

// causal_wide_kernel's: 4 warps, BM = 16 query vectors, BN = 32 positions, the K/V tile in
// stages of DH dims (one at 64 and 128, two at 256); in a stage warp w takes dims [DW w, DW w +
// DW) of the scores, and 32 dims of the outputs (at 64, two warps, a half of the positions each).
// Rows are padded so that a warp's loads fall in distinct banks: q (4 rows a load) and K/V (8
// rows or 8 columns) by 4 floats, the partial scores ([warp][vector][position], written 4
// vectors x 8 positions a store) by 8, the weights ([position][vector], written 8 positions x 4
// vectors) by 4.
template <int DMAX>
struct WideShape {
  static constexpr int WARPS = 4, NT = 32 * WARPS;
  static constexpr int BM = kCausalWideVectors;
  static constexpr int BN = kCausalTile;
  static constexpr int DH = DMAX < 128 ? DMAX : 128, DW = DH / WARPS;
  static constexpr int LD = DMAX + 4;  // q
  static constexpr int LH = DH + 4;    // a K/V stage
  static constexpr int LP = BN + 8;    // partial scores
  static constexpr int LW = BM + 4;    // weights
  static constexpr int smem_floats() { return BM * LD + BN * LH + WARPS * BM * LP + BN * LW + BM; }
};

// causal_warp_kernel's: VW vectors a warp, BN = 32 positions (a lane each in the score pass),
// CPL output dims a lane; weight rows padded to a multiple of 4 (loaded 4 positions at a time).
template <int DMAX>
struct WarpShape {
  static constexpr int VW = kCausalWarpVectors;
  static constexpr int BM = kCausalVectorDims / DMAX;
  static constexpr int NT = 32 * BM / VW;
  static constexpr int BN = kCausalTile;
  static constexpr int LD = DMAX + 4;
  static constexpr int PS = BN + 4;
  static constexpr int CPL = DMAX / 32;
  static constexpr int smem_floats() { return BM * LD + BN * LD + BM * PS; }
};

// A protected cache's position p is read from its FP16 slot.
__device__ __forceinline__ bool kept_position(const CausalPlan &plan, int item, int p) {
  return p < plan.sinks || p >= plan.window_begin[item];
}

// A chunk of 8 dims as FP32, as the CPU reference decodes it: code x scale (+ min, in one
// rounding); or from its FP16 slot (a protected position: kept_position).
template <typename F>
__device__ __forceinline__ void widen_chunk(const typename F::template Raw<8> &raw, float (&f)[8]) {
  F::template widen<8>(raw, f);
  const float scale = F::template scale<8>(raw), mn = F::template min<8>(raw);
#pragma unroll
  for (int i = 0; i < 8; i++)
    if constexpr (F::kHasMin) f[i] = fmaf(f[i], scale, mn);
    else if constexpr (F::kScaled) f[i] *= scale;
}
__device__ __forceinline__ void kept_chunk(const __half *kept, const CausalPlan &plan, int p, int D,
                                           int c8, float (&f)[8]) {
  const uint4 r = __ldg(reinterpret_cast<const uint4 *>(
      kept + (size_t)m40llm_kv_protected_slot(plan.sinks, plan.ring, p) * D + c8));
  KvF16::widen<8>(r, f);
}

// 8 FP32 values to dst[0 .. 7] (16-byte aligned) as two 16-byte stores.
__device__ __forceinline__ void put_chunk(float *dst, const float (&f)[8]) {
  float4 *d4 = reinterpret_cast<float4 *>(dst);
  d4[0] = make_float4(f[0], f[1], f[2], f[3]);
  d4[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// Decodes dims d0 .. d0 + DC - 1 of positions t0 .. t0 + n - 1 of one K/V head (rows from
// `base`, FP16 slots from `kept` where the cache has them) into dst [BN][LD] as FP32; rows from n
// to BN and dims from head_dim become zeros (the score and output steps run whole). A thread
// takes the chunk of 8 dims c8 of rows RS apart (a compile-time walk: no division).
template <typename F, int NT, int BN, int DC, int LD>
__device__ __forceinline__ void load_tile(float *dst, const KvPlanes &planes,
                                          typename F::Ptr base, const __half *kept,
                                          const CausalPlan &plan, int item, int t0, int n, int D,
                                          int d0) {
  constexpr int CH = DC / 8, RS = NT / CH;
  static_assert(NT % CH == 0 && BN % RS == 0, "whole chunks a thread");
  const int row0 = threadIdx.x / CH, c8 = threadIdx.x % CH * 8, dim = d0 + c8;
  const typename F::Ptr tile = F::add(base, (size_t)t0 * D + row0 * D + dim);
#pragma unroll
  for (int it = 0; it < BN / RS; it++) {
    const int row = row0 + it * RS, p = t0 + row;
    float f[8];
    if (row >= n || dim >= D) {
#pragma unroll
      for (int i = 0; i < 8; i++) f[i] = 0.0f;
    } else if (kept && kept_position(plan, item, p)) {
      kept_chunk(kept, plan, p, D, dim, f);
    } else {
      widen_chunk<F>(F::template load<8>(planes, F::add(tile, (size_t)(it * RS * D)), 0), f);
    }
    put_chunk(dst + row * LD + c8, f);
  }
}

// load_tile in two halves, so that a tile's loads are in flight while the block computes on
// the one before: fetch() issues this thread's chunks of a whole tile (DC = head_dim's class)
// into registers as stored, store() decodes them into shared memory. A protected position's
// chunk is read from its FP16 slot in store() (a few positions a sequence: sinks and window).
// The caller walks the tiles' first rows (`tile`: position t0's) by additions, and `off` is the
// thread's first chunk from there: no 64-bit products a tile.
template <typename F, int NT, int BN, int DC>
struct TileChunks {
  static constexpr int CH = DC / 8, RS = NT / CH, IT = BN / RS;
  static_assert(NT % CH == 0 && BN % RS == 0, "whole chunks a thread");
  typename F::template Raw<8> raw[IT];
  int off;

  __device__ __forceinline__ explicit TileChunks(int D)
      : off(threadIdx.x / CH * D + threadIdx.x % CH * 8) {}

  __device__ __forceinline__ void fetch(const KvPlanes &planes, typename F::Ptr tile,
                                        const __half *kept, const CausalPlan &plan, int item,
                                        int t0, int n, int D) {
    const int row0 = threadIdx.x / CH, c8 = threadIdx.x % CH * 8;
    const typename F::Ptr first = F::add(tile, off);
#pragma unroll
    for (int it = 0; it < IT; it++) {
      const int row = row0 + it * RS;
      if (row < n && c8 < D && !(kept && kept_position(plan, item, t0 + row)))
        raw[it] = F::template load<8>(planes, F::add(first, it * RS * D), 0);
    }
  }

  template <int LD>
  __device__ __forceinline__ void store(float *dst, const __half *kept, const CausalPlan &plan,
                                        int item, int t0, int n, int D) const {
    const int row0 = threadIdx.x / CH, c8 = threadIdx.x % CH * 8;
#pragma unroll
    for (int it = 0; it < IT; it++) {
      const int row = row0 + it * RS, p = t0 + row;
      float f[8];
      if (row >= n || c8 >= D) {
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = 0.0f;
      } else if (kept && kept_position(plan, item, p)) {
        kept_chunk(kept, plan, p, D, c8, f);
      } else {
        widen_chunk<F>(raw[it], f);
      }
      put_chunk(dst + row * LD + c8, f);
    }
  }
};

// The block's K/V head's first element in the FP16 slots.
__device__ __forceinline__ size_t slot_base_of(const CausalArgs &a, const CausalPlan &plan,
                                               const CausalBlock &b) {
  return (size_t)plan.seq[b.item] * a.slot_seq_stride + (size_t)b.kvh * a.slot_head_stride;
}

// q of the block's vectors into sq [BM][LD], scaled into the log2 domain (rotated into K's frame
// where K is, a warp a vector), zeros past the block's rows and heads and past head_dim.
template <typename S, int GT, int DMAX>
__device__ __forceinline__ void stage_q(float *sq, const CausalArgs &a, const CausalBlock &b) {
  const int tid = threadIdx.x, D = a.head_dim;
  const float *qb = a.q + b.row_q * a.n_heads * D;
  if (a.rot_k) {
    for (int qi = tid >> 5; qi < S::BM; qi += S::NT / 32) {
      const int r = qi / GT, g = qi % GT;
      const bool on = r < b.nr && g < b.nh;
      float v[DMAX / 32];
#pragma unroll
      for (int e = 0; e < DMAX / 32; e++) {
        const int d = (tid & 31) + 32 * e;
        v[e] = on && d < D ? qb[((size_t)r * a.n_heads + b.h0 + g) * D + d] * a.q_scale : 0.0f;
      }
      warp_rotate(v, D, a.rot_scale);
#pragma unroll
      for (int e = 0; e < DMAX / 32; e++) sq[qi * S::LD + (tid & 31) + 32 * e] = v[e];
    }
  } else {
    for (int i = tid; i < S::BM * DMAX; i += S::NT) {
      const int qi = i / DMAX, d = i % DMAX, r = qi / GT, g = qi % GT;
      sq[qi * S::LD + d] = r < b.nr && g < b.nh && d < D
                               ? qb[((size_t)r * a.n_heads + b.h0 + g) * D + d] * a.q_scale
                               : 0.0f;
    }
  }
}

// The output rotated back from V's frame: so [BM][LD] holds each vector's (normalised where the
// plan has one split), written by the caller before a barrier; a warp takes a vector at a time
// and stores it through dst(qi, d).
template <typename S, int GT, int DMAX, typename Dst>
__device__ __forceinline__ void store_rotated(const float *so, const CausalArgs &a, int nr, int nh,
                                              Dst dst) {
  const int tid = threadIdx.x, D = a.head_dim;
  for (int qi = tid >> 5; qi < S::BM; qi += S::NT / 32) {
    if (qi / GT >= nr || qi % GT >= nh) continue;  // warp-uniform
    float v[DMAX / 32];
#pragma unroll
    for (int e = 0; e < DMAX / 32; e++) {
      const int d = (tid & 31) + 32 * e;
      v[e] = d < D ? so[qi * S::LD + d] : 0.0f;
    }
    warp_rotate(v, D, a.rot_scale);
#pragma unroll
    for (int e = 0; e < DMAX / 32; e++) {
      const int d = (tid & 31) + 32 * e;
      if (d < D) *dst(qi, d) = v[e];
    }
  }
}

// Head-dim class 64 (see the top of the file). Warp w takes vectors VW w .. VW w +
// VW - 1. Score pass: lane l takes the tile's position l against all of them (one 128-bit load
// of K for VW broadcast loads of q and 4 VW FFMAs). Softmax: a vector's max over the warp's
// lanes, the same on each; each lane keeps its own positions' share of the sum (one reduction at
// the end). Output pass: lane l takes dims CPL l .. CPL l + CPL - 1 of all VW vectors, 4
// positions at a time (a broadcast load of 4 weights a vector, 4 loads of V).
// P: the cache's KvPair. GT: query heads of the group a block takes (a power of two <= 8; heads
// past the group get a zero q and are never written). DMAX: the head-dim class.
template <typename P, int GT, int DMAX>
__global__ void __launch_bounds__(WarpShape<DMAX>::NT, kCausalWarpSmThreads / WarpShape<DMAX>::NT)
    causal_warp_kernel(const CausalArgs a, const CausalPlan plan) {
  using S = WarpShape<DMAX>;
  constexpr int BM = S::BM, BN = S::BN, LD = S::LD, PS = S::PS, VW = S::VW, CPL = S::CPL;
  constexpr int BR = BM / GT;  // query rows
  static_assert(BN == 32 && VW % GT == 0 && S::NT % 32 == 0, "a lane a position, whole rows a warp");
  static_assert(CPL == 2, "a lane's output dims: one 8-byte load a V row");
  using KF = typename P::K;
  using VF = typename P::V;
  constexpr int SD = kCausalWarpScoreDims, SN = kCausalWarpOutputRows;
  static_assert(DMAX % SD == 0 && SD % 4 == 0 && BN % SN == 0 && SN % 4 == 0, "whole steps");

  extern __shared__ float smem[];
  float *sq = smem;           // [BM][LD]: vector qi = r * GT + g (row r, head g)
  float *skv = sq + BM * LD;  // [BN][LD]: the K tile, then the V tile
  float *sp = skv + BN * LD;  // [BM][PS]: weights, each warp's rows its own
  const int lane = threadIdx.x & 31, v0 = VW * (threadIdx.x >> 5), D = a.head_dim;

  const CausalBlock b = causal_block<BR, GT>(a, plan);
  const int item = b.item, window = plan.window;
  const CausalRange span = causal_range(plan, b);
  const int first_pos = span.first_pos, last_pos = span.last_pos;
  const int kv_begin = span.kv_begin, kv_end = span.kv_end;

  wait_for_prerequisite_grid();
  stage_q<S, GT, DMAX>(sq, a, b);

  const size_t base = kv_base(a, plan, b), slot_base = slot_base_of(a, plan, b);
  const bool col_on = CPL * lane < D;
  SoftmaxState st[VW];  // m: the warp's; l: this lane's positions' share
  float o[VW][CPL];
#pragma unroll
  for (int v = 0; v < VW; v++) {
    st[v] = SoftmaxState::empty();
#pragma unroll
    for (int c = 0; c < CPL; c++) o[v][c] = 0.0f;
  }

  // The next tile's K is fetched over this tile's output pass, its V over the score pass.
  const auto kept_k = [&] { return a.kept_k ? a.kept_k + slot_base : nullptr; };
  const auto kept_v = [&] { return a.kept_v ? a.kept_v + slot_base : nullptr; };
  TileChunks<KF, S::NT, BN, DMAX> kc(D);
  TileChunks<VF, S::NT, BN, DMAX> vc(D);
  const size_t step = (size_t)BN * D;  // a tile's rows
  size_t at = base + (size_t)kv_begin * D;  // the tile's first row
  if (kv_begin < kv_end)
    kc.fetch(a.k, KF::at(a.k, at), kept_k(), plan, item, kv_begin, min(BN, kv_end - kv_begin), D);

  for (int t0 = kv_begin; t0 < kv_end; t0 += BN, at += step) {
    const int n = min(BN, kv_end - t0);
    // Every row sees every position of the tile: no mask.
    const bool full = n == BN && t0 + BN - 1 <= first_pos && (window == 0 || last_pos - t0 < window);
    __syncthreads();  // q is staged; the last tile's V is consumed
    kc.template store<LD>(skv, kept_k(), plan, item, t0, n, D);
    __syncthreads();
    vc.fetch(a.v, VF::at(a.v, at), kept_v(), plan, item, t0, n, D);

    float s[VW];
#pragma unroll
    for (int v = 0; v < VW; v++) s[v] = 0.0f;
    const float *kr = skv + lane * LD;
    const float *qw = sq + v0 * LD;
    // Steps of SD dims, each unrolled whole (dims past head_dim are zeros).
#pragma unroll 1
    for (int d0 = 0; d0 < D; d0 += SD) {
#pragma unroll
      for (int d = d0; d < d0 + SD; d += 4) {
        const float4 k4 = *reinterpret_cast<const float4 *>(kr + d);
#pragma unroll
        for (int v = 0; v < VW; v++) {
          const float4 q4 = *reinterpret_cast<const float4 *>(qw + v * LD + d);
          s[v] = fmaf(q4.x, k4.x, s[v]);
          s[v] = fmaf(q4.y, k4.y, s[v]);
          s[v] = fmaf(q4.z, k4.z, s[v]);
          s[v] = fmaf(q4.w, k4.w, s[v]);
        }
      }
    }
    // Vector v0 + v is row (v0 + v) / GT = v0 / GT + v / GT (v0 a multiple of GT).
    const int dist0 = first_pos + v0 / GT - (t0 + lane);  // query minus key position
#pragma unroll
    for (int v = 0; v < VW; v++) {
      const int dist = dist0 + v / GT;
      const bool seen = full || (lane < n && dist >= 0 && (window == 0 || dist < window));
      const float x = seen ? s[v] : -INFINITY;
      const float alpha = st[v].raise(warp_max(x));
      const float w = exp2_ftz(x - SoftmaxState::reference(st[v].m));
      st[v].l += w;
      sp[(v0 + v) * PS + lane] = w;
#pragma unroll
      for (int c = 0; c < CPL; c++) o[v][c] *= alpha;
    }
    __syncthreads();  // K is consumed (the weights are the warp's own: the barrier orders them too)
    vc.template store<LD>(skv, kept_v(), plan, item, t0, n, D);
    __syncthreads();
    if (t0 + BN < kv_end)
      kc.fetch(a.k, KF::at(a.k, at + step), kept_k(), plan, item, t0 + BN, min(BN, kv_end - t0 - BN),
               D);

    // Positions n .. BN - 1 have weight 0 and zero V rows: whole steps of SN positions, each
    // unrolled whole.
    if (col_on) {
      const float *vr = skv + CPL * lane;
      const float *pw = sp + v0 * PS;
#pragma unroll 1
      for (int j0 = 0; j0 < n; j0 += SN) {
#pragma unroll
        for (int j = j0; j < j0 + SN; j += 4) {
          float x[4][CPL];
#pragma unroll
          for (int i = 0; i < 4; i++) {
            const float2 c = *reinterpret_cast<const float2 *>(vr + (j + i) * LD);
            x[i][0] = c.x, x[i][1] = c.y;
          }
#pragma unroll
          for (int v = 0; v < VW; v++) {
            const float4 w = *reinterpret_cast<const float4 *>(pw + v * PS + j);
#pragma unroll
            for (int c = 0; c < CPL; c++) {
              o[v][c] = fmaf(w.x, x[0][c], o[v][c]);
              o[v][c] = fmaf(w.y, x[1][c], o[v][c]);
              o[v][c] = fmaf(w.z, x[2][c], o[v][c]);
              o[v][c] = fmaf(w.w, x[3][c], o[v][c]);
            }
          }
        }
      }
    }
  }

  const CausalBlock f = causal_block<BR, GT>(a, plan);
  const int split = f.split, nr = f.nr, nh = f.nh, h0 = f.h0;
  const size_t row_q = f.row_q;
  const bool single = plan.splits == 1;
  const auto dst = [&](int qi, int d) -> float * {
    const size_t row = row_q + qi / GT, h = h0 + qi % GT;
    return single ? a.out + (row * a.n_heads + h) * D + d
                  : a.part_o + ((row * plan.splits + split) * a.n_heads + h) * D + d;
  };
  float scale[VW];
#pragma unroll
  for (int v = 0; v < VW; v++) {
    st[v].l = warp_sum(st[v].l);
    scale[v] = single ? st[v].inv_sum() : 1.0f;
    const int qi = v0 + v, r = qi / GT, g = qi % GT;
    if (!single && lane == 0 && r < nr && g < nh) {
      const size_t p = ((row_q + r) * plan.splits + split) * a.n_heads + h0 + g;
      a.part_m[p] = st[v].m;
      a.part_l[p] = st[v].l;
    }
  }
  if (a.rot_v) {  // rotated back from V's frame, a warp a vector, through shared memory
    __syncthreads();  // every warp is done with q and the tiles
    float *so = smem;  // [BM][LD]
    if (col_on) {
#pragma unroll
      for (int v = 0; v < VW; v++)
#pragma unroll
        for (int c = 0; c < CPL; c++) so[(v0 + v) * LD + CPL * lane + c] = o[v][c] * scale[v];
    }
    __syncthreads();
    store_rotated<S, GT, DMAX>(so, a, nr, nh, dst);
    return;
  }
  if (!col_on) return;
#pragma unroll
  for (int v = 0; v < VW; v++) {
    const int qi = v0 + v;
    if (qi / GT >= nr || qi % GT >= nh) continue;
    float *d = dst(qi, CPL * lane);  // the caller's out: 4-byte alignment only (store4)
#pragma unroll
    for (int c = 0; c < CPL; c++) d[c] = o[v][c] * scale[v];
  }
}

// Head-dim classes 128 and 256, and 64 for few rows (see the top of the file). Per tile, for
// each stage of the K tile warp w adds its dims' share of every score to a lane's 4 positions
// (pg + 8i) x 4 vectors (vg + 4j): a step of 4 dims is 4 K loads (8 rows a load) and 4 q loads
// (4 rows) for 64 FFMAs. The warps' shares meet in shared memory, where thread t sums those of
// vector t / 8 at positions t % 8 + 8i and runs its online softmax (the state in registers: m
// the same on the vector's 8 threads, l each one's positions' share). Output: per stage of the
// V tile, a lane takes 4 dims (4 pg ..) of 4 vectors (4 vg ..), a V load (8 columns) and a
// weight load (4 rows) a position for 16 FFMAs.
template <typename P, int GT, int DMAX>
__global__ void __launch_bounds__(WideShape<DMAX>::NT, kCausalWideMinBlocksPerSm)
    causal_wide_kernel(const CausalArgs a, const CausalPlan plan) {
  using S = WideShape<DMAX>;
  constexpr int BM = S::BM, BN = S::BN, LD = S::LD, LH = S::LH, LP = S::LP, LW = S::LW;
  constexpr int DH = S::DH, DW = S::DW, STAGES = DMAX / DH;
  constexpr int OG = DH / 32, OS = S::WARPS / OG;  // output: 32 dims a warp, OS position shares
  constexpr int BR = BM / GT;                      // query rows
  static_assert(BM == 16 && BN == 32 && S::WARPS == 4 && DW % 4 == 0 && DMAX % DH == 0 &&
                    DH % 32 == 0 && (OS == 1 || (OS == 2 && STAGES == 1)),
                "a lane 4 x 4 of the scores and of a stage's outputs");
  using KF = typename P::K;
  using VF = typename P::V;

  extern __shared__ float smem[];
  float *sq = smem;                        // [BM][LD]: vector qi = r * GT + g (row r, head g)
  float *skv = sq + BM * LD;               // [BN][LH]: a stage of the K tile, then of the V tile
  float *spart = skv + BN * LH;            // [warp][BM][LP]: the warps' shares of the scores
  float *sw = spart + S::WARPS * BM * LP;  // [BN][LW]: weights
  float *salpha = sw + BN * LW;            // [BM]: the softmax's rescale of the tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, D = a.head_dim;
  const int pg = lane & 7, vg = lane >> 3;                 // score and output passes
  // Output: a stage's dims 32 ow .., position share op (constants where a warp has one share).
  const int ow = OS == 1 ? warp : warp % OG, op = OS == 1 ? 0 : warp / OG;
  const int sv = threadIdx.x >> 3, sk = threadIdx.x & 7;  // softmax: vector sv, positions sk + 8i

  const CausalBlock b = causal_block<BR, GT>(a, plan);
  const int item = b.item, window = plan.window;
  const CausalRange span = causal_range(plan, b);
  const int first_pos = span.first_pos, last_pos = span.last_pos;
  const int kv_begin = span.kv_begin, kv_end = span.kv_end;

  wait_for_prerequisite_grid();
  stage_q<S, GT, DMAX>(sq, a, b);

  const size_t base = kv_base(a, plan, b), slot_base = slot_base_of(a, plan, b);
  SoftmaxState st = SoftmaxState::empty();
  float o[STAGES][4][4];  // [stage][vector 4 vg + j][dim 4 pg + c of the warp's]
#pragma unroll
  for (int h = 0; h < STAGES; h++)
#pragma unroll
    for (int j = 0; j < 4; j++) o[h][j][0] = o[h][j][1] = o[h][j][2] = o[h][j][3] = 0.0f;

  // At head_dim 64 (one stage) the next tile's K is fetched over this tile's softmax and output
  // passes, its V over the score pass; at 128 and 256 the registers are not there.
  constexpr bool PF = STAGES == 1 && DMAX == 64;
  const auto kept_k = [&] { return a.kept_k ? a.kept_k + slot_base : nullptr; };
  const auto kept_v = [&] { return a.kept_v ? a.kept_v + slot_base : nullptr; };
  TileChunks<KF, S::NT, BN, DH> kc(D);
  TileChunks<VF, S::NT, BN, DH> vc(D);
  const size_t step = (size_t)BN * D;  // a tile's rows
  size_t at = base + (size_t)kv_begin * D;  // the tile's first row, where PF
  if constexpr (PF)
    if (kv_begin < kv_end)
      kc.fetch(a.k, KF::at(a.k, at), kept_k(), plan, item, kv_begin, min(BN, kv_end - kv_begin), D);

  for (int t0 = kv_begin; t0 < kv_end; t0 += BN) {
    const int n = min(BN, kv_end - t0);
    // Every row sees every position of the tile: no mask.
    const bool full = n == BN && t0 + BN - 1 <= first_pos && (window == 0 || last_pos - t0 < window);
    float s[4][4];  // [position pg + 8i][vector vg + 4j]
#pragma unroll
    for (int i = 0; i < 4; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int h = 0; h < STAGES; h++) {
      __syncthreads();  // q is staged; the last stage (K's or the last tile's V) is consumed
      if constexpr (PF) {
        kc.template store<LH>(skv, kept_k(), plan, item, t0, n, D);
      } else {
        load_tile<KF, S::NT, BN, DH, LH>(skv, a.k, KF::at(a.k, base),
                                         a.kept_k ? a.kept_k + slot_base : nullptr, plan, item, t0,
                                         n, D, h * DH);
      }
      __syncthreads();
      if constexpr (PF) vc.fetch(a.v, VF::at(a.v, at), kept_v(), plan, item, t0, n, D);
      if (h * DH + warp * DW < D) {  // warp-uniform; dims past head_dim are zeros
        const float *kr = skv + pg * LH + warp * DW;
        const float *qr = sq + vg * LD + h * DH + warp * DW;
#pragma unroll
        for (int d = 0; d < DW; d += 4) {
          float4 k4[4], q4[4];
#pragma unroll
          for (int i = 0; i < 4; i++) k4[i] = *reinterpret_cast<const float4 *>(kr + 8 * i * LH + d);
#pragma unroll
          for (int j = 0; j < 4; j++) q4[j] = *reinterpret_cast<const float4 *>(qr + 4 * j * LD + d);
#pragma unroll
          for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
              s[i][j] = fmaf(q4[j].x, k4[i].x, s[i][j]);
              s[i][j] = fmaf(q4[j].y, k4[i].y, s[i][j]);
              s[i][j] = fmaf(q4[j].z, k4[i].z, s[i][j]);
              s[i][j] = fmaf(q4[j].w, k4[i].w, s[i][j]);
            }
        }
      }
    }
    float *pw = spart + warp * BM * LP;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
      for (int j = 0; j < 4; j++) pw[(vg + 4 * j) * LP + pg + 8 * i] = s[i][j];
    __syncthreads();  // the shares are in; K is consumed: V's first stage takes its place
    if constexpr (PF) {
      vc.template store<LH>(skv, kept_v(), plan, item, t0, n, D);
      at += step;
      if (t0 + BN < kv_end)
        kc.fetch(a.k, KF::at(a.k, at), kept_k(), plan, item, t0 + BN, min(BN, kv_end - t0 - BN), D);
    } else {
      load_tile<VF, S::NT, BN, DH, LH>(skv, a.v, VF::at(a.v, base),
                                       a.kept_v ? a.kept_v + slot_base : nullptr, plan, item, t0, n,
                                       D, 0);
    }
    {
      // Vector sv is row sv / GT; the warps' shares summed in a fixed order.
      const int dist0 = first_pos + sv / GT - (t0 + sk);  // query minus key position
      float x[4], mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int pos = sk + 8 * i, dist = dist0 - 8 * i;
        float sum = spart[sv * LP + pos];
#pragma unroll
        for (int w = 1; w < S::WARPS; w++) sum += spart[(w * BM + sv) * LP + pos];
        const bool seen = full || (pos < n && dist >= 0 && (window == 0 || dist < window));
        x[i] = seen ? sum : -INFINITY;
        mx = fmaxf(mx, x[i]);
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float alpha = st.raise(mx), ref = SoftmaxState::reference(st.m);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float w = exp2_ftz(x[i] - ref);
        st.l += w;
        sw[(sk + 8 * i) * LW + sv] = w;
      }
      if (sk == 0) salpha[sv] = alpha;
    }
    __syncthreads();

    const float4 al = *reinterpret_cast<const float4 *>(salpha + 4 * vg);
    const float alv[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
    for (int h = 0; h < STAGES; h++)
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[h][j][c] *= alv[j];
#pragma unroll
    for (int h = 0; h < STAGES; h++) {
      if (h > 0) {
        __syncthreads();  // the last stage of V is consumed
        load_tile<VF, S::NT, BN, DH, LH>(skv, a.v, VF::at(a.v, base),
                                         a.kept_v ? a.kept_v + slot_base : nullptr, plan, item, t0,
                                         n, D, h * DH);
        __syncthreads();
      }
      // Positions n .. BN - 1 have weight 0 and zero V rows: the whole share, unrolled.
      if (h * DH + 32 * ow < D) {
        const float *vr = skv + 32 * ow + 4 * pg;
        const float *wr = sw + 4 * vg;
#pragma unroll
        for (int p = op * (BN / OS); p < (op + 1) * (BN / OS); p++) {
          const float4 v4 = *reinterpret_cast<const float4 *>(vr + p * LH);
          const float4 w4 = *reinterpret_cast<const float4 *>(wr + p * LW);
          fma4(w4.x, v4, reinterpret_cast<float4 &>(o[h][0]));
          fma4(w4.y, v4, reinterpret_cast<float4 &>(o[h][1]));
          fma4(w4.z, v4, reinterpret_cast<float4 &>(o[h][2]));
          fma4(w4.w, v4, reinterpret_cast<float4 &>(o[h][3]));
        }
      }
    }
  }

  // The vectors' states to the output's lanes through shared memory (sw: the tiles are done).
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 1);
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 2);
  st.l += __shfl_xor_sync(0xffffffffu, st.l, 4);
  __syncthreads();  // every warp is done with q, the tiles and the weights
  float *sm = sw, *sl = sw + BM;
  if (sk == 0) sm[sv] = st.m, sl[sv] = st.l;
  if (OS == 2) {  // head_dim 64: share 0 adds share 1's outputs (their rescales were the same)
    float4 *sr = reinterpret_cast<float4 *>(smem + 32 * ow + 4 * pg);  // q's place, [BM][LD]
    if (op == 1)
#pragma unroll
      for (int j = 0; j < 4; j++) sr[(4 * vg + j) * (LD / 4)] = reinterpret_cast<float4 &>(o[0][j]);
    __syncthreads();
    if (op == 0)
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float4 r = sr[(4 * vg + j) * (LD / 4)];
        o[0][j][0] += r.x, o[0][j][1] += r.y, o[0][j][2] += r.z, o[0][j][3] += r.w;
      }
  }
  __syncthreads();

  const CausalBlock f = causal_block<BR, GT>(a, plan);
  const int split = f.split, nr = f.nr, nh = f.nh, h0 = f.h0;
  const size_t row_q = f.row_q;
  const bool single = plan.splits == 1;
  // One split: the normalised output; several: the unnormalised partial and the state, merged
  // by the combine kernel (attention_combine.cu) with the decode call's partials layout.
  const auto dst = [&](int qi, int d) -> float * {
    const size_t row = row_q + qi / GT, h = h0 + qi % GT;
    return single ? a.out + (row * a.n_heads + h) * D + d
                  : a.part_o + ((row * plan.splits + split) * a.n_heads + h) * D + d;
  };
  if (!single && sk == 0 && sv / GT < nr && sv % GT < nh) {
    const size_t p = ((row_q + sv / GT) * plan.splits + split) * a.n_heads + h0 + sv % GT;
    a.part_m[p] = st.m;
    a.part_l[p] = st.l;
  }
  float scale[4];
#pragma unroll
  for (int j = 0; j < 4; j++)
    scale[j] = single ? SoftmaxState{sm[4 * vg + j], sl[4 * vg + j]}.inv_sum() : 1.0f;
  if (a.rot_v) {  // rotated back from V's frame, a warp a vector, through shared memory
    float *so = smem;  // [BM][LD]: q's
    if (op == 0)
#pragma unroll
      for (int h = 0; h < STAGES; h++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
          for (int c = 0; c < 4; c++)
            so[(4 * vg + j) * LD + h * DH + 32 * ow + 4 * pg + c] = o[h][j][c] * scale[j];
    __syncthreads();
    store_rotated<S, GT, DMAX>(so, a, nr, nh, dst);
    return;
  }
  if (op != 0) return;
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const int qi = 4 * vg + j;
    if (qi / GT >= nr || qi % GT >= nh) continue;
#pragma unroll
    for (int h = 0; h < STAGES; h++) {
      const int d = h * DH + 32 * ow + 4 * pg;
      if (d < D)
        store4(dst(qi, d), make_float4(o[h][j][0] * scale[j], o[h][j][1] * scale[j],
                                       o[h][j][2] * scale[j], o[h][j][3] * scale[j]));
    }
  }
}

int dmax_class(int head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }
int log2_tile(int gt) { return gt >= 8 ? 3 : gt >= 4 ? 2 : gt >= 2 ? 1 : 0; }

// The kernel classes, which index causal_occupancy: 0 causal_warp_kernel at head_dim 64, 1 and
// 2 causal_wide_kernel at 128 and 256, 3 causal_wide_kernel at 64 (few rows).
template <typename P, int GT>
CausalKernel kernel_of(int cls) {
  return cls == 0   ? causal_warp_kernel<P, GT, 64>
         : cls == 1 ? causal_wide_kernel<P, GT, 128>
         : cls == 2 ? causal_wide_kernel<P, GT, 256>
                    : causal_wide_kernel<P, GT, 64>;
}

template <typename S>
void set_shape(CausalPass &pass, int gt) {
  pass.threads = S::NT;
  pass.smem = S::smem_floats() * sizeof(float);
  pass.rows = S::BM / gt;
}

}  // namespace

template <typename P>
int causal_fp32_pass(m40llm_cuda_state *st, int head_dim, int gt, bool few, CausalPass *out) {
  const int dmax = dmax_class(head_dim);
  // Few rows at head_dim 64: the wide kernel's 16 query vectors a block, not the warp kernel's
  // 64, for items of at most 16 / gt rows (speculative rows: 0.34-0.43x the time at T 2 and 4).
  const int cls = dmax == 64 ? (few ? 3 : 0) : dmax / 128;
  CausalPass pass;
  switch (gt) {
    case 1: pass.kernel = kernel_of<P, 1>(cls); break;
    case 2: pass.kernel = kernel_of<P, 2>(cls); break;
    case 4: pass.kernel = kernel_of<P, 4>(cls); break;
    default: pass.kernel = kernel_of<P, 8>(cls); break;
  }
  switch (cls) {
    case 0: set_shape<WarpShape<64>>(pass, gt); break;
    case 1: set_shape<WideShape<128>>(pass, gt); break;
    case 2: set_shape<WideShape<256>>(pass, gt); break;
    default: set_shape<WideShape<64>>(pass, gt); break;
  }
  pass.tile = kCausalTile;
  int &occ = st->causal_occupancy[P::K::kFormat][P::V::kFormat][log2_tile(gt)][cls];
  if (occ == 0) {
    M40LLM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, pass.kernel, pass.threads,
                                                                  pass.smem));
    if (occ < 1) occ = 1;
  }
  pass.target = st->sm_count * occ * kAttnWaves;
  *out = pass;
  return M40LLM_OK;
}

#define M40LLM_INSTANTIATE(P) \
  template int causal_fp32_pass<P>(m40llm_cuda_state *, int, int, bool, CausalPass *);
M40LLM_KV_PAIRS(M40LLM_INSTANTIATE)
#undef M40LLM_INSTANTIATE
