// The widening and rounding launches of io_rows.cuh, and the staging buffer they use.
#include <cuda_fp16.h>

#include "io_rows.cuh"
#include "tuning.cuh"

namespace {

// FP16 through the conversion instructions every GPU has; bfloat16 with integer operations
// (m40llm_f32_to_bf16's rule). No half arithmetic: the M40 has none.
struct F16Rows {
  __device__ static float widen(unsigned short h) { return __half2float(__ushort_as_half(h)); }
  __device__ static unsigned short narrow(float x) { return __half_as_ushort(__float2half_rn(x)); }
};
struct Bf16Rows {
  __device__ static float widen(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
  __device__ static unsigned short narrow(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
  }
};

template <typename T>
__global__ void widen_kernel(float *__restrict__ dst, const unsigned short *__restrict__ src,
                             size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = T::widen(src[i]);
}

template <typename T>
__global__ void narrow_kernel(unsigned short *__restrict__ dst, const float *__restrict__ src,
                              size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = T::narrow(src[i]);
}

unsigned blocks_for(size_t n) {
  const size_t want = (n + kIoThreads - 1) / kIoThreads;
  return (unsigned)(want < kIoMaxBlocks ? want : kIoMaxBlocks);
}

}  // namespace

int m40llm_cuda_io_stage(m40llm_cuda_state *st, size_t floats, float **out) {
  const int rc = m40llm_cuda_grow(st, &st->io_stage, &st->io_stage_bytes, floats * sizeof(float),
                                  "staging buffer of 16-bit rows");
  *out = static_cast<float *>(st->io_stage);
  return rc;
}

int m40llm_cuda_widen(m40llm_cuda_state *st, float *dst, const void *src, size_t n, int dtype) {
  const unsigned short *s = static_cast<const unsigned short *>(src);
  if (dtype == M40LLM_DTYPE_BF16)
    widen_kernel<Bf16Rows><<<blocks_for(n), kIoThreads, 0, st->stream>>>(dst, s, n);
  else
    widen_kernel<F16Rows><<<blocks_for(n), kIoThreads, 0, st->stream>>>(dst, s, n);
  M40LLM_CUDA_CHECK_LAUNCH("widen_kernel");
  return M40LLM_OK;
}

int m40llm_cuda_narrow(m40llm_cuda_state *st, void *dst, const float *src, size_t n, int dtype) {
  unsigned short *d = static_cast<unsigned short *>(dst);
  if (dtype == M40LLM_DTYPE_BF16)
    narrow_kernel<Bf16Rows><<<blocks_for(n), kIoThreads, 0, st->stream>>>(d, src, n);
  else
    narrow_kernel<F16Rows><<<blocks_for(n), kIoThreads, 0, st->stream>>>(d, src, n);
  M40LLM_CUDA_CHECK_LAUNCH("narrow_kernel");
  return M40LLM_OK;
}
