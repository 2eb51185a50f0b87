// The caller's FP16 and BF16 q and out rows (m40llm_dtype) around the FP32 attention kernels:
// q is widened into FP32 rows of the context's staging buffer, the kernels run on them as on an
// FP32 caller's, and their FP32 output is rounded into the caller's rows (to nearest even), two
// small launches on the stream. The kernels themselves stay FP32-only: the element type
// branches inside them, a load and a store path per type, cost the FP32 calls up to 10% (compute_52
// code) and 1.6 us (sm_90, small shapes) in the A/B of bench/RESULTS.md.
#pragma once

#include "common.cuh"

// A staging buffer of at least `floats` floats (grown, never shrunk; the context's own).
int m40llm_cuda_io_stage(m40llm_cuda_state *st, size_t floats, float **out);
// dst[i] = src[i] widened (exactly), n elements of type dtype.
int m40llm_cuda_widen(m40llm_cuda_state *st, float *dst, const void *src, size_t n, int dtype);
// dst[i] = src[i] rounded to dtype, to nearest even (a NaN stays a NaN).
int m40llm_cuda_narrow(m40llm_cuda_state *st, void *dst, const float *src, size_t n, int dtype);

// f(q, out) with FP32 rows: the caller's own when dtype is F32, else staged copies of its n
// elements of q (and room for n of out, rounded into the caller's out after f succeeds).
template <typename F>
int with_f32_rows(m40llm_cuda_state *st, const void *q, void *out, size_t n, int dtype, F &&f) {
  if (dtype == M40LLM_DTYPE_F32)
    return f(static_cast<const float *>(q), static_cast<float *>(out));
  float *stage = nullptr;
  int rc = m40llm_cuda_io_stage(st, 2 * n, &stage);
  if (rc == M40LLM_OK) rc = m40llm_cuda_widen(st, stage, q, n, dtype);
  if (rc == M40LLM_OK) rc = f(static_cast<const float *>(stage), stage + n);
  if (rc == M40LLM_OK) rc = m40llm_cuda_narrow(st, out, stage + n, n, dtype);
  return rc;
}
