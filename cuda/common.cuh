// Helpers shared by the CUDA backend's translation units: error reporting, the backend state,
// and device-side loads that widen FP16 to FP32 in registers (no half arithmetic: sm_52 has
// none worth using, and the precision policy accumulates in FP32).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "internal.h"

struct m40llm_cuda_state {
  cudaStream_t stream;
  bool owns_stream;
  int sm_count;
  int cc_major;
  size_t smem_per_sm, smem_per_block, smem_reserved_per_block;  // shared memory, in bytes
  void *workspace;  // split-K partials, grown only by m40llm_cuda_reserve_for or a larger call
  size_t workspace_bytes;
  int occupancy[4][33];  // resident attention blocks per SM, by [log2 group tile][head_dim / 8]
  struct {
    signed char usable;  // whether this build runs it here: 0 = not asked yet, 1 yes, -1 no
    signed char stages;  // K/V steps per warp it stages in shared memory (0: in registers)
    int smem;            // its dynamic shared memory, in bytes
    int occupancy;       // resident blocks per SM
    bool dependent;      // whether its image waits for the grid before it (sm_90+)
  } mma[2][2][9];  // the tensor-core kernels, by [staged][half-width blocks][head_dim / 16]
  signed char dependent;  // the same for attention.cu's kernels: 0 = not asked, 1 yes, -1 no
};

// Turns a CUDA error into a status with detail. Clears the error if it is not sticky, so the
// context stays usable after, e.g., a failed allocation.
int m40llm_cuda_error(cudaError_t err, const char *what);

#define M40LLM_CUDA_TRY(call)                                           \
  do {                                                                  \
    cudaError_t m40llm_err_ = (call);                                   \
    if (m40llm_err_ != cudaSuccess) return m40llm_cuda_error(m40llm_err_, #call); \
  } while (0)

// Every entry point makes the context's device current: the calling thread may use others.
#define M40LLM_CUDA_ENTER(ctx) M40LLM_CUDA_TRY(cudaSetDevice((ctx)->device))

// Checks the launch just made (bad configuration, missing kernel image for this GPU).
#define M40LLM_CUDA_CHECK_LAUNCH(kernel)                                          \
  do {                                                                            \
    cudaError_t m40llm_err_ = cudaGetLastError();                                 \
    if (m40llm_err_ != cudaSuccess) return m40llm_cuda_error(m40llm_err_, "launching " kernel); \
  } while (0)

// Programmatic dependent launch (sm_90+): the attention kernels launch as dependents of the
// kernel before them in the stream, so that their launch and start overlap its end instead of
// following it. Each waits, in every block and before it touches global memory, for the grids
// before it to finish and their writes to be visible. A kernel lets the next one launch (once
// all its blocks have) only after its own wait, so at most one launched grid waits ahead of
// the running one; the append kernel, launched plainly, does so at its start. Below sm_90 both
// are no-ops, and the host launches a kernel as a dependent only where its image has the wait.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// N consecutive halves as one load: N * 2 bytes, aligned to that.
template <int N>
struct HalfVec;
template <>
struct HalfVec<2> { using Raw = unsigned int; };
template <>
struct HalfVec<4> { using Raw = uint2; };
template <>
struct HalfVec<8> { using Raw = uint4; };

// Issues the load through the read-only path; the value is used later, after other loads.
template <int N>
__device__ __forceinline__ typename HalfVec<N>::Raw load_raw(const __half *p) {
  return __ldg(reinterpret_cast<const typename HalfVec<N>::Raw *>(p));
}

// Widens N halves held in registers to FP32.
template <int N>
__device__ __forceinline__ void widen(const typename HalfVec<N>::Raw &raw, float (&f)[N]) {
  const __half2 *h = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
  for (int i = 0; i < N / 2; i++) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
