// The causal prefill kernel on tensor cores (sm_80+, FP16 K/V): a block takes 64 query vectors
// (BR rows x GT heads of one K/V head's group) against tiles of 64 positions staged in shared
// memory by cp.async, two tiles in flight, so that each K/V byte read from L2 serves 64 vectors
// rather than the decode kernel's 8 (attend_rows), and it reads only the positions its rows see.
// Each warp keeps its q fragments in registers.
// It shares the FP32 causal kernels' plan, blocks, splits and combine
// (attention_causal_dispatch.cu: causal_launch).
//
// A warp takes 16 vectors as the MMA's M rows, flash-attention style:
//   S[vec][pos] = Q[vec][:] . K[pos][:]   A = Q, B = K^T: ldmatrix of K's rows
//   O[vec][:] += P[vec][pos] V[pos][:]    A = P (S's accumulator fragment as is), B = V:
//                                          ldmatrix.trans of V's rows
// FP32 q and the FP32 weights p each go in as two FP16 terms (hi + lo, 22 significand bits, as
// the decode kernel's: attention_mma.cuh), two MMAs each: q's terms into separate accumulators,
// so that a K infinity masks (hi_plus_lo), p's into one (p's terms are finite). A vector's q is
// scaled by a power of two first so that both terms stay normal FP16 numbers. The online softmax
// is per row of the accumulator fragment: a lane holds rows g and g + 8, the 4 lanes of a row
// its 64 scores.
#include "attention_causal.cuh"
#include "attention_mma.cuh"

#include <stdint.h>

namespace {

// A block: 4 warps of 16 query vectors each, tiles of kCausalMmaTile positions, two in flight.
constexpr int kPrefillWarps = 4;
constexpr int kPrefillThreads = 32 * kPrefillWarps;
constexpr int kPrefillVectors = 16 * kPrefillWarps;
constexpr int kPrefillStages = 2;

// Up to head_dim 128 a warp keeps its q fragments in registers (H200: 0.90-1.01x the time of
// shared memory, one 255-register instance spilling 8 bytes); at 256 they would not fit beside
// the output's, so they wait in shared memory, and tiles are half as long (two blocks' tiles
// and q would not fit an SM).
template <int DMAX>
struct PrefillShape {
  static constexpr int BN = DMAX > 128 ? kCausalMmaTile / 2 : kCausalMmaTile;
  static constexpr int LDH = DMAX + 8;  // halves a row: ldmatrix's 8 rows in 8 bank groups
  static constexpr bool q_regs = DMAX <= 128;
  // [stage][K, V][BN][LDH] halves, then (q in shared memory) [k step][hi, lo][thread] words
  static constexpr size_t kv_halves = (size_t)kPrefillStages * 2 * BN * LDH;
  static constexpr size_t q_words = q_regs ? 0 : (size_t)DMAX / 16 * 2 * kPrefillThreads;
  static constexpr size_t smem() { return kv_halves * sizeof(__half) + q_words * sizeof(uint4); }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

__device__ __forceinline__ uint32_t shared_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 FP16 matrices, lanes 8i .. 8i + 7 giving matrix i's row addresses; lane (g, t) gets
// row g's elements 2t, 2t + 1 of each (.trans: column g's, rows 2t, 2t + 1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __half *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __half *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_addr(p)));
}

// 16 bytes from global to shared memory, or 16 zero bytes where !ok (src is then not read).
__device__ __forceinline__ void copy16(__half *dst, const __half *src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_addr(dst)), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most one group of this thread's copies is in flight.
__device__ __forceinline__ void copy_wait_one() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// Rows t0 .. t0 + BN - 1 of one K/V head's K and V into dst ([K, V][BN][LDH]), zeros from row
// n on (a zero V row under weight 0 adds nothing; garbage could be NaN). A thread takes the
// chunk of 8 dims c8 of rows RS apart; chunks past head_dim are never written (the kernel
// zeroes them once).
template <typename S, int DMAX>
__device__ __forceinline__ void load_tiles(__half *dst, const __half *k, const __half *v, int t0,
                                           int n, int D) {
  constexpr int CH = DMAX / 8, RS = kPrefillThreads / CH;
  static_assert(kPrefillThreads % CH == 0 && S::BN % RS == 0, "whole chunks a thread");
  const int row0 = threadIdx.x / CH, c8 = threadIdx.x % CH * 8;
  if (c8 >= D) return;
#pragma unroll
  for (int it = 0; it < S::BN / RS; it++) {
    const int row = row0 + it * RS;
    const bool ok = row < n;
    const size_t at = ok ? (size_t)(t0 + row) * D + c8 : 0;
    copy16(dst + row * S::LDH + c8, k + at, ok);
    copy16(dst + (S::BN + row) * S::LDH + c8, v + at, ok);
  }
}

#endif

// GT: query heads of the group a block takes (a power of two <= 8; BR = 64 / GT rows). DMAX:
// 64, 128 or 256 (head_dim a multiple of 8 up to it; dims past head_dim are zeros).
template <int GT, int DMAX>
__global__ void __launch_bounds__(kPrefillThreads, kCausalMmaBlocksPerSm)
    causal_mma_kernel(const CausalArgs a, const CausalPlan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using S = PrefillShape<DMAX>;
  constexpr int BN = S::BN, LDH = S::LDH, BR = kPrefillVectors / GT;
  constexpr int KS = DMAX / 16;  // k steps of the scores
  constexpr int NO = DMAX / 8;  // output n-tiles
  extern __shared__ uint4 smem_words[];
  __half *const skv = reinterpret_cast<__half *>(smem_words);
  uint4 *const sq = smem_words + S::kv_halves / 8 + threadIdx.x;  // ks: sq[2 ks NT], lo NT on
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int D = a.head_dim;

  const CausalBlock b = causal_block<BR, GT>(a, plan);
  const int window = plan.window;
  const CausalRange span = causal_range(plan, b);
  const int first_pos = span.first_pos, last_pos = span.last_pos;
  const int kv_begin = span.kv_begin, kv_end = span.kv_end;
  const size_t base = kv_base(a, plan, b);
  const __half *const kh = KvF16::at(a.k, base), *const vh = KvF16::at(a.v, base);
  const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;

  if (D < DMAX) {  // the dims past head_dim of every stage: zeros, never copied over
    for (size_t i = threadIdx.x; i < S::kv_halves / 8; i += kPrefillThreads)
      smem_words[i] = make_uint4(0, 0, 0, 0);
    __syncthreads();  // before any thread's copies land in the words zeroed here
  }
  wait_for_prerequisite_grid();
  if (n_tiles > 0) load_tiles<S, DMAX>(skv, kh, vh, kv_begin, min(BN, kv_end - kv_begin), D);
  copy_commit();

  // This lane's rows: vectors m = 16 warp + g + 8h (row m / GT, head m % GT of the block's).
  float down[2];
  uint4 qa[S::q_regs ? KS : 1][2];  // A fragments of k step ks, hi and lo terms (S::q_regs)
  {
    const float *qrow[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int m = 16 * warp + g + 8 * h, r = m / GT, x = m % GT;
      qrow[h] = r < b.nr && x < b.nh ? a.q + ((b.row_q + r) * a.n_heads + b.h0 + x) * D : nullptr;
    }
    // Dims 16 ks + 2t + {0, 1} (A's k 2t, 2t + 1) and 16 ks + 8 + 2t + {0, 1}, of rows h.
    const auto q_at = [&](int h, int d) {
      return qrow[h] && d < D ? qrow[h][d] * a.q_scale : 0.0f;
    };
    float up[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float qmax = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++)
          qmax = fmaxf(qmax, fabsf(q_at(h, 16 * ks + 8 * (j >> 1) + 2 * t + (j & 1))));
      qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 1));
      qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 2));
      int e = 0;
      if (qmax > 0.0f && qmax <= FLT_MAX) frexpf(qmax, &e);
      const int shift = max(-126, min(126, 13 - e));
      up[h] = ldexpf(1.0f, shift);
      down[h] = ldexpf(1.0f, -shift);
    }
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int w = 0; w < 4; w++) {  // a0 row g, a1 row g + 8, a2 / a3 the same 8 dims on
        const int h = w & 1, d = 16 * ks + 8 * (w >> 1) + 2 * t;
        split_pair(q_at(h, d) * up[h], q_at(h, d + 1) * up[h], hi[w], lo[w]);
      }
      const uint4 qh = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      const uint4 ql = make_uint4(lo[0], lo[1], lo[2], lo[3]);
      if constexpr (S::q_regs) {
        qa[ks][0] = qh, qa[ks][1] = ql;
      } else {
        sq[2 * ks * kPrefillThreads] = qh;
        sq[(2 * ks + 1) * kPrefillThreads] = ql;
      }
    }
  }
  // k step ks's fragments (a thread's own words of shared memory: no barrier).
  const auto q_frag = [&](int ks, int lo) {
    if constexpr (S::q_regs) return qa[ks][lo];
    else return sq[(2 * ks + lo) * kPrefillThreads];
  };

  SoftmaxState st[2] = {SoftmaxState::empty(), SoftmaxState::empty()};  // l: this lane's share
  // l's compensation (Kahan): a tile's sum can be 2^-11 of l (a peaked row) and the same in
  // every tile, where plain adds round the same way each time (1.5e-5 of the output over 3000
  // positions).
  float lc[2] = {0.0f, 0.0f};
  float o[NO][4];  // n-tile j: rows g (0, 1) and g + 8 (2, 3), dims 8j + 2t + {0, 1}
#pragma unroll
  for (int j = 0; j < NO; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  // ldmatrix row addresses: K's (positions 8 (lane / 16) + lane % 8, dims 8 (lane / 8 % 2)),
  // V's (positions 8 (lane / 8 % 2) + lane % 8, dims 8 (lane / 16)).
  const int k_off = ((lane & 7) + ((lane >> 4) << 3)) * LDH + ((lane >> 3) & 1) * 8;
  const int v_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * LDH + (lane >> 4) * 8;

  for (int i = 0; i < n_tiles; i++) {
    const int t0 = kv_begin + i * BN, n = min(BN, kv_end - t0);
    if (i + 1 < n_tiles)
      load_tiles<S, DMAX>(skv + ((i + 1) & 1) * 2 * BN * LDH, kh, vh, t0 + BN,
                          min(BN, kv_end - t0 - BN), D);
    copy_commit();
    copy_wait_one();
    __syncthreads();  // tile i is in every thread's view (and, at i = 0, q)
    const __half *const sk = skv + (i & 1) * 2 * BN * LDH, *const sv = sk + BN * LDH;

    // Scores, half a tile at a time: n-tile j is positions 8j + 2t + {0, 1}.
    float s[BN / 8][4];
    constexpr int CN = BN / 16;  // n-tiles a half
#pragma unroll
    for (int half = 0; half < 2; half++) {
      float hi[CN][4], lo[CN][4];
#pragma unroll
      for (int j = 0; j < CN; j++)
#pragma unroll
        for (int x = 0; x < 4; x++) hi[j][x] = lo[j][x] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < KS; ks++) {
        const uint4 qh = q_frag(ks, 0), ql = q_frag(ks, 1);
#pragma unroll
        for (int pr = 0; pr < CN / 2; pr++) {
          uint32_t kb[4];
          ldmatrix_x4(kb, sk + (8 * CN * half + 16 * pr) * LDH + 16 * ks + k_off);
          mma16816(hi[2 * pr], qh, kb[0], kb[1]);
          mma16816(lo[2 * pr], ql, kb[0], kb[1]);
          mma16816(hi[2 * pr + 1], qh, kb[2], kb[3]);
          mma16816(lo[2 * pr + 1], ql, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int j = 0; j < CN; j++)
#pragma unroll
        for (int x = 0; x < 4; x++)
          s[CN * half + j][x] = hi_plus_lo(hi[j][x], lo[j][x]) * down[x >> 1];
    }

    // Every row sees every position of the tile: no mask.
    const bool full =
        n == BN && t0 + BN - 1 <= first_pos && (window == 0 || t0 + window > last_pos);
    if (!full) {
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int dist0 = first_pos + (16 * warp + g + 8 * h) / GT - t0;  // query minus t0
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
          for (int x = 0; x < 2; x++) {
            const int p = 8 * j + 2 * t + x, dist = dist0 - p;
            if (p >= n || dist < 0 || (window > 0 && dist >= window)) s[j][2 * h + x] = -INFINITY;
          }
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < BN / 8; j++) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      alpha[h] = st[h].raise(mx);
      lc[h] *= alpha[h];
      // Weights of 2^14 at the max: unscaled, those under 2^-14 were FP16 subnormals in hi + lo
      // and lost their low bits (1e-5 relative error over 10^5 small weights). The scale leaves
      // through 1 / l or the partials' write; m - 14 rounds no worse than s - m already does,
      // and upward, so that no weight passes 2^14 (from |m| >= 2^25 it would round to 2^16,
      // FP16's infinity) and a row's scale depends on m alone.
      const float ref = __fsub_ru(SoftmaxState::reference(st[h].m), 14.0f);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int x = 0; x < 2; x++) {
          s[j][2 * h + x] = exp2_ftz(s[j][2 * h + x] - ref);
          sum += s[j][2 * h + x];
        }
      const float y = sum - lc[h], l = st[h].l + y;
      lc[h] = (l - st[h].l) - y;
      st[h].l = l;
    }
    // Output: k step kk is positions 16 kk .. + 15, n-tiles 2kk and 2kk + 1 of the scores.
    uint4 ph[BN / 16], pl[BN / 16];
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      split_pair(s[2 * kk][0], s[2 * kk][1], ph[kk].x, pl[kk].x);
      split_pair(s[2 * kk][2], s[2 * kk][3], ph[kk].y, pl[kk].y);
      split_pair(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[kk].z, pl[kk].z);
      split_pair(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[kk].w, pl[kk].w);
    }
    // V's 16 positions of k step kk against n-tiles 2 dp and 2 dp + 1 of the output, into a0, a1.
    const auto add_pair = [&](float(&a0)[4], float(&a1)[4], int kk, int dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, sv + 16 * kk * LDH + 16 * dp + v_off);
      mma16816(a0, ph[kk], vb[0], vb[1]);
      mma16816(a1, ph[kk], vb[2], vb[3]);
      mma16816(a0, pl[kk], vb[0], vb[1]);
      mma16816(a1, pl[kk], vb[2], vb[3]);
    };
    // A tile's products summed apart, CT n-tiles of the output at a time, then added to o
    // (rescaled by alpha) in FP32: the MMA's adder keeps about 24 bits of its largest term and
    // truncates the rest, so products summed into o itself lose their low bits wherever o is far
    // larger (a peaked row, one weight of 1 and thousands of 2^-15: 3.6-5.5e-5 of the output
    // over 3000 positions).
    constexpr int CT = kCausalMmaSumTiles<DMAX>;
    static_assert(NO % CT == 0 && CT % 2 == 0, "whole pairs of n-tiles a chunk");
#pragma unroll
    for (int c = 0; c < NO / CT; c++) {
      float acc[CT][4];
#pragma unroll
      for (int j = 0; j < CT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
        for (int dp = 0; dp < CT / 2; dp++)
          add_pair(acc[2 * dp], acc[2 * dp + 1], kk, c * CT / 2 + dp);
#pragma unroll
      for (int j = 0; j < CT; j++)
#pragma unroll
        for (int x = 0; x < 4; x++)
          o[c * CT + j][x] = fmaf(o[c * CT + j][x], alpha[x >> 1], acc[j][x]);
    }
    __syncthreads();  // every warp is done with this stage before the next tile's copies reuse it
  }

  const bool single = plan.splits == 1;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    st[h].l -= lc[h];
    st[h].l += __shfl_xor_sync(0xffffffffu, st[h].l, 1);
    st[h].l += __shfl_xor_sync(0xffffffffu, st[h].l, 2);
    const int m = 16 * warp + g + 8 * h, r = m / GT, x = m % GT;
    if (r >= b.nr || x >= b.nh) continue;
    const size_t row = b.row_q + r, head = b.h0 + x;
    const size_t at =
        (single ? row : row * plan.splits + b.split) * a.n_heads + head;
    float *const dst = (single ? a.out : a.part_o) + at * D;
    // The weights' 2^14 leaves through 1 / l, or out of a partial's o and l (exact).
    const float f = single ? st[h].inv_sum() : 0x1p-14f;
#pragma unroll
    for (int j = 0; j < NO; j++) {
      const int d = 8 * j + 2 * t;
      if (d < D) {  // out is 4-byte aligned only
        dst[d] = o[j][2 * h] * f;
        dst[d + 1] = o[j][2 * h + 1] * f;
      }
    }
    if (!single && t == 0) {
      a.part_m[at] = st[h].m;
      a.part_l[at] = st[h].l * 0x1p-14f;
    }
  }
#endif
}

template <int DMAX>
CausalKernel kernel_for_tile(int gt) {
  switch (gt) {
    case 1: return causal_mma_kernel<1, DMAX>;
    case 2: return causal_mma_kernel<2, DMAX>;
    case 4: return causal_mma_kernel<4, DMAX>;
    default: return causal_mma_kernel<8, DMAX>;
  }
}

int log2_of_tile(int gt) { return gt >= 8 ? 3 : gt >= 4 ? 2 : gt >= 2 ? 1 : 0; }
static_assert(kMaxGroupTile <= 8, "a group tile past 8 has no prefill instance (kernel_for_tile)");

}  // namespace

int causal_mma_pass(m40llm_cuda_state *st, int head_dim, int gt, CausalPass *out) {
  *out = CausalPass{nullptr, 0, 0, 0, 0, 0};
  if (!kTensorCores || st->cc_major < 8 || head_dim > 256 || head_dim % 8 != 0) return M40LLM_OK;
  const int dim_class = head_dim <= 64 ? 0 : head_dim <= 128 ? 1 : 2;
  const CausalKernel k = dim_class == 0   ? kernel_for_tile<64>(gt)
                         : dim_class == 1 ? kernel_for_tile<128>(gt)
                                          : kernel_for_tile<256>(gt);
  const size_t smem = dim_class == 0   ? PrefillShape<64>::smem()
                      : dim_class == 1 ? PrefillShape<128>::smem()
                                       : PrefillShape<256>::smem();
  int &occ = st->causal_mma_occupancy[log2_of_tile(gt)][dim_class];
  if (occ == 0) {
    cudaFuncAttributes attr;
    M40LLM_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
    if (attr.ptxVersion < 80 || smem > st->smem_per_block) {  // a compute_52 image here
      occ = -1;
      return M40LLM_OK;
    }
    M40LLM_CUDA_TRY(
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    M40LLM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, kPrefillThreads, smem));
    if (occ < 1) occ = 1;
  }
  if (occ < 0) return M40LLM_OK;
  out->kernel = k;
  out->threads = kPrefillThreads;
  out->smem = smem;
  out->rows = kPrefillVectors / gt;
  out->tile = dim_class == 2 ? PrefillShape<256>::BN : kCausalMmaTile;
  out->target = st->sm_count * occ * kAttnWaves;
  return M40LLM_OK;
}
