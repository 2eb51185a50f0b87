// The split kernel on tensor cores (sm_80+) and its passes: same blocks, partials and combine as
// the FP32 kernel in attention_fp32.cu, for MHA and GQA: under FP32 FMAs (one per query head per
// K/V element) GQA runs out of issue slots before the memory does, and even one query head per
// K/V head issues fewer instructions per byte on tensor cores. mma.m16n8k16 multiplies FP16
// exactly and accumulates in FP32; the FP32 operands (q, and the softmax weights p) each go in
// as two FP16 terms, x = hi + lo, which carries 22 of FP32's 24 significand bits. q is scaled by
// a power of two first so that both terms stay normal FP16 numbers.
//
// A warp takes 16 positions per step. Matrix rows 0-7 are the query heads' hi terms and rows
// 8-15 their lo terms, so one MMA takes both and the two halves of the result add up (a lane
// holds row g in c[0..1] and row g + 8 in c[2..3]). The scores' accumulator fragment is then
// the weights' input fragment as is:
//   S[head][pos] = Q[head][:] . K[pos][:]   (A = Q, B = K^T: a K row is a B column)
//   O[head][:]  += P[head][pos] V[pos][:]    (A = P, B = V: a B register pairs two positions,
//                                             which movmatrix makes from two V rows)
// The dims of a 16-byte K load are dealt to k indices in a fixed permutation, the same for Q,
// so every load is one 16-byte word per lane and the dot product is unchanged. A head_dim of
// 32 NC + 16 ends with a 16-dim tail: one k step, 8 bytes per lane.
//
// Instances: attention_mma.cu (the uniform caches' pairs), attention_mma_tiers.cu (a tiered
// call's launches, M40LLM_PLAN_TIER: every tier pair), attention_mma_causal.cu (causal rows:
// the uniform caches' pairs).
#pragma once

#include "attention.cuh"

#include <stdint.h>

#ifdef M40LLM_NO_TENSOR_CORES
// Built without the tensor-core kernels: the device helpers below are never used.
#pragma nv_diag_suppress 177
#endif

#include <type_traits>

namespace {

// Positions a warp takes per step: the MMA's M.
constexpr int kMmaRows = 16;
// The weights' scale 2^pshift in attn_mma_kernel: FP16 V's, and the range of a quantized V's
// (its scales run from 2^-24 to under 2^16; the bounds keep every factor a normal float).
constexpr int kMmaPShiftF16 = 14, kMmaPShiftMin = -40, kMmaPShiftMax = 40;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// C += A B, 16x8x16. A: {row g, row g + 8} at k 2t, 2t + 1, then the same at k 2t + 8, 2t + 9.
__device__ __forceinline__ void mma16816(float (&c)[4], const uint4 &a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// 2^x for an integer x in [-126, 127], exactly.
__device__ __forceinline__ float exp2_int(int x) { return __int_as_float((x + 127) << 23); }

__device__ __forceinline__ uint32_t bits(__half2 h) { return *reinterpret_cast<uint32_t *>(&h); }
__device__ __forceinline__ __half2 as_half2(uint32_t x) { return *reinterpret_cast<__half2 *>(&x); }

// (x0, x1) as FP16 pairs hi + lo.
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t &hi, uint32_t &lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  hi = bits(h);
  lo = bits(__floats2half2_rn(x0 - hf.x, x1 - hf.y));
}

// A score from its hi and lo terms' dot products. Where K holds an infinity (a masked position)
// the hi term is that infinity, but the lo term can be NaN (a lo term of 0 times the infinity)
// or the opposite infinity (a lo term of the other sign): the score is then the hi term, so a
// -inf K gives a -inf score (weight 0). Elsewhere the hi term is finite and so is the lo term
// (a lo term is nonzero only where its hi term is), and this is hi + lo. A NaN in K, or
// infinities of both signs, still give NaN. Two instructions per score (FSETP, FSEL).
__device__ __forceinline__ float hi_plus_lo(float hi, float lo) {
  return fabsf(hi) == INFINITY ? hi : hi + lo;
}

__device__ __forceinline__ uint32_t word(const uint4 &v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint32_t word(const uint2 &v, int i) { return i == 0 ? v.x : v.y; }

// One 16-position step of K or V rows (D halves each, the lane's NC chunks of them) for this
// lane: rows 8j + g, 16 bytes of each of its 32-dim chunks and 8 of the tail (p points at the
// lane's first chunk). Rows past the end (rows <= 0: no step) read as zeros: their weight is 0,
// and 0 x garbage could be NaN.
template <int NC, int TAIL>
struct Step {
  uint4 c[2][NC];
  uint2 t[2];  // dims 32 NC + 4t .. 32 NC + 4t + 3 (unused without a tail)
};

// A step staged in shared memory: FP16 codes.
struct SharedHalves {
  const __half *p;
};

// N elements n past p as FP16 bit patterns: from the tensor (the format's Ptr, through the
// read-only path) or from a staged step.
template <typename KV, int N>
__device__ __forceinline__ typename HalfVec<N>::Raw load_halves(typename KV::Ptr p, int n) {
  return KV::template halves<N>(KV::template load<N>(KvPlanes{}, p, n));  // F16: no planes
}
template <typename KV, int N>
__device__ __forceinline__ typename HalfVec<N>::Raw load_halves(SharedHalves p, int n) {
  return *reinterpret_cast<const typename HalfVec<N>::Raw *>(p.p + n);
}

template <typename KV, int D, int NC, int TAIL, typename P>
__device__ __forceinline__ void load_step(Step<NC, TAIL> &r, P p, int rows, int g, int t) {
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const bool ok = 8 * j + g < rows;
#pragma unroll
    for (int c = 0; c < NC; c++)
      r.c[j][c] = ok ? load_halves<KV, 8>(p, 8 * j * D + 32 * c) : make_uint4(0, 0, 0, 0);
    if (TAIL)
      r.t[j] = ok ? load_halves<KV, 4>(p, 8 * j * D + 32 * NC - 4 * t) : make_uint2(0, 0);
  }
}


// A step held as FP16 rows (F16 K/V): the B fragments' 16 bytes of rows 8j + g, chunk c.
template <int NC, int TAIL>
struct HalfSteps {
  Step<NC, TAIL> k, v;
  __device__ const uint4 &kb(int j, int c) const { return k.c[j][c]; }
  __device__ const uint4 &vb(int j, int c) const { return v.c[j][c]; }
};

// A protected cache's kept rows (M40LLM_PLAN_MIXED) as RegisterSteps loads FP16 rows, over the
// item's parts 0-2 in order: kept row r at its FP16 slot, so a split's kept rows are one loop
// (one memory round trip a step) whichever runs of the ring they cross.
template <int NC, int W, int D>
struct KeptSteps : HalfSteps<NC, 0> {
  static constexpr int kBlockRows = kMmaRows * W;
  const __half *kbase, *vbase;  // the (sequence, K/V head)'s slot 0, at this lane's dims
  int end0, end1, first1, first2;  // parts 0 and 1 end at kept rows end0, end1; part 0 at slot 0
  int p_end;

  __device__ KeptSteps(const __half *k, const __half *v, const m40llm_attn_parts &pa, int p0,
                       int p_end_, int lane, int dim0)
      : kbase(k + dim0 + 8 * (lane & 3)), vbase(v + dim0 + 8 * (lane & 3)), end0(pa.count[0]),
        end1(pa.count[0] + pa.count[1]), first1(pa.first[1] - pa.count[0]),
        first2(pa.first[2] - end1), p_end(p_end_) {
    load(this->k, kbase, p0);
    load(this->v, vbase, p0);
  }
  __device__ int slot(int r) const { return r < end0 ? r : r + (r < end1 ? first1 : first2); }
  __device__ void load(Step<NC, 0> &st, const __half *base, int p0) const {
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const int r = p0 + 8 * j + ((threadIdx.x & 31) >> 2);
      const bool ok = r < p_end;
      const __half *row = base + (size_t)slot(ok ? r : 0) * D;
#pragma unroll
      for (int c = 0; c < NC; c++)
        st.c[j][c] = ok ? load_halves<KvF16, 8>(row, 32 * c) : make_uint4(0, 0, 0, 0);
    }
  }
  __device__ void before_scores(int) {}
  __device__ void after_scores(int p0) { load(this->k, kbase, p0 + kBlockRows); }
  __device__ void after_output(int p0) { load(this->v, vbase, p0 + kBlockRows); }
};

// A quantized format's codes as the tensor-core kernel takes them: a lane's 8 codes of a row
// (within one 32-dim group) become FP16 numbers, exactly, by byte permutes under the bits of
// 1024 and FP16 FMAs that take the 1024 off. A format with a min gets its codes centred: Q4's
// less 8, Q3's and Q2's on their range's midpoint (less 3.5 and 1.5, half-integers, exact in
// FP16); min() is the centred codes' min, min + that centre x scale. Q8's offset binary
// (code - 128) has no min. The group's scale (and min) stay FP32 and apply around the MMAs: to
// the scores per group, and folded into the weights for the output. (Scaled codes rounded to
// FP16 would cost 2^-11 relative per element.)
// Why centred: the min's share is added apart (min x sum(q), sum(w x min)). For data around zero,
// codes 0..15 made the MMA's sum and that share each about 7.5 x scale x sum(|q|) (or sum(w)),
// and they cancelled: the MMA's rounding (22-bit operands, FP32 accumulation of a split's output)
// came to 2e-4-9e-4 of the result at 422K positions with outlier channels (H200). Centred on an
// integer, what is left is the output's accumulated half-step, sum(w x scale) / 2: a fifteenth
// of Q4's range (5e-6 there), but a seventh of Q3's (9e-6) and a third of Q2's (1.6e-5), whose
// codes hence go on the midpoint.
//
// Codes::Ptr, at(plane, e), add(p, n), load(p, n): a lane's codes' place (element e's) in the
// codes plane, moved and loaded n elements on (n a multiple of the group).
template <typename F>
struct MmaCodes;

// An FP16 (scale, min) pair's min for codes less `centre` (one FP32 FMA's rounding).
__device__ __forceinline__ float centred_min(uint32_t p, float centre) {
  return fmaf(centre, __half2float(__ushort_as_half(p & 0xFFFFu)),
              __half2float(__ushort_as_half(p >> 16)));
}

// A lane's 8 codes as one word, element e's at byte e x bits / 8.
template <typename Codes_, int kBits>
struct MmaWord {
  using Codes = Codes_;
  using Ptr = const uint8_t *;
  __device__ static Ptr at(const void *plane, size_t e) {
    return static_cast<const uint8_t *>(plane) + e * kBits / 8;
  }
  __device__ static Ptr add(Ptr p, size_t n) { return p + n * kBits / 8; }
  __device__ static Codes load(Ptr p, int n) {
    return __ldg(reinterpret_cast<const Codes *>(p + n * kBits / 8));
  }
};

template <>
struct MmaCodes<KvQ8> : MmaWord<uint2, 8> {  // 8 offset-binary bytes (code + 128)
  using Param = unsigned short;  // the FP16 scale
  // Bytes sel & 3, (sel >> 8) & 3 of w as (1024 + byte), less 1152: code - 128 = the value.
  __device__ static uint32_t pair(uint32_t w, uint32_t sel) {
    const uint32_t h = __byte_perm(w, 0x64646464u, sel);
    return bits(__hsub2(as_half2(h), as_half2(0x64806480u)));
  }
  __device__ static uint4 halves(Codes c) {
    return make_uint4(pair(c.x, 0x4140u), pair(c.x, 0x4342u), pair(c.y, 0x4140u),
                      pair(c.y, 0x4342u));
  }
  __device__ static float scale(Param p) { return __half2float(__ushort_as_half(p)); }
  __device__ static float min(Param) { return 0.0f; }
};
template <>
struct MmaCodes<KvQ4> : MmaWord<uint32_t, 4> {  // 8 nibbles: element 2i low in byte i, 2i + 1 high
  using Param = uint32_t;  // FP16 (scale, min), scale low
  // Byte i of w in both halves: the low nibble under 1024, the high one as 1024 + 16 x nibble;
  // then x (1, 1/16) - (1032, 72): nibble - 8. (The midpoint, nibble - 7.5, would need the low
  // nibble shifted first: one more instruction and register, some D256 instances spilled.)
  __device__ static uint32_t pair(uint32_t w, uint32_t sel) {
    const uint32_t h = (__byte_perm(w, 0u, sel) & 0x00F0000Fu) | 0x64006400u;
    return bits(__hfma2(as_half2(h), as_half2(0x2C003C00u), as_half2(0xD480E408u)));
  }
  __device__ static uint4 halves(Codes c) {
    return make_uint4(pair(c, 0x4040u), pair(c, 0x4141u), pair(c, 0x4242u), pair(c, 0x4343u));
  }
  __device__ static float scale(Param p) { return __half2float(__ushort_as_half(p & 0xFFFFu)); }
  __device__ static float min(Param p) { return centred_min(p, 8.0f); }
};

// Q2 and Q3 (V only): a byte of 4 2-bit codes gives two pairs, as Q4's byte gives one: each
// half's code masked at bits a >= 2 of a mantissa under 1024 (the first pair's first code from
// w << 2), with bit a - 1 set, times 2^-a: code + 0.5 over 1024 x 2^-a, which goes with 2 more
// (Q2's midpoint 1.5). Q3 adds each code's bit 2 from its bit-plane byte as 4 x the bit, its
// offset, the 2-bit part's and Q3's 4 folded into one FMA's addend, so a pair is two HFMA2s.
// Exact: every FMA's operands and result are held exactly in FP16 (a code at bit 0 would need
// a half below the mantissa's last bit).
template <int kBits>
struct MmaLowBits {
  using Param = uint32_t;  // FP16 (scale, min), scale low
  // Codes 2I, 2I + 1's 2-bit parts as (1024 + 2^a c + 2^(a - 1)) halves: from byte I / 2 of w,
  // at a = 4, 6 for odd I; for even I at a = 2 from w << 2 (w2) and w.
  template <int I>
  __device__ static __half2 low(uint32_t w, uint32_t w2) {
    if constexpr (I % 2 == 0)
      return as_half2((__byte_perm(w2, w, I < 2 ? 0x4400u : 0x5511u) & 0x000C000Cu) | 0x64026402u);
    else
      return as_half2((__byte_perm(w, 0u, I < 2 ? 0x4040u : 0x4141u) & 0x00C00030u) | 0x64206408u);
  }
  // x 2^-a, and what to take off for Q2: 1024 x 2^-a + 2.
  template <int I>
  __device__ static __half2 mul() { return as_half2(I % 2 ? 0x24002C00u : 0x34003400u); }
  template <int I>
  __device__ static __half2 sub() { return as_half2(I % 2 ? 0xCC80D420u : 0xDC08DC08u); }
  __device__ static float scale(Param p) { return __half2float(__ushort_as_half(p & 0xFFFFu)); }
  __device__ static float min(Param p) { return centred_min(p, 0.5f * ((1 << kBits) - 1)); }
};

template <>
struct MmaCodes<KvQ2> : MmaWord<unsigned short, 2>, MmaLowBits<2> {
  template <int I>
  __device__ static uint32_t pair(uint32_t w, uint32_t w2) {
    return bits(__hfma2(low<I>(w, w2), mul<I>(), sub<I>()));
  }
  __device__ static uint4 halves(Codes c) {
    const uint32_t w = c, w2 = w << 2;
    return make_uint4(pair<0>(w, w2), pair<1>(w, w2), pair<2>(w, w2), pair<3>(w, w2));
  }
};

template <>
struct MmaCodes<KvQ3> : MmaLowBits<3> {
  struct Codes {
    unsigned short low;  // the 2-bit parts, as Q2's
    uint8_t high;        // bit 2 of element i in bit i
  };
  struct Ptr {
    const uint8_t *low, *high;
  };
  __device__ static Ptr at(const void *plane, size_t e) {
    const uint8_t *codes = static_cast<const uint8_t *>(plane);
    return {codes + KvQ3::low_byte(e), codes + KvQ3::high_byte(e)};
  }
  __device__ static Ptr add(Ptr p, size_t n) {
    return {p.low + n / KvQ3::kGroup * 12, p.high + n / KvQ3::kGroup * 12};
  }
  __device__ static Codes load(Ptr p, int n) {
    const int g = n / KvQ3::kGroup * 12;
    return {__ldg(reinterpret_cast<const unsigned short *>(p.low + g)), __ldg(p.high + g)};
  }
  // Element 2I's bit at bit 2I of the low half, 2I + 1's at bit 2I + 1 of the high half: x
  // (2^(2-2I), 2^(1-2I)) is 4 x the bit plus an offset, which the addend takes off with the
  // 2-bit part's and 4.
  template <int I>
  __device__ static uint32_t pair(uint32_t w, uint32_t w2, uint32_t hw) {
    constexpr uint32_t kMask = (1u << (2 * I)) | (2u << (2 * I)) << 16;
    constexpr uint32_t kMul[4] = {0x40004400u, 0x38003C00u, 0x30003400u, 0x28002C00u};
    constexpr uint32_t kSub[4] = {0xE882EC41u, 0xE028E444u, 0xDE10E008u, 0xD280D820u};
    const __half2 high = __hfma2(as_half2((hw & kMask) | 0x64006400u), as_half2(kMul[I]),
                                 as_half2(kSub[I]));
    return bits(__hfma2(low<I>(w, w2), mul<I>(), high));
  }
  __device__ static uint4 halves(Codes c) {
    const uint32_t w = c.low, w2 = w << 2, hw = __byte_perm(c.high, 0u, 0x4040u);
    return make_uint4(pair<0>(w, w2, hw), pair<1>(w, w2, hw), pair<2>(w, w2, hw),
                      pair<3>(w, w2, hw));
  }
};

// One row's parameters, a group each, in one load where their bytes are a power of two (zeros
// past the end: 0 x garbage could be NaN).
template <typename T, int NC>
struct ParamRow {
  T p[NC];
};
template <int Bytes>
struct LoadWord;
template <>
struct LoadWord<4> { using T = unsigned int; };
template <>
struct LoadWord<8> { using T = uint2; };
template <>
struct LoadWord<16> { using T = uint4; };

template <typename T, int NC>
__device__ __forceinline__ ParamRow<T, NC> load_param_row(const T *p, bool ok) {
  ParamRow<T, NC> r;
  constexpr int kBytes = (int)sizeof(T) * NC;
  if constexpr (kBytes == 4 || kBytes == 8 || kBytes == 16) {
    using V = typename LoadWord<kBytes>::T;
    const V w = ok ? __ldg(reinterpret_cast<const V *>(p)) : V{};
    memcpy(&r, &w, kBytes);
  } else {
#pragma unroll
    for (int c = 0; c < NC; c++) r.p[c] = ok ? __ldg(p + c) : T{};
  }
  return r;
}

// Quantized K/V loaded through registers, as RegisterSteps loads FP16 rows: the step's codes
// (rows 8j + g, as a lane's B fragments take them) and the parameters of the positions whose
// scores and weights the lane holds, 8(r / 2) + 2t + r % 2 for r = 0..3.
template <typename P, int NC, int W, int D>
struct QuantSteps {
  using KC = MmaCodes<typename P::K>;
  using VC = MmaCodes<typename P::V>;
  static constexpr int kGroups = D / 32;  // a row's parameters; the lane's NC of them from dim0
  static constexpr int kBlockRows = kMmaRows * W;
  typename KC::Codes kc[2][NC];
  typename VC::Codes vc[2][NC];
  ParamRow<typename KC::Param, NC> kpar[4];
  ParamRow<typename VC::Param, NC> vpar[4];
  typename KC::Ptr kcode;  // this lane's first codes of the step in flight
  typename VC::Ptr vcode;
  const typename KC::Param *kparam;  // its position 2t's parameters
  const typename VC::Param *vparam;
  int p_end, g, t;

  __device__ QuantSteps(const AttnArgs &a, const SplitBlock<P> &b, int p0, int lane, int dim0,
                        void * /*smem*/, int /*stages*/)
      : p_end(b.p_end), g(lane >> 2), t(lane & 3) {
    const size_t ke = b.k + (size_t)(p0 + g) * D + dim0 + 8 * t;
    const size_t ve = b.v + (size_t)(p0 + g) * D + dim0 + 8 * t;
    const size_t krow = b.k / D + p0 + 2 * t, vrow = b.v / D + p0 + 2 * t;
    kcode = KC::at(a.k.plane[M40LLM_KV_CODES], ke);
    vcode = VC::at(a.v.plane[M40LLM_KV_CODES], ve);
    kparam = static_cast<const typename KC::Param *>(a.k.plane[M40LLM_KV_PARAMS]) +
             krow * kGroups + dim0 / 32;
    vparam = static_cast<const typename VC::Param *>(a.v.plane[M40LLM_KV_PARAMS]) +
             vrow * kGroups + dim0 / 32;
    load<KC>(kc, kpar, kcode, kparam, p_end - p0);
    load<VC>(vc, vpar, vcode, vparam, p_end - p0);
  }
  template <typename C>
  __device__ void load(typename C::Codes (&c)[2][NC], ParamRow<typename C::Param, NC> (&par)[4],
                       typename C::Ptr code, const typename C::Param *param, int rows) {
    using Codes = typename C::Codes;
    using Param = typename C::Param;
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const bool ok = 8 * j + g < rows;
#pragma unroll
      for (int n = 0; n < NC; n++) c[j][n] = ok ? C::load(code, 8 * j * D + 32 * n) : Codes{};
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int pos = 8 * (r >> 1) + (r & 1);
      par[r] = load_param_row<Param, NC>(param + pos * kGroups, pos + 2 * t < rows);
    }
  }
  __device__ void before_scores(int) {}
  __device__ void after_scores(int p0) {
    kcode = KC::add(kcode, (size_t)kBlockRows * D);
    kparam += (size_t)kBlockRows * kGroups;
    load<KC>(kc, kpar, kcode, kparam, p_end - (p0 + kBlockRows));
  }
  __device__ void after_output(int p0) {
    vcode = VC::add(vcode, (size_t)kBlockRows * D);
    vparam += (size_t)kBlockRows * kGroups;
    load<VC>(vc, vpar, vcode, vparam, p_end - (p0 + kBlockRows));
  }
  __device__ uint4 kb(int j, int c) const { return KC::halves(kc[j][c]); }
  __device__ uint4 vb(int j, int c) const { return VC::halves(vc[j][c]); }
  __device__ float kscale(int r, int c) const { return KC::scale(kpar[r].p[c]); }
  __device__ float kmin(int r, int c) const { return KC::min(kpar[r].p[c]); }
  __device__ float vscale(int r, int c) const { return VC::scale(vpar[r].p[c]); }
  __device__ float vmin(int r, int c) const { return VC::min(vpar[r].p[c]); }
};

#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && M40LLM_MMA_BULK_BUILT
#define M40LLM_MMA_STAGED_HERE 1

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A warp's transaction barrier for one staging slot: one arrival (its lane 0, which also
// announces the bytes to come), completed when the copy engine has written them.
__device__ __forceinline__ void barrier_init(uint64_t *bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// Makes initialised barriers visible to the copy engine.
__device__ __forceinline__ void barrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void barrier_expect(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t *bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes,
                                          uint64_t *bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Where a warp's K/V steps come from. Each holds the current step's rows in k and v, and is
// called at three points of the kernel's loop over steps (p0: the step's first position):
//   before_scores(p0)  k holds the step's K rows after it
//   after_scores(p0)   v holds its V rows after it; k is free
//   after_output(p0)   v is free
// Rows p_end and on read as zeros.

// Loads through registers: K and V are double-buffered by halves. The next step's K loads go
// out once the scores are taken, its V loads once the output is updated, so a warp always has
// loads in flight; the first step's go out at construction, before q is read.
template <typename KV, int NC, int TAIL, int W, int D>
struct RegisterSteps : HalfSteps<NC, TAIL> {
  static constexpr int kBlockRows = kMmaRows * W;  // positions the block's W warps take per step
  using HalfSteps<NC, TAIL>::k;
  using HalfSteps<NC, TAIL>::v;
  typename KV::Ptr kp, vp;  // this lane's first K and V element of the step in flight
  int p_end, g, t;

  __device__ RegisterSteps(const AttnArgs &, const SplitBlock<KvPair<KV, KV>> &b, int p0,
                           int lane, int dim0, void * /*smem*/, int /*stages*/)
      : p_end(b.p_end), g(lane >> 2), t(lane & 3) {
    const size_t offset = (size_t)(p0 + g) * D + dim0 + 8 * t;
    kp = KV::add(b.k, offset);
    vp = KV::add(b.v, offset);
    load_step<KV, D>(k, kp, p_end - p0, g, t);
    load_step<KV, D>(v, vp, p_end - p0, g, t);
  }
  __device__ void before_scores(int) {}
  __device__ void after_scores(int p0) {
    kp = KV::add(kp, (size_t)kBlockRows * D);
    load_step<KV, D>(k, kp, p_end - (p0 + kBlockRows), g, t);
  }
  __device__ void after_output(int p0) {
    vp = KV::add(vp, (size_t)kBlockRows * D);
    load_step<KV, D>(v, vp, p_end - (p0 + kBlockRows), g, t);
  }
};

// sm_90: the copy engine stages steps n, n + 1, .. of a warp in its slots n % stages of shared
// memory (slot [stage][warp]: the step's K rows, then its V rows, as in memory). Lane 0 asks
// for a step's K and V as soon as its slot is free, so up to `stages` steps are in flight and
// hold no registers; the first ones go out at construction, before q is read. It copies rows of
// FP16 codes as they are: a format with parameters, or other codes, would stage those too.
template <typename KV, int NC, int TAIL, int W>
struct StagedSteps;

#if M40LLM_MMA_STAGED_HERE
template <typename KV, int NC, int TAIL, int W>
struct StagedSteps : HalfSteps<NC, TAIL> {
  static_assert(std::is_same<KV, KvF16>::value, "staging copies FP16 code rows only");
  static constexpr int D = 32 * NC + 16 * TAIL;
  static constexpr int kSlotHalves = 2 * kMmaRows * D;
  static constexpr int kBlockRows = kMmaRows * W;
  using HalfSteps<NC, TAIL>::k;
  using HalfSteps<NC, TAIL>::v;
  const __half *kg, *vg;  // the sequence's K and V rows
  __half *slots;          // this warp's slot 0
  uint64_t *bars;         // this warp's barriers, one per slot: [stage][warp]
  int p_end, stages, lane, slot = 0;
  uint32_t parity = 0;

  __device__ StagedSteps(const AttnArgs &, const SplitBlock<KvPair<KV, KV>> &b, int p0,
                         int lane_, int /*dim0: whole rows*/, void *smem, int stages_)
      : kg(b.k), vg(b.v), p_end(b.p_end), stages(stages_), lane(lane_) {
    __shared__ uint64_t s_bar[kMmaMaxStages][W];
    const int warp = threadIdx.x >> 5;
    slots = static_cast<__half *>(smem) + (size_t)warp * kSlotHalves;
    bars = &s_bar[0][warp];
    if (lane == 0) {
      for (int s = 0; s < stages; s++) barrier_init(bar(s));
      barrier_init_fence();
      for (int s = 0; s < stages; s++) request(s, p0 + s * kBlockRows);
    }
  }
  __device__ uint64_t *bar(int s) const { return bars + s * W; }
  __device__ __half *slot_rows(int s) const { return slots + (size_t)s * W * kSlotHalves; }
  // Lane 0: positions p .. p + 15 into slot s.
  __device__ void request(int s, int p) {
    const int rows = min(kMmaRows, p_end - p);
    if (rows <= 0) return;
    const uint32_t bytes = (uint32_t)(rows * KV::kRowBytes(D));
    barrier_expect(bar(s), 2 * bytes);
    bulk_copy(slot_rows(s), kg + (size_t)p * D, bytes, bar(s));
    bulk_copy(slot_rows(s) + kMmaRows * D, vg + (size_t)p * D, bytes, bar(s));
  }
  __device__ void before_scores(int p0) {
    barrier_wait(bar(slot), parity);
    const int g = lane >> 2, t = lane & 3;
    load_step<KV, D>(k, SharedHalves{slot_rows(slot) + g * D + 8 * t}, p_end - p0, g, t);
  }
  __device__ void after_scores(int p0) {
    const int g = lane >> 2, t = lane & 3;
    load_step<KV, D>(v, SharedHalves{slot_rows(slot) + (kMmaRows + g) * D + 8 * t}, p_end - p0,
                     g, t);
  }
  __device__ void after_output(int p0) {
    __syncwarp();  // every lane's reads of the slot are done (the MMAs consumed them)
    if (lane == 0) request(slot, p0 + stages * kBlockRows);
    if (++slot == stages) {
      slot = 0;
      parity ^= 1;
    }
  }
};
#endif
#endif

// head_dim = 32 NC + 16 TAIL. Lane (g, t) = (lane / 4, lane % 4) holds query head g and, of
// every 32-dim chunk c, dims 32c + 8t .. 32c + 8t + 7, and of the tail dims 32 NC + 4t ..
// 32 NC + 4t + 3: of q, of the output, and of the K and V rows it loads (rows 8j + g of a
// 16-position step).
//
// Above head_dim 128 (mma_dim_split): DS warps take each step's positions, warp w the chunks
// NC / DS x (w % DS) on of every row, and add their scores through shared memory (s_part) at
// each step, so that each holds the output of its slice only: at head_dim 256 one warp's
// accumulators (hi and lo rows) and K/V steps in flight would not fit its registers.
//
// Dynamic shared memory: the staged kernel's slots (StagedSteps), then, after the loop, the
// outputs of the warps along positions, [warp / DS][head][dim], for the merge; a quantized
// pair's kernel has [head][dim] more after them (rotated q on its way in, the output on its way
// back: kQuantScratch). smem_bytes() gives its size.
//
// Quantized K/V (P other than F16 with F16: QuantSteps): the codes go into the MMAs as FP16
// integers, so score = sum over groups of scale x (q . codes) (+ min x sum(q) where K has a
// min), one accumulator per group, and the weights of a group's output MMAs are the softmax
// weights times each position's V scale (the V min's share, sum(w x min), kept apart and added
// at the end). Rotation and protected tokens as in attn_fp32_kernel: q rotated on the way in and
// the output back on the way out, a warp a head.
//
// TIER: the kernel of a tiered call's launch (M40LLM_PLAN_TIER; quantized pairs), a flag of its
// own so that the uniform caches' kernels do not pay for the split's mapping: a block's rows are
// a tier's slots, after the item's kept rows where the launch reads those (as in a MIXED plan:
// no splits of their own, which as blocks of a few rows each cost a third of a large batch's
// time), and it always writes a partial at the call's number of its split. kMmaTierScores: the
// same, for a call with weights (plan.weights): it also writes every seen score at its position
// (the slot map's, or the kept row's), as the FP32 kernel's instances with scores do. (A branch
// on plan.weights in TIER's step made its plain calls 1.05-1.22x slower on an H200.)
//
// CAUSAL: several query rows of each item, T = a.n_heads / (the cache's query heads), packed
// into the MMA's 8 rows (query row t's head h of K/V head g is tile row t x group + h of K/V
// head g's tiles, grid x's), so that all of them take one read of the K/V; row t
// sees the positions before plan.len - T + t + 1. q and out are [item][T][heads][dim], which
// is [item][a.n_heads][dim]: partials and the combine take each row's heads as an item's. With
// plan.causal_window W, a row sees the last W of those positions only.
//
// kMmaDirectScores: kMmaDirect for a uniform cache's call with weights, which writes its scores
// as kMmaTierScores does (a kept row's at its position, a code row's at its own) and a lone
// split's (max, sum) besides its output.
//
// V: kMmaDirect, kMmaStaged, kMmaTier, kMmaTierScores, kMmaDirectScores or kMmaCausal.
//
// The block's static shared arrays, declared by the kernel (M40LLM_MMA_SHARED) and handed to
// attn_mma_block: a kernel that runs several pairs' blocks (attn_mma_tiers_kernel) holds them
// once. They depend on the shape alone.
template <int NC, int TAIL, int W>
struct MmaShared {
  static constexpr int DS = mma_dim_split(32 * NC + 16 * TAIL), WP = W / DS;
  using State = SoftmaxState[WP][kMaxGroupTile];
  // q's A fragments, k step (c, h): k 2t, 2t + 1 = dims 32c + 8t + 4h + {0, 1}, k 2t + 8, 2t + 9
  // = the next two; the tail's k step: dims 32 NC + 4t + {0, 1}, then the next two. Kept in
  // shared memory, one 16-byte word per lane (registers go to loads in flight instead).
  using Qa = uint4[NC][2][32];
  using Qta = uint4[32];
  // A split head_dim's partial scores, each warp's in turn (two, so a warp's next step's never
  // overwrites what its partner has yet to read).
  using Part = float4[DS > 1 ? 2 : 1][DS > 1 ? W : 1][32];
  State &state;
  Qa &qa;
  Qta &qta;
  Part &part;
};
#define M40LLM_MMA_SHARED(S, name)                 \
  __shared__ typename S::State name##_state;       \
  __shared__ typename S::Qa name##_qa;             \
  __shared__ typename S::Qta name##_qta;           \
  __shared__ typename S::Part name##_part;         \
  const S name{name##_state, name##_qa, name##_qta, name##_part}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Rows p_begin .. min(p_end, p_begin + rows) - 1 of FP16 K and V (D halves each) into L2, a line
// a thread: their DRAM reads start while the block waits for the grid before it and for its q.
// Into L2 only, which binds no value: the GPU's writes meet there, so a row that grid (or this
// block's append) writes is read as written; a prefetch into L1 could serve the loads a stale
// line.
template <int D>
__device__ __forceinline__ void prefetch_rows_l2(const __half *k, const __half *v, int p_begin,
                                                 int p_end, int rows) {
  const int n = min(p_end - p_begin, rows);
  const char *kb = reinterpret_cast<const char *>(k + (size_t)p_begin * D);
  const char *vb = reinterpret_cast<const char *>(v + (size_t)p_begin * D);
  const int lines = n > 0 ? (n * D * (int)sizeof(__half) + 127) / 128 : 0;
  for (int l = threadIdx.x; l < lines; l += blockDim.x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(kb + 128 * l));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(vb + 128 * l));
  }
}

template <typename P, int NC, int TAIL, int V, int W>
__device__ __forceinline__ void attn_mma_block(const AttnArgs &a, const m40llm_attn_plan &plan,
                                               const MmaShared<NC, TAIL, W> &shared) {
  constexpr bool STAGED = V == kMmaStaged, CAUSAL = V == kMmaCausal;
  constexpr bool SCORES = V == kMmaTierScores || V == kMmaDirectScores;
  constexpr bool TIER = V == kMmaTier || V == kMmaTierScores;
  constexpr int D = 32 * NC + 16 * TAIL;
  constexpr int G = kMaxGroupTile;
  static_assert(G == 8, "query heads fill rows 0-7 of the MMA");
  constexpr bool kQuant = !std::is_same<P, KvPair<KvF16, KvF16>>::value;
  static_assert(!kQuant || (TAIL == 0 && !STAGED), "quantized rows: whole groups, registers");
  static_assert(!TIER || kQuant, "tiers are quantized pairs");
  static_assert(!CAUSAL || !STAGED, "causal rows: through registers");
  constexpr bool kKMin = kQuant && P::K::kHasMin, kVMin = kQuant && P::V::kHasMin;
  constexpr int DS = mma_dim_split(D);  // warps a step's positions; NW chunks each, WP of them
  constexpr int NW = NC / DS, WP = W / DS;
  static_assert(DS == 1 || (DS == 2 && TAIL == 0 && NC % DS == 0 && W % DS == 0 && !STAGED),
                "a head_dim split between pairs of warps: whole chunks each, through registers");
#if M40LLM_MMA_STAGED_HERE
  constexpr bool kStaged = STAGED;
#else
  constexpr bool kStaged = false;  // the host launches the staged kernel only where it is
#endif
  constexpr int kThreads = 32 * W;
  using Steps = std::conditional_t<
      kQuant, QuantSteps<P, NW, WP, D>,
      std::conditional_t<kStaged, StagedSteps<KvF16, NC, TAIL, W>,
                         RegisterSteps<KvF16, NW, TAIL, WP, D>>>;
  extern __shared__ uint4 s_dyn[];
  auto &s_state = shared.state;
  auto &s_qa = shared.qa;
  auto &s_qta = shared.qta;
  auto &s_part = shared.part;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int pw = warp / DS, c0 = NW * (warp % DS);  // its positions' warp, its first chunk
  SplitBlock<P> b = split_block<P, false>(a, plan, G);
  if constexpr (TIER) {  // the call's number of the split; its rows are the plan's, as built
    b.split = plan.split_base[b.item] + b.split - plan.split_begin[b.item];
    b.n_splits = plan.max_splits;  // at least 2: always a partial, merged with the others'
  }
  // The query head (within the item) of tile row r: b.h0 + r, but for CAUSAL's packed rows.
  // [from, lim): the positions lane row g sees (CAUSAL).
  int x0 = 0, kv0 = 0, n_q = 0, lim = 0, from = 0;
  if constexpr (CAUSAL) {
    x0 = block_head_tile() * G;
    kv0 = block_kv_head() * a.group;
    n_q = grid_kv_heads() * a.group;
    const int rows = a.n_heads / n_q;
    b.nh = min(G, rows * a.group - x0);
    lim = plan.len[b.item] - rows + (x0 + g) / a.group + 1;
    from = plan.causal_window > 0 ? lim - plan.causal_window : 0;
  }
  const auto head_of = [&](int r) {
    if constexpr (CAUSAL) {
      const int x = x0 + r;
      return x / a.group * n_q + kv0 + x % a.group;
    } else {
      return b.h0 + r;
    }
  };
  const auto q_row = [&](int r) {  // tile row r's q
    if constexpr (CAUSAL) return a.q + ((size_t)b.item * a.n_heads + head_of(r)) * D;
    else return a.q + ((size_t)b.item * a.n_heads + b.h0 + r) * D;
  };
  // A chained tier launch waits at its end instead (m40llm_attn_plan::chained): its blocks fill
  // the SMs the launch before it leaves, as one launch's would.
  const bool chained = TIER && plan.chained;
  // FP16 K/V only, the calls it was measured on (codes and causal rows were not); a K/V head's
  // tiles read the same rows, so the first asks.
  if constexpr (!kQuant && !CAUSAL)
    if (block_head_tile() == 0) prefetch_rows_l2<D>(b.k, b.v, b.p_begin, b.p_end, kMmaL2Rows);
  if (!chained) wait_for_prerequisite_grid();
  if (plan.max_splits > 1) allow_dependent_launch();  // as in attn_fp32_kernel
  if constexpr (!CAUSAL) write_appended_row<P>(a, plan, b);

  // This split's rows of the tensor; a protected cache's (M40LLM_PLAN_MIXED): of its codes, part
  // 3, whose rows come after the kept parts' in the split's numbering. A tiered call's launch
  // that reads the kept parts (M40LLM_PLAN_TIER with kept_k) numbers them the same way, with the
  // tier's slots from 0 as the codes and full_len as the item's length.
  const bool mixed = kQuant && (TIER ? plan.kept_k != nullptr : plan.role == M40LLM_PLAN_MIXED);
  const int *const item_len = TIER ? plan.full_len : plan.len;
  SplitBlock<P> cb = b;
  if (mixed) {
    const m40llm_attn_parts parts =
        m40llm_attn_item_parts(item_len[b.item], plan.window_begin[b.item], plan.sinks,
                               plan.window);
    const int first = parts.count[0] + parts.count[1] + parts.count[2];
    const int codes = TIER ? 0 : parts.first[3];
    cb.p_begin = codes + max(b.p_begin - first, 0);
    cb.p_end = max(codes + b.p_end - first, cb.p_begin);
  }
  int p0 = cb.p_begin + kMmaRows * pw;
  const int p_end = cb.p_end;
  Steps src(a, cb, p0, lane, 32 * c0, s_dyn, a.stages);
  float *const s_scratch = reinterpret_cast<float *>(s_dyn) + WP * G * D;  // [G][D], kQuant

  // q in the log2 domain, then scaled by 2^e so its largest magnitude is near 2^13.
  float qf[NC][8], qt[4];
  float qmax = 0.0f;
  {
    const float *qrow = q_row(g);
    float q_scale = a.q_scale;
    if constexpr (kQuant) {
      if (a.rot_k) {  // rotated to meet K, a warp a head, through shared memory
        for (int h = warp; h < G; h += W) {
          const float *row = q_row(h);
          float v[NC];
#pragma unroll
          for (int c = 0; c < NC; c++) v[c] = h < b.nh ? row[lane + 32 * c] * a.q_scale : 0.0f;
          warp_rotate(v, D, a.rot_scale);
#pragma unroll
          for (int c = 0; c < NC; c++) s_scratch[h * D + lane + 32 * c] = v[c];
        }
        __syncthreads();
        qrow = s_scratch + g * D;
        q_scale = 1.0f;
      }
    }
#pragma unroll
    for (int c = 0; c < NC; c++)
#pragma unroll
      for (int j = 0; j < 8; j++) {
        qf[c][j] = g < b.nh ? qrow[32 * c + 8 * t + j] * q_scale : 0.0f;
        qmax = fmaxf(qmax, fabsf(qf[c][j]));
      }
#pragma unroll
    for (int j = 0; j < 4; j++) {
      qt[j] = TAIL && g < b.nh ? qrow[32 * NC + 4 * t + j] * q_scale : 0.0f;
      qmax = fmaxf(qmax, fabsf(qt[j]));
    }
  }
  qmax = warp_max(qmax);
  int e = 0;
  if (qmax > 0.0f && qmax <= FLT_MAX) frexpf(qmax, &e);
  const int shift = max(-126, min(126, 13 - e));
  const float up = ldexpf(1.0f, shift), down = ldexpf(1.0f, -shift);
  // A K min's share of a score, min x sum(q) over the group, in the scores' 2^e scale: the
  // warp's chunks (selected, not indexed: qf stays in registers).
  float qsum[NW];
#pragma unroll
  for (int c = 0; c < NW; c++) {
    qsum[c] = 0.0f;
    if constexpr (kKMin) {
#pragma unroll
      for (int n = 0; n < DS; n++)
#pragma unroll
        for (int j = 0; j < 8; j++) qsum[c] += n * NW == c0 ? qf[n * NW + c][j] : 0.0f;
      qsum[c] += __shfl_xor_sync(0xffffffffu, qsum[c], 1);
      qsum[c] += __shfl_xor_sync(0xffffffffu, qsum[c], 2);
      qsum[c] *= up;
    }
  }
  // q's A fragments into s_qa. Each warp converts every W-th chunk: the barrier waits on a
  // W-th of the work.
#pragma unroll
  for (int c = 0; c < NC; c++) {
    if (c % W == warp) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int w = 0; w < 4; w++) split_pair(qf[c][2 * w] * up, qf[c][2 * w + 1] * up, hi[w], lo[w]);
      s_qa[c][0][lane] = make_uint4(hi[0], lo[0], hi[1], lo[1]);
      s_qa[c][1][lane] = make_uint4(hi[2], lo[2], hi[3], lo[3]);
    }
  }
  if (TAIL && warp == NC % W) {
    uint32_t hi[2], lo[2];
#pragma unroll
    for (int w = 0; w < 2; w++) split_pair(qt[2 * w] * up, qt[2 * w + 1] * up, hi[w], lo[w]);
    s_qta[lane] = make_uint4(hi[0], lo[0], hi[1], lo[1]);
  }
  __syncthreads();

  SoftmaxState run = SoftmaxState::empty();  // over this warp's positions; l per lane
  // p goes to the MMAs as FP16 hi + lo terms times V's scale, at most V's largest scale: its
  // terms under 2^-14 were FP16 subnormals whose low bits were lost (over long, peaked rows of a
  // quantized V, whose scales are often near 2^-7: 1e-4 relative error). So p is scaled by
  // 2^pshift, warp-uniform, which keeps p x scale under 2^14 (FP16 V: a scale of 1, shift 14;
  // codes: the largest scale a step has seen). It only falls; o and omin carry it to the end.
  int pshift = kQuant ? kMmaPShiftMax : kMmaPShiftF16;
  float pscale = exp2_int(pshift);
  // Dims 32 (c0 + c) + 8t + 2i + {0, 1}, from p's hi terms in [0..1] and its lo terms in
  // [2..3]; the tail's dims 32 NC + 4t + 2i + {0, 1} the same way.
  float o[NW][4][4], ot[2][4];
  float omin[NW];  // a V min's share of this lane's positions' output, per group (kQuant)
  int part = 0;  // s_part's half this step writes (DS > 1)
#pragma unroll
  for (int c = 0; c < NW; c++) {
    omin[c] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) o[c][i][0] = o[c][i][1] = o[c][i][2] = o[c][i][3] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 2; i++) ot[i][0] = ot[i][1] = ot[i][2] = ot[i][3] = 0.0f;

  // A warp's steps from p0 on to p_end through src: its K/V rows as FP16 (kQ false) or codes.
  // CAUSAL: this lane's row sees rows row_from .. row_lim - 1 of them. SCORES: position(p) is
  // row p's position, where its scores go.
  const auto steps = [&](auto &src, int p0, int p_end, int row_from, int row_lim, auto quant,
                         auto position) {
    constexpr bool kQ = decltype(quant)::value;
    // SCORES: this lane's rows' positions in the step at q0, asked a step ahead: a slot map's
    // load waited for at the store stalled every step (observe calls 0.75-0.84x of the FP32
    // kernels' time on an H200, against 0.70-0.81x reading ahead).
    [[maybe_unused]] int pos[2][2];
    const auto positions = [&](int q0) {
      if constexpr (SCORES) {
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
          for (int x = 0; x < 2; x++) {
            const int p = q0 + 8 * j + 2 * t + x;
            pos[j][x] = p < p_end ? position(p) : 0;
          }
      }
    };
    positions(p0);
  for (; p0 < p_end; p0 += kMmaRows * WP) {
      const int rows = min(kMmaRows, p_end - p0);
      const int seen = CAUSAL ? min(rows, row_lim - p0) : rows;
      const int unseen = CAUSAL ? row_from - p0 : 0;  // rows before it: masked
      src.before_scores(p0);

      // Scores: lane (g, t) gets heads g, positions 8j + 2t + {0, 1}.
      float s[2][2];
#pragma unroll
      for (int j = 0; j < 2; j++) {
        if constexpr (kQ) {
          s[j][0] = s[j][1] = 0.0f;
#pragma unroll
          for (int c = 0; c < NW; c++) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const uint4 kh = src.kb(j, c);
#pragma unroll
            for (int h = 0; h < 2; h++)
              mma16816(acc, s_qa[c0 + c][h][lane], word(kh, 2 * h), word(kh, 2 * h + 1));
#pragma unroll
            for (int x = 0; x < 2; x++) {
              s[j][x] += src.kscale(2 * j + x, c) * (acc[x] + acc[x + 2]);
              if constexpr (kKMin) s[j][x] += src.kmin(2 * j + x, c) * qsum[c];
            }
          }
        } else {
          float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int c = 0; c < NW; c++)
#pragma unroll
            for (int h = 0; h < 2; h++)
              mma16816(acc, s_qa[c0 + c][h][lane], word(src.kb(j, c), 2 * h),
                       word(src.kb(j, c), 2 * h + 1));
          if (TAIL) mma16816(acc, s_qta[lane], src.k.t[j].x, src.k.t[j].y);
          s[j][0] = hi_plus_lo(acc[0], acc[2]);
          s[j][1] = hi_plus_lo(acc[1], acc[3]);
        }
      }
      if constexpr (DS > 1) {  // the pair's slices added (a sum of two: the same in both warps)
        s_part[part][warp][lane] = make_float4(s[0][0], s[0][1], s[1][0], s[1][1]);
        asm volatile("bar.sync %0, 64;" ::"r"(1 + pw) : "memory");
        const float4 o = s_part[part][warp ^ 1][lane];
        s[0][0] += o.x, s[0][1] += o.y, s[1][0] += o.z, s[1][1] += o.w;
        part ^= 1;
      }

      // Online softmax; the 4 lanes of a head hold its 16 scores.
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; j++)
#pragma unroll
        for (int x = 0; x < 2; x++) {
          const int r = 8 * j + 2 * t + x;
          s[j][x] = r < seen && (!CAUSAL || r >= unseen) ? s[j][x] * down : -INFINITY;
          tile_max = fmaxf(tile_max, s[j][x]);
        }
      // Every seen score, in the log2 domain as the FP32 kernel's, for attn_weights_kernel (one
      // warp of a pair: both hold the sums). Unlike the FP32 kernel's, no test of plan.weights
      // and no mask by position: the host runs these instances only for calls with weights and
      // without limits, where every slot's position is below the item's length.
      if constexpr (SCORES) {
        if (c0 == 0 && g < b.nh) {
          float *row = plan.weights + ((size_t)b.item * a.n_heads + b.h0 + g) * plan.weights_stride;
#pragma unroll
          for (int j = 0; j < 2; j++)
#pragma unroll
            for (int x = 0; x < 2; x++)
              if (8 * j + 2 * t + x < seen) row[pos[j][x]] = s[j][x];
        }
        positions(p0 + kMmaRows * WP);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float alpha = run.raise(tile_max);
      float alpha_o = alpha;  // o's factor: alpha and any fall of pshift
      if constexpr (kQuant) {
        int top = kMmaPShiftF16;
        if constexpr (kQ) {
          float vmax = 0.0f;
#pragma unroll
          for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < NW; c++) vmax = fmaxf(vmax, fabsf(src.vscale(r, c)));
          // 2^e <= vmax < 2^(e + 1) (vmax is positive: its bits order as its values)
          const int e = (int)(__reduce_max_sync(0xffffffffu, __float_as_uint(vmax)) >> 23) - 127;
          top = max(kMmaPShiftMin, min(13 - e, kMmaPShiftMax));
        }
        if (top < pshift) {
          alpha_o *= exp2_int(top - pshift);
          pshift = top;
          pscale = exp2_int(pshift);
        }
      }
      if constexpr (kVMin) {  // in the kept rows' steps too: the max is every step's
#pragma unroll
        for (int c = 0; c < NW; c++) omin[c] *= alpha_o;
      }
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; j++)
#pragma unroll
        for (int x = 0; x < 2; x++) {
          s[j][x] = run.weight(s[j][x]);
          sum += s[j][x];
          s[j][x] *= pscale;
        }
      run.l += sum;
      src.after_scores(p0);
      // Output: B column n of n-tile (c, i) is dim 32c + 8(n / 2) + 2i + n % 2, so the result
      // lands in this lane as dims 32c + 8t + 2i + {0, 1}.
      if constexpr (kQ) {
        // Issue-bound: the output's rescale (a quarter of the step's instructions besides the
        // MMAs) only where some head's max rose, which after the first steps is rare. Not at
        // head_dim 64 and below, whose 128-register kernels then spilled and gained nothing.
        if (NW <= 2 || __any_sync(0xffffffffu, alpha_o != 1.0f)) {
#pragma unroll
          for (int c = 0; c < NW; c++)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
              for (int x = 0; x < 4; x++) o[c][i][x] *= alpha_o;
        }
#pragma unroll
        for (int c = 0; c < NW; c++) {
          uint4 pa;  // A fragment: positions 2t + {0, 1} (hi, lo), then 8 + 2t + {0, 1}
          split_pair(s[0][0] * src.vscale(0, c), s[0][1] * src.vscale(1, c), pa.x, pa.y);
          split_pair(s[1][0] * src.vscale(2, c), s[1][1] * src.vscale(3, c), pa.z, pa.w);
          if constexpr (kVMin)
            omin[c] += s[0][0] * src.vmin(0, c) + s[0][1] * src.vmin(1, c) +
                       s[1][0] * src.vmin(2, c) + s[1][1] * src.vmin(3, c);
          const uint4 v0 = src.vb(0, c), v1 = src.vb(1, c);
#pragma unroll
          for (int i = 0; i < 4; i++)
            mma16816(o[c][i], pa, transpose8x8(word(v0, i)), transpose8x8(word(v1, i)));
        }
      } else {
        uint4 pa;  // A fragment: positions 2t + {0, 1} (hi, lo), then 8 + 2t + {0, 1}
        split_pair(s[0][0], s[0][1], pa.x, pa.y);
        split_pair(s[1][0], s[1][1], pa.z, pa.w);
#pragma unroll
        for (int c = 0; c < NW; c++)
#pragma unroll
          for (int i = 0; i < 4; i++) {
#pragma unroll
            for (int x = 0; x < 4; x++) o[c][i][x] *= alpha_o;
            mma16816(o[c][i], pa, transpose8x8(word(src.vb(0, c), i)),
                     transpose8x8(word(src.vb(1, c), i)));
          }
        if (TAIL) {
#pragma unroll
          for (int i = 0; i < 2; i++) {
#pragma unroll
            for (int x = 0; x < 4; x++) ot[i][x] *= alpha_o;
            mma16816(ot[i], pa, transpose8x8(word(src.v.t[0], i)), transpose8x8(word(src.v.t[1], i)));
          }
        }
      }
      src.after_output(p0);
    }
  };
  // SCORES: a tier's codes' rows are its slots, whose positions its slot map holds; a uniform
  // cache's are positions.
  const int32_t *const map =
      SCORES && TIER ? plan.map + (size_t)plan.seq[b.item] * plan.map_stride : nullptr;
  const auto slot_position = [&](int p) { return SCORES && TIER ? map[p] : p; };
  if constexpr (kQuant) {
    steps(src, p0, p_end, from, lim, std::true_type{}, slot_position);
    if (mixed) {  // the kept parts, from the FP16 slots
      const m40llm_attn_parts parts = m40llm_attn_item_parts(
          item_len[b.item], plan.window_begin[b.item], plan.sinks, plan.window);
      const size_t slots = (size_t)(plan.sinks + plan.window) * D;
      // K/V heads: CAUSAL's a.n_heads counts every row's heads.
      const int n_kv = CAUSAL ? grid_kv_heads() : a.n_heads / a.group;
      const size_t base = ((size_t)plan.seq[b.item] * n_kv + block_kv_head()) * slots;
      const int hi = min(b.p_end, parts.count[0] + parts.count[1] + parts.count[2]);
      if (b.p_begin < hi) {
        const int q0 = b.p_begin + kMmaRows * pw;
        KeptSteps<NW, WP, D> kept(static_cast<const __half *>(plan.kept_k) + base,
                                  static_cast<const __half *>(plan.kept_v) + base, parts, q0, hi,
                                  lane, 32 * c0);
        // Kept row r is position r among the sinks, then window_begin + r - count[0]: the
        // kept rows before position p, kept(p).
        const int c0 = parts.count[0], wb = plan.window_begin[b.item];
        const auto kept_before = [&](int p) { return p < c0 ? p : c0 + max(0, p - wb); };
        const auto kept_position = [&](int r) { return r < c0 ? r : wb + r - c0; };
        steps(kept, q0, hi, kept_before(from), kept_before(lim), std::false_type{},
              kept_position);
      }
    }
  } else {
    steps(src, p0, p_end, from, lim, std::false_type{}, slot_position);
  }
  if (plan.max_splits == 1) allow_dependent_launch();

  run.l += __shfl_xor_sync(0xffffffffu, run.l, 1);
  run.l += __shfl_xor_sync(0xffffffffu, run.l, 2);
  if (t == 0 && c0 == 0) s_state[pw][g] = run;
  if constexpr (kStaged) __syncthreads();  // the outputs take the slots: no warp may read them
  float(*s_o)[G][D] = reinterpret_cast<float(*)[G][D]>(s_dyn);
  const float pdown = exp2_int(-pshift);  // o and omin in the state's units
#pragma unroll
  for (int c = 0; c < NW; c++) {
    if constexpr (kVMin) {
      omin[c] += __shfl_xor_sync(0xffffffffu, omin[c], 1);
      omin[c] += __shfl_xor_sync(0xffffffffu, omin[c], 2);
    }
    float4 *dst = reinterpret_cast<float4 *>(&s_o[pw][g][32 * (c0 + c) + 8 * t]);
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      float4 r = make_float4(o[c][i][0] + o[c][i][2], o[c][i][1] + o[c][i][3],
                             o[c][i + 1][0] + o[c][i + 1][2], o[c][i + 1][1] + o[c][i + 1][3]);
      if constexpr (kVMin) r.x += omin[c], r.y += omin[c], r.z += omin[c], r.w += omin[c];
      r.x *= pdown, r.y *= pdown, r.z *= pdown, r.w *= pdown;
      dst[i / 2] = r;
    }
  }
  if (TAIL)
    *reinterpret_cast<float4 *>(&s_o[pw][g][32 * NC + 4 * t]) =
        make_float4((ot[0][0] + ot[0][2]) * pdown, (ot[0][1] + ot[0][3]) * pdown,
                    (ot[1][0] + ot[1][2]) * pdown, (ot[1][1] + ot[1][3]) * pdown);
  __syncthreads();

  // Merge the warps (the WP along positions). Every warp derives all (warp, head) weights at
  // once, lane w G + h, so the exponentials are taken once per head rather than once per output
  // element; a warp past the split's end has max -inf and weight 0. With one split the output is
  // final: the weights then carry the 1 / sum.
  // Pairs per lane: lane w G + h, then 32 lanes on; under 32 pairs, every lane % (WP G) holds
  // one.
  constexpr int kPairs = WP * G, PL = kPairs > 32 ? kPairs / 32 : 1, kSpan = kPairs > 32 ? 32 : kPairs;
  static_assert(kPairs % kSpan == 0 && 32 % kSpan == 0, "whole (warp, head) pairs per lane");
  const int pl = lane % kSpan;
  SoftmaxState w_state[PL];
  float m = -INFINITY;
#pragma unroll
  for (int p = 0; p < PL; p++) {
    w_state[p] = s_state[(pl + 32 * p) / G][pl % G];
    m = fmaxf(m, w_state[p].m);
  }
#pragma unroll
  for (int off = G; off < kSpan; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  SoftmaxState head = SoftmaxState::at_max(m);
  float wt[PL];
#pragma unroll
  for (int p = 0; p < PL; p++) wt[p] = head.add_partial(w_state[p].m, w_state[p].l);
#pragma unroll
  for (int off = G; off < kSpan; off <<= 1) head.l += __shfl_xor_sync(0xffffffffu, head.l, off);
  const bool final_out = b.n_splits == 1;
  float f[PL];
#pragma unroll
  for (int p = 0; p < PL; p++) f[p] = !final_out ? wt[p] : head.normalise(wt[p]);
  // With exported scores, attn_weights_kernel takes every split's (max, sum), a lone one too.
  if ((!final_out || SCORES) && warp == 0 && lane < b.nh)
    store_split_stats(a, b.split, head_of(lane), head);
  constexpr int D4 = D / 4;
  const float4(*s_o4)[G][D4] = reinterpret_cast<const float4(*)[G][D4]>(s_dyn);
  // A fixed trip count, fully unrolled, stores predicated: every pass's shuffles and shared
  // loads go out together, and every lane takes part in the shuffles.
  constexpr int kPasses = (G * D4 + kThreads - 1) / kThreads;
#pragma unroll
  for (int pass = 0; pass < kPasses; pass++) {
    const int i = pass * kThreads + threadIdx.x, hh = min(i / D4, G - 1), d4 = i % D4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < WP; w++)
      fma4(__shfl_sync(0xffffffffu, f[w * G / 32], w * G % 32 + hh), s_o4[w][hh][d4], acc);
    if (kQuant && a.rot_v) {
      if (i < b.nh * D4) reinterpret_cast<float4 *>(s_scratch)[i] = acc;
    } else if (i < b.nh * D4) {
      store_split_out4(a, b, head_of(hh), 4 * d4, acc);
    }
  }
  if constexpr (kQuant) {
    if (a.rot_v) {  // back from V's frame (linear: partials may be rotated before the combine)
      __syncthreads();
      for (int h = warp; h < b.nh; h += W) {
        float v[NC];
#pragma unroll
        for (int c = 0; c < NC; c++) v[c] = s_scratch[h * D + lane + 32 * c];
        warp_rotate(v, D, a.rot_scale);
#pragma unroll
        for (int c = 0; c < NC; c++) store_split_value(a, b, head_of(h), lane + 32 * c, v[c]);
      }
    }
  }
  if (chained) wait_for_prerequisite_grid();
}
#endif

template <typename P, int NC, int TAIL, int V, int W>
__global__ void __launch_bounds__(32 * W, mma_min_blocks(32 * NC + 16 * TAIL, W))
    attn_mma_kernel(const AttnArgs a, const m40llm_attn_plan plan) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  M40LLM_MMA_SHARED(MmaShared<NC M40LLM_COMMA TAIL M40LLM_COMMA W>, shared);
  attn_mma_block<P, NC, TAIL, V, W>(a, plan, shared);
#else
  (void)a, (void)plan;  // compiled for an older GPU: the host never launches this image
#endif
}


template <typename P>
constexpr bool kQuantPair = !std::is_same<P, KvPair<KvF16, KvF16>>::value;

// The widths the host launches: mma_warps(), and half that loading through registers (plans of
// more blocks than one wave of the wider ones); the decode call's direct variant also
// mma_broad_warps() (plans of at most a block an SM). Quantized pairs: whole groups (head_dim a
// multiple of 32, as the formats require), through registers; a tier's kernels are those. Above
// head_dim 128 (split between warps), through registers only.
template <typename P, int NC, int TAIL, int V, int W>
constexpr SplitKernel instance() {
  constexpr int kWarps = mma_warps(32 * NC + 16 * TAIL);
  constexpr bool kStaged = V == kMmaStaged;
  constexpr bool kSplit = mma_dim_split(32 * NC + 16 * TAIL) > 1;
  constexpr bool kBroad = W == mma_broad_warps(32 * NC + 16 * TAIL) && V == kMmaDirect;
  if constexpr (kTensorCores && (W == kWarps || (W == kWarps / 2 && !kStaged) || kBroad) &&
                !(kSplit && kStaged) &&
                !(kQuantPair<P> && (TAIL || kStaged)) &&
                ((V != kMmaTier && V != kMmaTierScores) || kQuantPair<P>))
    return attn_mma_kernel<P, NC, TAIL, V, W>;
  else
    return nullptr;
}

template <typename P, int V, int W>
SplitKernel kernel_for_dim(int head_dim) {
  switch (head_dim) {
    case 32: return instance<P, 1, 0, V, W>();
    case 48: return instance<P, 1, 1, V, W>();
    case 64: return instance<P, 2, 0, V, W>();
    case 80: return instance<P, 2, 1, V, W>();
    case 96: return instance<P, 3, 0, V, W>();
    case 112: return instance<P, 3, 1, V, W>();
    case 128: return instance<P, 4, 0, V, W>();
    case 192: return instance<P, 6, 0, V, W>();
    case 256: return instance<P, 8, 0, V, W>();
    default: return nullptr;
  }
}

// The kernel of a variant for head_dim in blocks of `warps` warps, or null where there is none.
// Whether it can run is for the caller to ask the runtime.
template <typename P, int V>
SplitKernel kernel_for(int head_dim, int warps) {
  if (warps == 8) return kernel_for_dim<P, V, 8>(head_dim);
  if (warps == 4) return kernel_for_dim<P, V, 4>(head_dim);
  if (warps == 2) return kernel_for_dim<P, V, 2>(head_dim);
  return nullptr;
}

// Dynamic shared memory: the warps' outputs for the merge, or, where the kernel stages K/V
// steps, that many steps per warp, which the outputs reuse after the loop; a quantized pair's
// kernel, a head tile's rows more (its rotation scratch).
size_t smem_bytes(int head_dim, int warps, int stages, bool quant) {
  const size_t outputs =
      (size_t)(warps / mma_dim_split(head_dim)) * kMaxGroupTile * head_dim * sizeof(float);
  const size_t staged = (size_t)stages * warps * 2 * kMmaRows * head_dim * sizeof(__half);
  const size_t scratch = quant ? (size_t)kMaxGroupTile * head_dim * sizeof(float) : 0;
  return (staged > outputs ? staged : outputs) + scratch;
}

// Steps per warp a staged image keeps in flight: as many as fit with mma_min_blocks() blocks
// on an SM, from 2 (fewer resident blocks rather than no overlap) up to kMmaMaxStages; 0 where
// not even two fit in a block (one step staged at a time would not overlap loads with math).
int stages_for(const m40llm_cuda_state *st, int head_dim, int warps, size_t static_smem) {
  const size_t step = smem_bytes(head_dim, warps, 1, false);
  const size_t block_max = st->smem_per_block - static_smem;
  const size_t per_block = st->smem_per_sm / mma_min_blocks(head_dim, warps);
  const size_t share = per_block > st->smem_reserved_per_block + static_smem
                           ? per_block - st->smem_reserved_per_block - static_smem
                           : 0;
  int stages = (int)(share / step);
  if (stages < 2) stages = 2;
  if (stages > kMmaMaxStages) stages = kMmaMaxStages;
  while (stages > 0 && smem_bytes(head_dim, warps, stages, false) > block_max) stages--;
  return stages >= 2 ? stages : 0;
}

// A pass's fields from a kernel k (null: none) of blocks of `warps` at head_dim, asked of the
// runtime once (info): its shared memory sized, its occupancy; info.usable says whether this
// build has an image for the GPU, and out->kernel is k where k is a SplitKernel. quant: a
// quantized pair's (its scratch, its kept rows).
template <typename Kernel>
int mma_pass_of(m40llm_cuda_state *st, Kernel k, int head_dim, int warps, bool staged,
                bool quant, m40llm_cuda_state::MmaInfo &info, SplitPass *out) {
  *out = SplitPass{nullptr, 32 * warps, 0, kMmaRows * warps / mma_dim_split(head_dim), 0, 0,
                   false, false, false, 0};
  if (!k || st->cc_major < (staged ? 9 : 8) || (staged && !M40LLM_MMA_BULK_BUILT))
    return M40LLM_OK;
  if (info.usable == 0) {
    cudaFuncAttributes attr;
    M40LLM_CUDA_TRY(cudaFuncGetAttributes(&attr, k));
    const int stages = staged ? stages_for(st, head_dim, warps, attr.sharedSizeBytes) : 0;
    if (attr.ptxVersion < (staged ? 90 : 80) || (staged && stages == 0)) {
      info.usable = -1;
      return M40LLM_OK;
    }
    const size_t smem = smem_bytes(head_dim, warps, stages, quant);
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
  if constexpr (std::is_same<Kernel, SplitKernel>::value) out->kernel = k;  // else the caller's
  out->smem = (size_t)info.smem;
  out->stages = info.stages;
  out->target = st->sm_count * info.occupancy * kMmaWaves;
  out->fill = out->target;
  out->dependent = info.dependent;
  out->mixed = quant;  // a tier's launch too: the kept rows lead an item's
  return M40LLM_OK;
}

// The kernel of a variant (kMmaDirect, kMmaStaged, kMmaTier, kMmaTierScores, kMmaDirectScores
// or kMmaCausal) where this build has it for this GPU (sm_80+; a compute_52-only build runs
// the FP32 kernel on every GPU, and only sm_90+ images stage). The first call per kernel sizes
// its shared memory and asks its occupancy. No kernel: a null one.
template <typename P, int V>
int pass_for(m40llm_cuda_state *st, int head_dim, int warps, SplitPass *out) {
  return mma_pass_of(st, kernel_for<P, V>(head_dim, warps), head_dim, warps, V == kMmaStaged,
                     kQuantPair<P>,
                     st->mma[P::K::kFormat][P::V::kFormat][V]
                            [warps < mma_warps(head_dim) ? 1 : warps > mma_warps(head_dim) ? 2 : 0]
                            [head_dim / 16],
                     out);
}

// The passes of a variant that loads through registers only (kMmaTier, kMmaTierScores,
// kMmaDirectScores, kMmaCausal): blocks of mma_warps() warps, and of half that for plans of
// more blocks than a wave; pass and direct are one.
template <typename P, int V>
int mma_register_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *p) {
  *p = SplitPasses{};
  const int warps = mma_warps(head_dim);
  int rc = pass_for<P, V>(st, head_dim, warps, &p->pass);
  if (rc == M40LLM_OK && p->pass.kernel) rc = pass_for<P, V>(st, head_dim, warps / 2, &p->fine);
  if (rc != M40LLM_OK) return rc;
  p->direct = p->pass;
  if (!p->fine.kernel) p->fine = p->pass;
  return M40LLM_OK;
}

}  // namespace

