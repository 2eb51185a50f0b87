// The device side of the KV formats (the host side is c/src/kv_format.h): how kernels address,
// load and widen K/V elements, and how the append kernel encodes them. Kernels take the format
// as a template parameter and touch K/V only through it. Element e of a tensor is element
// e % head_dim of row e / head_dim, rows in the order of m40llm_kv_row().
//
// A format type provides:
//   Ptr, MutPtr            an element's place in every plane (codes, parameters)
//   at(planes, e)          element e of a tensor whose planes are given
//   add(ptr, n)            n elements on
//   Raw<N>, load<N>(p, n)  N consecutive elements from n elements past p, in registers as
//                          stored (N a power of two up to 8, p + n a multiple of N), through
//                          the read-only path
//   widen<N>(raw, f)       those elements as FP32
//   halves<N>(raw)         those elements as FP16 bit patterns (the tensor-core kernels)
//   kEncodeRun, encode()   the append kernel's unit: kEncodeRun elements from FP32 or FP16
//   kRowBytes(D)           bytes of one codes row (the staged tensor-core kernel copies rows)
#pragma once

#include <cuda_fp16.h>
#include <stddef.h>

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
  static constexpr int kEncodeRun = 8;
  template <int N>
  using Raw = typename HalfVec<N>::Raw;
  using Ptr = const __half *;
  using MutPtr = __half *;

  __host__ __device__ static Ptr at(const KvPlanes &t, size_t e) {
    return static_cast<const __half *>(t.plane[M40LLM_KV_CODES]) + e;
  }
  __host__ __device__ static MutPtr at(const KvMutPlanes &t, size_t e) {
    return static_cast<__half *>(t.plane[M40LLM_KV_CODES]) + e;
  }
  __host__ __device__ static Ptr add(Ptr p, ptrdiff_t n) { return p + n; }
  __host__ __device__ static constexpr size_t kRowBytes(int head_dim) {
    return (size_t)head_dim * sizeof(__half);
  }

  // The value is used later, after other loads: the read-only path lets them all go out first.
  template <int N>
  __device__ static Raw<N> load(Ptr p, int n) {
    return __ldg(reinterpret_cast<const Raw<N> *>(p + n));
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
  __device__ static const Raw<N> &halves(const Raw<N> &raw) {
    return raw;
  }

  // FP32 rounds to nearest even; FP16 bit patterns are stored unchanged (NaN payloads too).
  __device__ static void encode(MutPtr dst, const float (&x)[kEncodeRun]) {
    __align__(16) __half h[kEncodeRun];
#pragma unroll
    for (int i = 0; i < kEncodeRun; i++) h[i] = __float2half_rn(x[i]);
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(h);
  }
  __device__ static void encode(MutPtr dst, const __half (&x)[kEncodeRun]) {
    __align__(16) __half h[kEncodeRun];
#pragma unroll
    for (int i = 0; i < kEncodeRun; i++) h[i] = x[i];
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(h);
  }
};

// Every format type, for the explicit instantiations of each kernel family: X(KvF16) ...
#define M40LLM_KV_FORMAT_TYPES(X) X(KvF16)

// Calls f(Format{}) with the format type of `format`: the one place a KV format number becomes
// a type. A format the device side lacks is M40LLM_ERR_UNSUPPORTED.
template <typename F>
int with_kv_format(int format, F &&f) {
  switch (format) {
    case M40LLM_KV_F16: return f(KvF16{});
    default: return m40llm_fail(M40LLM_ERR_UNSUPPORTED, "KV format %d has no CUDA kernels", format);
  }
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
