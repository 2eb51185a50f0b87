// What the CUDA backend's translation units share: the backend state, error reporting, launch
// checks, programmatic dependent launches, warp reductions and an unaligned float4 store.
#pragma once

#include <cuda_runtime.h>

#include "internal.h"

// KV format numbers (m40llm_kv_format) index the per-kernel tables below.
constexpr int kKvFormats = M40LLM_KV_Q2 + 1;

// The tensor-core split kernel's variants: K/V through registers, staged in shared memory
// (sm_90), a tiered call's launch, causal rows, and the first and the third exporting their
// scores (attention_mma.cuh).
enum {
  kMmaDirect = 0,
  kMmaStaged = 1,
  kMmaTier = 2,
  kMmaCausal = 3,
  kMmaTierScores = 4,
  kMmaDirectScores = 5,
  kMmaVariants = 6
};

struct m40llm_cuda_state {
  cudaStream_t stream;
  bool owns_stream;
  int sm_count;
  int cc_major;
  size_t smem_per_sm, smem_per_block, smem_reserved_per_block;  // shared memory, in bytes
  void *workspace;  // scratch of the attention calls (split-K partials): cuda_workspace()
  size_t workspace_bytes;
  void *io_stage;  // FP32 copies of a 16-bit caller's q and out rows (io_rows.cuh)
  size_t io_stage_bytes;
  void *scores;  // m40llm_kvcache_attn_importance_ex's weights (attention_weights.cu)
  size_t scores_bytes;
  // The FP32 split kernels' resident blocks per SM, by [K format][V format][log2 tile][dim / 8].
  int fp32_occupancy[kKvFormats][kKvFormats][4][33][2];  // [..][with exported scores]
  // The FP32 causal kernels' resident blocks per SM, by [K format][V format][log2 tile]
  // [kernel class: head_dim 64, 128, 256, and 64 for few rows (attention_causal_fp32.cu)].
  int causal_occupancy[kKvFormats][kKvFormats][4][4];
  // The causal prefill kernel on tensor cores (FP16 K/V): resident blocks per SM by [log2 tile]
  // [head-dim class 64, 128, 256]; 0 = not asked yet, -1 = this build has no image for this GPU.
  int causal_mma_occupancy[4][3];
  struct MmaInfo {
    signed char usable;  // whether this build runs it here: 0 = not asked yet, 1 yes, -1 no
    signed char stages;  // K/V steps per warp it stages in shared memory (0: in registers)
    int smem;            // its dynamic shared memory, in bytes
    int occupancy;       // resident blocks per SM
    bool dependent;      // whether its image waits for the grid before it (sm_90+)
  } mma[kKvFormats][kKvFormats][kMmaVariants][3][17];  // the tensor-core kernels, by [K format]
                        // [V format][variant][block width: mma_warps(), half, broad][head_dim / 16]
  // The kernel of every tier pair at once (attn_mma_tiers_kernel), by [block width: mma_warps(),
  // half][head_dim / 16].
  MmaInfo mma_tiers[2][17];
  // Whether the FP32 split and the combine kernels' images wait for the grid before them:
  // 0 = not asked yet, 1 yes, -1 no.
  signed char fp32_dependent, combine_dependent;
  // A tiered cache's call (attention_tiers.cu) runs its launches side by side: the first on
  // `stream`, each other on a stream of its own, forked from and joined back into `stream` by
  // events (in a capture, branches of the graph). Made with the first tiered cache.
  cudaStream_t side[M40LLM_MAX_TIERS];
  cudaEvent_t fork, join[M40LLM_MAX_TIERS];
  bool has_side;
  // Pointers that passed the pointer-kind check (m40llm_cuda_check_pointer), round robin;
  // cleared by every free on the context.
  bool check_pointers;  // the context's option: false skips m40llm_cuda_check_pointer
  const void *ptr_ok[8];
  unsigned ptr_ok_next;
};

inline m40llm_cuda_state *cuda_state(const m40llm_context *ctx) {
  return static_cast<m40llm_cuda_state *>(ctx->state);
}

// Turns a CUDA error into a status with detail. Clears the error if it is not sticky, so the
// context stays usable after, e.g., a failed allocation; a sticky error (a device fault) gives
// M40LLM_ERR_CONTEXT_LOST, which the front end records in the context.
int m40llm_cuda_error(cudaError_t err, const char *what);

// Grows the context's workspace to at least `bytes` (never shrinks it) and returns it.
int m40llm_cuda_workspace(m40llm_cuda_state *st, size_t bytes, void **out);

// M40LLM_OK unless the context's stream is being captured into a CUDA graph, where `what` (one
// of the context's buffers) cannot grow: an allocation, and the wait for the old buffer's
// users, cannot be captured. Refused then with M40LLM_ERR_UNSUPPORTED before anything is
// queued, so that the capture stays valid.
int m40llm_cuda_may_grow(m40llm_cuda_state *st, const char *what);
// *buf (*buf_bytes long, the context's, never shrunk) made at least `bytes` long: the old one
// freed once the stream is idle, refused during a capture (m40llm_cuda_may_grow, named `what`).
int m40llm_cuda_grow(m40llm_cuda_state *st, void **buf, size_t *buf_bytes, size_t bytes,
                     const char *what);

// A CUDA call's result as a status (detail named `what` on failure).
inline int m40llm_cuda_status(cudaError_t err, const char *what) {
  return err == cudaSuccess ? M40LLM_OK : m40llm_cuda_error(err, what);
}

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

// Whether a kernel's image for this GPU waits for the grid before it (sm_90+ images do; a
// compute_52-only build's JIT image does not), cached in *cache (0 = not asked yet).
inline int kernel_waits(const m40llm_cuda_state *st, const void *kernel, signed char *cache,
                        bool *out) {
  if (*cache == 0) {
    signed char waits = -1;
    if (st->cc_major >= 9) {
      cudaFuncAttributes attr;
      M40LLM_CUDA_TRY(cudaFuncGetAttributes(&attr, kernel));
      if (attr.ptxVersion >= 90) waits = 1;
    }
    *cache = waits;
  }
  *out = *cache > 0;
  return M40LLM_OK;
}

// threadIdx.x as a value the compiler cannot reuse from an earlier read: what derives from it is
// computed again where it is wanted, not held in registers (on sm_52, spilled) from before.
__device__ __forceinline__ int opaque_thread() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// Programmatic dependent launch (sm_90+): the attention kernels launch as dependents of the
// kernel before them in the stream, so that their launch and start overlap its end instead of
// following it. Each waits, in every block and before it reads or writes global memory, for the
// grids before it to finish and their writes to be visible (a tensor-core block's requests of
// its first rows into L2 go out before: prefetch_rows_l2). A kernel lets the next one launch (once
// all its blocks have) only after its own wait, so at most one launched grid waits ahead of
// the running one; the append kernel, launched plainly, does so at its start. The exception:
// a tiered call's chained launches (m40llm_attn_plan::chained) wait at their end, so up to all
// of a call's launches and its combine are launched at once. Below sm_90 both are no-ops, and
// the host launches a kernel as a dependent only where its image has the wait.
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

// acc += w * v, per component.
__device__ __forceinline__ void fma4(float w, const float4 &v, float4 &acc) {
  acc.x = fmaf(w, v.x, acc.x);
  acc.y = fmaf(w, v.y, acc.y);
  acc.z = fmaf(w, v.z, acc.z);
  acc.w = fmaf(w, v.w, acc.w);
}

// Four floats of the caller's memory, which promises only 4-byte alignment.
__device__ __forceinline__ void store4(float *dst, float4 x) {
  dst[0] = x.x;
  dst[1] = x.y;
  dst[2] = x.z;
  dst[3] = x.w;
}
