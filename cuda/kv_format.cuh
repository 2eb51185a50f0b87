// The device side of the KV formats (the host side is c/src/kv_format.h): how kernels address,
// load and widen K/V elements, and how the append kernel encodes them. Kernels take the K and V
// formats as template parameters and touch K/V only through them. Element e of a tensor is
// element e % head_dim of row e / head_dim, rows in the order of m40llm_kv_row().
//
// A format type provides:
//   Ptr                    an element's place in the tensor
//   at(planes, e)          element e of a tensor whose planes (from a layer's first row) are given
//   add(ptr, n)            n elements on
//   Raw<N>, load<N>(t,p,n) N consecutive elements n past p, in registers as stored (N a power of
//                          two from 2 to 8, p + n a multiple of N), through the read-only path
//                          (codes under 4 bits: the bytes holding them, shifted down to bit 0)
//   widen<N>(raw, f)       those elements as FP32 factors: the values (F16), or the codes
//   kScaled, scale(raw)    quantized: value = factor x scale (+ min where kHasMin), the same
//   kHasMin, min(raw)      for the N elements (they lie in one group)
//   halves<N>(raw)         the elements as FP16 bit patterns (the tensor-core kernels: F16;
//                          a quantized format's kCodeBits-bit codes become FP16 integers
//                          there through MmaCodes in attention_mma.cu)
//   kEncodeRun, encode()   F16: the append kernel's unit, kEncodeRun elements from FP32 or FP16
//   encode_lane(t,e,x)     quantized: one group from e on, a warp's lane l holding element l
//   kRowBytes(D)           bytes of one codes row (the staged tensor-core kernel copies rows)
//   Cursor, cursor(t,p)    the FP32 kernel's walk: p as addresses to load at (F16: the pointer;
//   step(c,n), load_at<N>  quantized: the codes' and the parameters'), moved and loaded at n
//                          elements on, n a multiple of the group (a quantized Ptr is an index,
//                          and each load from it costs sm_52 about 10 integer instructions)
#pragma once

#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "common.cuh"
#include "internal.h"
#include "kv_format.h"

// N consecutive halves as one load: N * 2 bytes, aligned to that.
template <int N>
struct HalfVec;
template <>
struct HalfVec<2> { using Raw = unsigned int; };
template <>
struct HalfVec<4> { using Raw = uint2; };
template <>
struct HalfVec<8> { using Raw = uint4; };

// Planes of one tensor, as the host hands them to a kernel that reads them or one that writes.
struct KvPlanes {
  const void *plane[M40LLM_KV_PLANES];
};
struct KvMutPlanes {
  void *plane[M40LLM_KV_PLANES];
};

// IEEE binary16 codes, no parameters.
struct KvF16 {
  static constexpr int kFormat = M40LLM_KV_F16;
  static constexpr bool kScaled = false, kHasMin = false;
  static constexpr int kEncodeRun = 8;
  template <int N>
  using Raw = typename HalfVec<N>::Raw;
  using Ptr = const __half *;

  __host__ __device__ static Ptr at(const KvPlanes &t, size_t e) {
    return static_cast<const __half *>(t.plane[M40LLM_KV_CODES]) + e;
  }
  __host__ __device__ static Ptr add(Ptr p, ptrdiff_t n) { return p + n; }
  __host__ __device__ static constexpr size_t kRowBytes(int head_dim) {
    return (size_t)head_dim * sizeof(__half);
  }

  // The value is used later, after other loads: the read-only path lets them all go out first.
  template <int N>
  __device__ static Raw<N> load(const KvPlanes &, Ptr p, int n) {
    return __ldg(reinterpret_cast<const Raw<N> *>(p + n));
  }

  using Cursor = Ptr;
  __device__ static Cursor cursor(const KvPlanes &, Ptr p) { return p; }
  __device__ static Cursor step(Cursor c, ptrdiff_t n) { return c + n; }
  template <int N>
  __device__ static Raw<N> load_at(Cursor c, int n) {
    return __ldg(reinterpret_cast<const Raw<N> *>(c + n));
  }

  template <int N>
  __device__ static void widen(const Raw<N> &raw, float (&f)[N]) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
      const float2 t = __half22float2(h[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  template <int N>
  __device__ static float scale(const Raw<N> &) { return 1.0f; }
  template <int N>
  __device__ static float min(const Raw<N> &) { return 0.0f; }

  template <int N>
  __device__ static const Raw<N> &halves(const Raw<N> &raw) {
    return raw;
  }

  // FP32 rounds to nearest even; FP16 bit patterns are stored unchanged (NaN payloads too).
  __device__ static void encode(const KvMutPlanes &t, size_t e, const float (&x)[kEncodeRun]) {
    __align__(16) __half h[kEncodeRun];
#pragma unroll
    for (int i = 0; i < kEncodeRun; i++) h[i] = __float2half_rn(x[i]);
    store(t, e, h);
  }
  __device__ static void encode(const KvMutPlanes &t, size_t e, const __half (&x)[kEncodeRun]) {
    __align__(16) __half h[kEncodeRun];
#pragma unroll
    for (int i = 0; i < kEncodeRun; i++) h[i] = x[i];
    store(t, e, h);
  }
  __device__ static void store(const KvMutPlanes &t, size_t e, const __half (&h)[kEncodeRun]) {
    *reinterpret_cast<uint4 *>(static_cast<__half *>(t.plane[M40LLM_KV_CODES]) + e) =
        *reinterpret_cast<const uint4 *>(h);
  }
};

// (x & kMask) | bits in one instruction (LOP3): from C, with both constants, the compiler makes
// two of it.
template <unsigned kMask>
__device__ __forceinline__ unsigned and_or(unsigned x, unsigned bits) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "n"(kMask), "r"(bits));
  return d;
}

// Codes of N elements of a quantized format in one load: N * bits / 8 bytes.
template <int Bytes>
struct CodeVec;
template <>
struct CodeVec<1> { using Raw = uint8_t; };
template <>
struct CodeVec<2> { using Raw = unsigned short; };
template <>
struct CodeVec<4> { using Raw = unsigned int; };
template <>
struct CodeVec<8> { using Raw = uint2; };

// What the quantized formats share: groups of kGroup elements, each with its parameters
// (Param: an FP16 scale, or an FP16 (scale, min) pair) in the params plane, and the element
// codes, kBits each, in the codes plane. Ptr is the element's index: the kernels' cursors
// then cost one 64-bit register, and the two planes' addresses are formed at the load. Format:
// the derived type, whose encode() of FP32 values the FP16 one widens for.
template <typename Format, int kFormat_, int kBits, typename Param>
struct KvQuant {
  static constexpr int kFormat = kFormat_;
  static constexpr int kGroup = 32;
  static constexpr bool kScaled = true;
  static constexpr int kCodeBits = kBits;
  using Ptr = size_t;
  template <int N>
  struct Raw {
    typename CodeVec<N * kBits / 8>::Raw codes;
    Param param;
  };

  __host__ __device__ static Ptr at(const KvPlanes &, size_t e) { return e; }
  __host__ __device__ static Ptr add(Ptr p, ptrdiff_t n) { return p + (size_t)n; }
  __host__ __device__ static constexpr size_t kRowBytes(int head_dim) {
    return (size_t)head_dim * kBits / 8;
  }

  template <int N>
  __device__ static Raw<N> load(const KvPlanes &t, Ptr p, int n) {
    const size_t e = p + (size_t)n;
    Raw<N> r;
    r.codes = __ldg(reinterpret_cast<const typename CodeVec<N * kBits / 8>::Raw *>(
        static_cast<const uint8_t *>(t.plane[M40LLM_KV_CODES]) + e * kBits / 8));
    r.param = __ldg(static_cast<const Param *>(t.plane[M40LLM_KV_PARAMS]) + e / kGroup);
    return r;
  }

  struct Cursor {
    const uint8_t *codes;
    const Param *param;
  };
  __device__ static Cursor cursor(const KvPlanes &t, Ptr e) {
    return {static_cast<const uint8_t *>(t.plane[M40LLM_KV_CODES]) + e * kBits / 8,
            static_cast<const Param *>(t.plane[M40LLM_KV_PARAMS]) + e / kGroup};
  }
  __device__ static Cursor step(Cursor c, ptrdiff_t n) {
    return {c.codes + n * kBits / 8, c.param + n / kGroup};
  }
  template <int N>
  __device__ static Raw<N> load_at(Cursor c, int n) {
    Raw<N> r;
    r.codes = __ldg(reinterpret_cast<const typename CodeVec<N * kBits / 8>::Raw *>(
        c.codes + n * kBits / 8));
    r.param = __ldg(c.param + n / kGroup);
    return r;
  }
};

// Codes become exact FP32 integers by integer bit operations (sm_52 has no fast int8 -> float
// conversion): the code under the bits of 2^23, then one FP32 subtract of 2^23 (and of Q8's
// offset of 128).
// Q8: offset-binary bytes (code + 128), one FP16 scale per group.
struct KvQ8 : KvQuant<KvQ8, M40LLM_KV_Q8, 8, __half> {
  static constexpr bool kHasMin = false;

  template <int N>
  __device__ static void widen(const Raw<N> &raw, float (&f)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) {
      unsigned word;
      if constexpr (N == 8) word = i < 4 ? raw.codes.x : raw.codes.y;
      else word = raw.codes;
      // 2^23 + byte: byte i % 4 of word under the bits of 2^23 (PRMT selector 7, 4, 4, byte)
      f[i] = __int_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | (i % 4))) - 8388736.0f;
    }
  }
  template <int N>
  __device__ static float scale(const Raw<N> &raw) { return __half2float(raw.param); }
  template <int N>
  __device__ static float min(const Raw<N> &) { return 0.0f; }

  // One group, a lane an element: amax, its FP16 scale d, codes round(x / d) (rint: to nearest
  // even), as the CPU reference (c/src/kv_format.c) does (a max is exact in any order).
  __device__ static void encode_lane(const KvMutPlanes &t, size_t e, float x, int lane) {
    const __half d = __float2half_rn(warp_max(fabsf(x)) / 127.0f);
    const float df = __half2float(d);
    const float q = df == 0.0f ? 0.0f : fmaxf(fminf(rintf(x / df), 127.0f), -127.0f);
    static_cast<uint8_t *>(t.plane[M40LLM_KV_CODES])[e + lane] = (uint8_t)((int)q + 128);
    if (lane == 0) static_cast<__half *>(t.plane[M40LLM_KV_PARAMS])[e / kGroup] = d;
  }
};

// The asymmetric formats' group encoding, a lane an element x: (scale, min) = ((max - min) /
// qmax, min) in FP16 into p, and the lane's code round((x - min) / scale) in [0, qmax] (rint: to
// nearest even), as the CPU reference (c/src/kv_format.c) does (a max is exact in any order).
__device__ __forceinline__ unsigned asym_code(float x, float qmax, __half2 &p) {
  const float lo = -warp_max(-x), hi = warp_max(x);
  p = __halves2half2(__float2half_rn((hi - lo) / qmax), __float2half_rn(lo));
  const float df = __low2float(p), mf = __high2float(p);
  return (unsigned)(df == 0.0f ? 0.0f : fmaxf(fminf(rintf((x - mf) / df), qmax), 0.0f));
}

// What the asymmetric formats (Q4, Q3, Q2) share: one FP16 (scale, min) pair per group, and (Q4,
// Q2) kBits-bit codes packed from bit 0 of `codes`, element i at bit kBits x i. R: the format's
// Raw<N> (Q3 and Q2 have their own).
template <typename Format, int kFormat_, int kBits>
struct KvAsym : KvQuant<Format, kFormat_, kBits, __half2> {
  static constexpr bool kHasMin = true;

  template <int N, typename R>
  __device__ static void widen(const R &raw, float (&f)[N]) {
    const unsigned word = (unsigned)raw.codes;
#pragma unroll
    for (int i = 0; i < N; i++)
      f[i] = __int_as_float(0x4B000000u | ((word >> (kBits * i)) & ((1u << kBits) - 1))) - 8388608.0f;
  }
  template <int N, typename R>
  __device__ static float scale(const R &raw) { return __low2float(raw.param); }
  template <int N, typename R>
  __device__ static float min(const R &raw) { return __high2float(raw.param); }

  // The attention kernels' factors: kBias + code by integer operations only (widen's FP32
  // subtract is an instruction an element): the code in the top mantissa bits of a float of
  // exponent kBits, so kBias = 2^kBits (a larger bias, the code lower down, saves a shift of 8
  // codes but costs precision: a sum of q x factor then cancels kBias x sum(q) against the min).
  // value = factor x scale + (min - kBias x scale), which may round otherwise than widen's code x
  // scale + min (the CPU backend's decode, in one rounding): calls that return values keep widen.
  static constexpr float kBias = (float)(1 << kBits);
  static constexpr unsigned kBiasBits = (127u + kBits) << 23;
  static constexpr int kTop = 23 - kBits;  // the code's bit 0 in a factor
  // bits [from, from + n) of x at bits [to, to + n), under the bits of kBias (or of `under`)
  template <int n, int to = kTop>
  __device__ static unsigned biased(unsigned x, int from, unsigned under = kBiasBits) {
    return and_or<((1u << n) - 1) << to>(from <= to ? x << (to - from) : x >> (from - to), under);
  }
  template <int N, typename R>
  __device__ static void widen_biased(const R &raw, float (&f)[N]) {
    const unsigned word = (unsigned)raw.codes;
#pragma unroll
    for (int i = 0; i < N; i++) f[i] = __uint_as_float(biased<kBits>(word, kBits * i));
  }
};

// Q4: nibbles (element 2j low, 2j + 1 high), one FP16 (scale, min) pair per group.
struct KvQ4 : KvAsym<KvQ4, M40LLM_KV_Q4, 4> {

  // One group, a lane an element (asym_code); even lanes store the bytes.
  __device__ static void encode_lane(const KvMutPlanes &t, size_t e, float x, int lane) {
    __half2 p;
    const unsigned b = asym_code(x, 15.0f, p), high = __shfl_down_sync(0xffffffffu, b, 1);
    if (!(lane & 1))
      static_cast<uint8_t *>(t.plane[M40LLM_KV_CODES])[(e + lane) / 2] = (uint8_t)(b | high << 4);
    if (lane == 0) static_cast<__half2 *>(t.plane[M40LLM_KV_PARAMS])[e / kGroup] = p;
  }
};

// Q2: 2-bit codes (element 4j + i in bits 2i.. of byte j), one FP16 (scale, min) pair per group.
// V only (m40llm.h). A load of 2 elements is their byte shifted (from an index only: the FP32
// kernel's cursors load 4 or more, a byte or two).
struct KvQ2 : KvAsym<KvQ2, M40LLM_KV_Q2, 2> {
  template <int N>
  struct Raw {
    typename CodeVec<(N < 4 ? 4 : N) / 4>::Raw codes;
    __half2 param;
  };

  template <int N>
  __device__ static Raw<N> load(const KvPlanes &t, Ptr p, int n) {
    const size_t e = p + (size_t)n;
    Raw<N> r;
    r.codes = __ldg(reinterpret_cast<const typename CodeVec<(N < 4 ? 4 : N) / 4>::Raw *>(
        static_cast<const uint8_t *>(t.plane[M40LLM_KV_CODES]) + e / 4));
    if constexpr (N < 4) r.codes = (uint8_t)(r.codes >> (2 * (e & 3)));
    r.param = __ldg(static_cast<const __half2 *>(t.plane[M40LLM_KV_PARAMS]) + e / kGroup);
    return r;
  }
  template <int N>
  __device__ static Raw<N> load_at(Cursor c, int n) {
    static_assert(N >= 4, "a cursor loads whole bytes");
    Raw<N> r;
    r.codes = __ldg(reinterpret_cast<const typename CodeVec<N / 4>::Raw *>(c.codes + n / 4));
    r.param = __ldg(c.param + n / kGroup);
    return r;
  }

  // One group, a lane an element (asym_code): a byte's 4 codes OR-ed together over its lanes.
  __device__ static void encode_lane(const KvMutPlanes &t, size_t e, float x, int lane) {
    __half2 p;
    unsigned b = asym_code(x, 3.0f, p) << (2 * (lane & 3));
    b |= __shfl_xor_sync(0xffffffffu, b, 1);
    b |= __shfl_xor_sync(0xffffffffu, b, 2);
    if (!(lane & 3)) static_cast<uint8_t *>(t.plane[M40LLM_KV_CODES])[(e + lane) / 4] = (uint8_t)b;
    if (lane == 0) static_cast<__half2 *>(t.plane[M40LLM_KV_PARAMS])[e / kGroup] = p;
  }
};

// Q3: a group is 12 bytes, its codes' low 2 bits as Q2's 8 bytes, then their bit 2 (element i in
// bit i % 8 of byte 8 + i / 8), one FP16 (scale, min) pair per group. V only (m40llm.h). A load is
// the bytes of the 2-bit plane and the byte of the bit plane that hold its elements, shifted down
// to bit 0 (no branch; 2 elements only from an index, as Q2).
struct KvQ3 : KvAsym<KvQ3, M40LLM_KV_Q3, 3> {
  template <int N>
  struct Raw {
    typename CodeVec<(N < 4 ? 4 : N) / 4>::Raw low;  // 2 bits an element
    uint8_t high;                                     // bit 2 of element i in bit i
    __half2 param;
  };

  // Where element e's 2-bit and 1-bit parts lie, in bytes from the codes plane.
  __host__ __device__ static size_t low_byte(size_t e) { return e / kGroup * 12 + e % kGroup / 4; }
  __host__ __device__ static size_t high_byte(size_t e) { return e / kGroup * 12 + 8 + e % kGroup / 8; }

  // in_byte: e % 8 (2 elements: from the index; 4: the 2-bit byte's parity, as a group's 12
  // bytes start 4-byte aligned; 8: 0).
  template <int N>
  __device__ static Raw<N> read(const uint8_t *low, const uint8_t *high, const __half2 *param,
                                unsigned in_byte) {
    using Low = typename CodeVec<(N < 4 ? 4 : N) / 4>::Raw;
    Raw<N> r;
    r.low = __ldg(reinterpret_cast<const Low *>(low));
    if constexpr (N < 4) r.low = (Low)(r.low >> (2 * (in_byte & 3)));
    r.high = (uint8_t)(__ldg(high) >> (N < 8 ? in_byte : 0u));
    r.param = __ldg(param);
    return r;
  }
  template <int N>
  __device__ static Raw<N> load(const KvPlanes &t, Ptr p, int n) {
    const size_t e = p + (size_t)n;
    const uint8_t *codes = static_cast<const uint8_t *>(t.plane[M40LLM_KV_CODES]);
    return read<N>(codes + low_byte(e), codes + high_byte(e),
                   static_cast<const __half2 *>(t.plane[M40LLM_KV_PARAMS]) + e / kGroup,
                   (unsigned)e & 7u);
  }

  // The two parts' addresses move together by whole groups.
  struct Cursor {
    const uint8_t *low, *high;
    const __half2 *param;
  };
  __device__ static Cursor cursor(const KvPlanes &t, Ptr e) {
    const uint8_t *codes = static_cast<const uint8_t *>(t.plane[M40LLM_KV_CODES]);
    return {codes + low_byte(e), codes + high_byte(e),
            static_cast<const __half2 *>(t.plane[M40LLM_KV_PARAMS]) + e / kGroup};
  }
  __device__ static Cursor step(Cursor c, ptrdiff_t n) {
    return {c.low + n / kGroup * 12, c.high + n / kGroup * 12, c.param + n / kGroup};
  }
  template <int N>
  __device__ static Raw<N> load_at(Cursor c, int n) {
    static_assert(N >= 4, "a cursor loads whole bytes of the 2-bit plane");
    const uint8_t *low = c.low + n / kGroup * 12;
    return read<N>(low, c.high + n / kGroup * 12, c.param + n / kGroup,
                   4u * ((unsigned)(uintptr_t)low & 1u));
  }

  template <int N>
  __device__ static void widen(const Raw<N> &raw, float (&f)[N]) {
    const unsigned low = (unsigned)raw.low, high = (unsigned)raw.high << 2;
#pragma unroll
    for (int i = 0; i < N; i++)
      f[i] = __int_as_float(0x4B000000u | ((low >> (2 * i)) & 3u) | ((high >> i) & 4u)) - 8388608.0f;
  }
  template <int N>
  __device__ static void widen_biased(const Raw<N> &raw, float (&f)[N]) {
    const unsigned low = (unsigned)raw.low, high = (unsigned)raw.high;
#pragma unroll
    for (int i = 0; i < N; i++)  // bit 2 (bit i of high) above bits 0-1
      f[i] = __uint_as_float(biased<2>(low, 2 * i, biased<1, kTop + 2>(high, i)));
  }
  // One group, a lane an element (asym_code): the 2-bit plane as Q2's, the bit plane's 4 bytes
  // one ballot.
  __device__ static void encode_lane(const KvMutPlanes &t, size_t e, float x, int lane) {
    __half2 p;
    const unsigned q = asym_code(x, 7.0f, p);
    unsigned b = (q & 3u) << (2 * (lane & 3));
    b |= __shfl_xor_sync(0xffffffffu, b, 1);
    b |= __shfl_xor_sync(0xffffffffu, b, 2);
    const unsigned high = __ballot_sync(0xffffffffu, q & 4u);
    uint8_t *codes = static_cast<uint8_t *>(t.plane[M40LLM_KV_CODES]);
    if (!(lane & 3)) codes[low_byte(e + lane)] = (uint8_t)b;
    // A group's 12 bytes start 4-byte aligned (rows of 12 x head_dim / 32 bytes).
    if (lane == 0) {
      *reinterpret_cast<unsigned *>(codes + high_byte(e)) = high;
      static_cast<__half2 *>(t.plane[M40LLM_KV_PARAMS])[e / kGroup] = p;
    }
  }
};

// A cache's K and V formats together: what the attention kernels are instantiated for.
template <typename K_, typename V_>
struct KvPair {
  using K = K_;
  using V = V_;
};

// Every (K, V) pair the attention kernels are built for, for the families' explicit
// instantiations; with_kv_pair() below must list the same.
#define M40LLM_KV_PAIRS(X)                                                            \
  X(KvPair<KvF16 M40LLM_COMMA KvF16>) X(KvPair<KvQ8 M40LLM_COMMA KvQ8>)              \
  X(KvPair<KvQ4 M40LLM_COMMA KvQ4>) X(KvPair<KvQ8 M40LLM_COMMA KvQ4>)                \
  X(KvPair<KvQ4 M40LLM_COMMA KvQ3>) X(KvPair<KvQ4 M40LLM_COMMA KvQ2>)
#define M40LLM_COMMA ,

// The pairs a tier may have (m40llm_kv_tier: K Q8 or Q4; V Q8, Q4, Q3 or Q2) that no uniform
// cache has: only the FP32 family's kernels are built for them (attention_fp32_tiers.cu, and
// with scores attention_fp32_tiers_scores.cu).
#define M40LLM_TIER_ONLY_PAIRS(X)                                                     \
  X(KvPair<KvQ8 M40LLM_COMMA KvQ3>) X(KvPair<KvQ8 M40LLM_COMMA KvQ2>)                \
  X(KvPair<KvQ4 M40LLM_COMMA KvQ8>)

// Calls f(Format{}) with the format type of `format`: where a format number becomes a type. A
// format the device side lacks is M40LLM_ERR_UNSUPPORTED.
template <typename F>
int with_kv_format(int format, F &&f) {
  switch (format) {
    case M40LLM_KV_F16: return f(KvF16{});
    case M40LLM_KV_Q8: return f(KvQ8{});
    case M40LLM_KV_Q4: return f(KvQ4{});
    case M40LLM_KV_Q3: return f(KvQ3{});
    case M40LLM_KV_Q2: return f(KvQ2{});
    default: return m40llm_fail(M40LLM_ERR_UNSUPPORTED, "KV format %d has no CUDA kernels", format);
  }
}

// The same for a (K, V) pair of formats: exactly the pairs of M40LLM_KV_PAIRS (each is
// instantiated here); others are unsupported.
template <typename F>
int with_kv_pair(int k_format, int v_format, F &&f) {
  if (k_format == v_format && k_format == M40LLM_KV_F16) return f(KvPair<KvF16, KvF16>{});
  if (k_format == v_format && k_format == M40LLM_KV_Q8) return f(KvPair<KvQ8, KvQ8>{});
  if (k_format == v_format && k_format == M40LLM_KV_Q4) return f(KvPair<KvQ4, KvQ4>{});
  if (k_format == M40LLM_KV_Q8 && v_format == M40LLM_KV_Q4) return f(KvPair<KvQ8, KvQ4>{});
  if (k_format == M40LLM_KV_Q4 && v_format == M40LLM_KV_Q3) return f(KvPair<KvQ4, KvQ3>{});
  if (k_format == M40LLM_KV_Q4 && v_format == M40LLM_KV_Q2) return f(KvPair<KvQ4, KvQ2>{});
  const m40llm_kv_format_desc *k = m40llm_kv_format_find(k_format);
  const m40llm_kv_format_desc *v = m40llm_kv_format_find(v_format);
  return m40llm_fail(M40LLM_ERR_UNSUPPORTED,
                     "the CUDA backend has no kernels for K format %s with V format %s (it has "
                     "F16, Q8 and Q4 each with itself, Q8 K with Q4 V, and Q4 K with Q3 or Q2 V)",
                     k ? k->name : "?", v ? v->name : "?");
}

// Calls f(KvPair<K, V>{}) for a tier's formats (K Q8 or Q4; V Q8, Q4, Q3 or Q2: the front end
// checked them).
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

// The planes of tensor t from row `row` on (a layer's first row, for the attention kernels).
inline KvPlanes kv_planes_at(const m40llm_kv_tensor &t, size_t row) {
  KvPlanes p;
  for (int i = 0; i < M40LLM_KV_PLANES; i++) p.plane[i] = m40llm_kv_at(&t, i, row);
  return p;
}
inline KvMutPlanes kv_mut_planes(const m40llm_kv_tensor &t) {
  KvMutPlanes p;
  for (int i = 0; i < M40LLM_KV_PLANES; i++) p.plane[i] = t.plane[i];
  return p;
}

// One (layer, sequence)'s rows as the append and read kernels address them: element 0 of K/V
// head h at position p is row(h, p) in a tensor's planes; a protected position's FP16 copy is
// slot(h, p) in the tensor's FP16 slots.
struct SeqRows {
  size_t first, head_stride, slot_first, slot_head_stride;  // elements
  int pos, n_tokens, n_kv_heads, head_dim, n_sinks, window;  // positions [pos, pos + n_tokens)
  float rot_scale;

  __device__ size_t row(int h, int p) const {
    return first + (size_t)h * head_stride + (size_t)p * head_dim;
  }
  __device__ size_t slot(int h, int p) const {
    return slot_first + (size_t)h * slot_head_stride +
           (size_t)m40llm_kv_protected_slot(n_sinks, window, p) * head_dim;
  }
};

inline SeqRows seq_rows(const m40llm_kvcache *c, int layer, int seq, int pos, int n_tokens) {
  const m40llm_kvcache_options *o = &c->opts;
  SeqRows r;
  r.first = m40llm_kv_row(o, layer, seq, 0, 0) * o->head_dim;
  r.head_stride = (size_t)o->max_seq_len * o->head_dim;
  r.slot_first = m40llm_kv_protected_row(o, c->slots, layer, seq, 0, 0) * o->head_dim;
  r.slot_head_stride = (size_t)c->slots * o->head_dim;
  r.pos = pos;
  r.n_tokens = n_tokens;
  r.n_kv_heads = o->n_kv_heads;
  r.head_dim = o->head_dim;
  r.n_sinks = c->n_sinks;
  r.window = c->window;
  r.rot_scale = m40llm_rotation_scale(m40llm_rotation_block(o->head_dim));
  return r;
}
