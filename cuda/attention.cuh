// What the decode-attention kernels share: the launch arguments, where a split block's work
// lies, and how a block hands its result to the output or to the combine kernel. The FP32
// split kernel lives in attention.cu, the tensor-core one (sm_80+) in attention_mma.cu.
#pragma once

#include "attention_plan.h"
#include "common.cuh"
#include "tuning.cuh"

struct AttnArgs {
  const __half *k;  // this layer's K: [seq][kv_head][pos][dim]
  const __half *v;
  const float *q;   // [item][n_heads][head_dim]
  float *out;       // [item][n_heads][head_dim]
  float *part_o;    // [split][n_heads][head_dim]
  float *part_m;    // [split][n_heads]
  float *part_l;    // [split][n_heads]
  size_t seq_stride;   // elements between sequences of one layer
  size_t head_stride;  // elements between K/V heads of one sequence
  int n_heads;
  int group;        // query heads per K/V head
  int head_tiles;   // blocks per K/V head along grid y
  int head_dim;
  float q_scale;    // scale * log2(e)
  int stages;       // tensor-core kernel: K/V steps each warp stages in shared memory (0: none)
};

using SplitKernel = void (*)(AttnArgs, m40llm_attn_plan);

constexpr float kLog2e = 1.4426950408889634f;

// One split block's share: grid x is the split, grid y the K/V head and tile of its query heads.
struct SplitBlock {
  int item, split, n_splits;
  int p_begin, p_end;  // positions
  int h0, nh;          // first query head, heads in this tile (<= the tile size)
  const __half *k, *v; // this sequence's and K/V head's rows
};

__device__ __forceinline__ SplitBlock split_block(const AttnArgs &a, const m40llm_attn_plan &plan,
                                                  int group_tile) {
  SplitBlock b;
  b.split = blockIdx.x;
  int lo = 0, hi = plan.n_items - 1;  // the item owning this split
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (plan.split_begin[mid] <= b.split) lo = mid; else hi = mid - 1;
  }
  b.item = lo;
  b.n_splits = plan.split_begin[lo + 1] - plan.split_begin[lo];
  b.p_begin = (b.split - plan.split_begin[lo]) * plan.chunk;
  b.p_end = min(plan.len[lo], b.p_begin + plan.chunk);
  const int kvh = blockIdx.y / a.head_tiles;
  b.h0 = kvh * a.group + (blockIdx.y % a.head_tiles) * group_tile;
  b.nh = min(group_tile, (kvh + 1) * a.group - b.h0);
  const size_t base = (size_t)plan.seq[lo] * a.seq_stride + (size_t)kvh * a.head_stride;
  b.k = a.k + base;
  b.v = a.v + base;
  return b;
}

// A head's (max, sum) partial of a block whose sequence has several splits.
__device__ __forceinline__ void store_split_stats(const AttnArgs &a, const SplitBlock &b, int h,
                                                  float m, float l) {
  const size_t p = (size_t)b.split * a.n_heads + h;
  a.part_m[p] = m;
  a.part_l[p] = l;
}

// A block's result for one (query head h, dim d): the normalised output when the sequence has
// one split, else the (max, sum, unnormalised output) partial the combine kernel merges. A zero
// sum means no positions: the documented output is zeros.
__device__ __forceinline__ void store_split_result(const AttnArgs &a, const SplitBlock &b, int h,
                                                   int d, float o, float m, float l) {
  if (b.n_splits == 1) {
    a.out[((size_t)b.item * a.n_heads + h) * a.head_dim + d] = l > 0.0f ? o / l : 0.0f;
  } else {
    a.part_o[((size_t)b.split * a.n_heads + h) * a.head_dim + d] = o;
    if (d == 0) store_split_stats(a, b, h, m, l);
  }
}

// The same result for a kernel that normalises the output itself, 4 dims at a time (d a multiple
// of 4): normalised with one split, else unnormalised, with the head's (max, sum) stored apart.
__device__ __forceinline__ void store_split_out4(const AttnArgs &a, const SplitBlock &b, int h,
                                                 int d, float4 o) {
  if (b.n_splits == 1) {
    float *dst = a.out + ((size_t)b.item * a.n_heads + h) * a.head_dim + d;  // 4-byte aligned
    dst[0] = o.x;
    dst[1] = o.y;
    dst[2] = o.z;
    dst[3] = o.w;
  } else {
    // The workspace is the library's: rows of head_dim (a multiple of 4) floats, 16-byte aligned.
    reinterpret_cast<float4 *>(a.part_o + ((size_t)b.split * a.n_heads + h) * a.head_dim)[d / 4] = o;
  }
}

// Whether this compiler builds the tensor-core kernel's sm_90+ images with K/V steps staged in
// shared memory by bulk copies (PTX 8.0: CUDA 12+).
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12 && M40LLM_MMA_BULK
#define M40LLM_MMA_BULK_BUILT 1
#else
#define M40LLM_MMA_BULK_BUILT 0
#endif

// The tensor-core split kernel for this head_dim in blocks of `warps` warps, or null where it
// does not apply: head_dim not a multiple of 16 from 32 to 128, or warps neither mma_warps()
// nor (not staged) half of it. Staged: its sm_90+ images (M40LLM_MMA_BULK_BUILT) stage K/V in
// shared memory, AttnArgs::stages steps per warp; elsewhere it is the same as the kernel that
// loads through registers. Whether it can run is for the caller to ask the runtime.
SplitKernel attn_mma_kernel_for(int head_dim, bool staged, int warps);
