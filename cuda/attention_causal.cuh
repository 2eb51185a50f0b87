// Causal attention over the cache (m40llm_kvcache_attn_causal_f32q): what the FP32 causal
// kernel (attention_causal_fp32.cu) and its dispatcher (attention_causal_dispatch.cu) share.
//   A launch takes up to kCausalMaxItems sequences ("items"), each with its query rows at
//   positions pos .. pos + rows - 1 (already in the cache). A block takes BR consecutive rows
//   of one item times a tile of one K/V head's query heads, over one split of the positions
//   they see; grid x counts (item, row tile, split), grid y (K/V head, head tile).
#pragma once

#include "attention.cuh"

// Items per launch: the plan travels as a kernel argument (4 KB on sm_52).
constexpr int kCausalMaxItems = 64;

struct CausalPlan {
  int32_t n_items;
  int32_t splits;      // splits of every (item, row tile) along its positions; 1: no combine
  int32_t window;      // m40llm_causal_options.window (0: none)
  int32_t sinks, ring; // the cache's protected tokens (n_sinks, window), 0 where it has none
  int32_t seq[kCausalMaxItems];
  int32_t pos[kCausalMaxItems];          // the position of the item's first query row
  int32_t rows[kCausalMaxItems];
  int32_t row_first[kCausalMaxItems];    // the item's first row in this launch's q and out
  int32_t chunk[kCausalMaxItems];        // positions per split, from the first row's first
  int32_t window_begin[kCausalMaxItems]; // protected tokens: m40llm_window_begin
  int32_t block_begin[kCausalMaxItems + 1];  // item i owns blocks [begin[i], begin[i + 1])
};

struct CausalArgs {
  KvPlanes k, v;                 // this layer's K and V from its first row
  const __half *kept_k, *kept_v; // this layer's FP16 slots, [seq][kv_head][slot][dim], or null
  const float *q;                // this launch's rows: [row][n_heads][head_dim]
  float *out;
  float *part_o, *part_m, *part_l;  // splits > 1: [row * splits + split][n_heads]([head_dim])
  size_t seq_stride, head_stride;            // elements, of K/V
  size_t slot_seq_stride, slot_head_stride;  // elements, of the FP16 slots
  int n_heads, group, head_tiles, head_dim;
  float q_scale;  // scale * log2(e)
  float rot_scale;
  bool rot_k, rot_v;
};

using CausalKernel = void (*)(CausalArgs, CausalPlan);

// The FP32 causal kernel for a cache's formats, head_dim and group tile, as the dispatcher
// launches it.
struct CausalPass {
  CausalKernel kernel;
  int threads;
  size_t smem;
  int rows;    // query rows a block takes (its tile of query vectors / group tile)
  int tile;    // positions per K/V tile
  int target;  // blocks that fill the GPU (SMs x resident blocks x waves)
};

// What every causal kernel derives from its block index and the plan. A block's share: its
// item, split, first row r0 and rows nr (the last row tile, whose rows see the most, first),
// its first query head h0 and heads nh, K/V head kvh, and its first row in q and out.
namespace {

struct CausalBlock {
  int item, split, r0, nr, kvh, h0, nh;
  size_t row_q;
};

template <int BR, int GT>
__device__ __forceinline__ CausalBlock causal_block(const CausalArgs &a, const CausalPlan &plan) {
  CausalBlock b;
  int item = 0;
  for (int hi = plan.n_items - 1; item < hi;) {
    const int mid = (item + hi + 1) >> 1;
    if (plan.block_begin[mid] <= (int)blockIdx.x) item = mid; else hi = mid - 1;
  }
  const int local = blockIdx.x - plan.block_begin[item];
  const int rows = plan.rows[item];
  b.item = item;
  b.split = local % plan.splits;
  b.r0 = ((rows + BR - 1) / BR - 1 - local / plan.splits) * BR;
  b.nr = min(BR, rows - b.r0);
  b.kvh = blockIdx.y / a.head_tiles;
  b.h0 = b.kvh * a.group + (blockIdx.y % a.head_tiles) * GT;
  b.nh = min(GT, (b.kvh + 1) * a.group - b.h0);
  b.row_q = (size_t)plan.row_first[item] + b.r0;
  return b;
}

// The positions a block's rows see within its split of its item's, [kv_begin, kv_end).
struct CausalRange {
  int first_pos, last_pos, kv_begin, kv_end;
};

__device__ __forceinline__ CausalRange causal_range(const CausalPlan &plan, const CausalBlock &b) {
  CausalRange r;
  const int item = b.item, window = plan.window;
  r.first_pos = plan.pos[item] + b.r0;
  r.last_pos = r.first_pos + b.nr - 1;
  const int item_begin = window > 0 ? max(0, plan.pos[item] - window + 1) : 0;
  const int s_begin = item_begin + b.split * plan.chunk[item];
  r.kv_begin = max(s_begin, window > 0 ? max(0, r.first_pos - window + 1) : 0);
  r.kv_end = min(s_begin + plan.chunk[item], r.last_pos + 1);
  return r;
}

// The block's K/V head's first element in K and V.
__device__ __forceinline__ size_t kv_base(const CausalArgs &a, const CausalPlan &plan,
                                          const CausalBlock &b) {
  return (size_t)plan.seq[b.item] * a.seq_stride + (size_t)b.kvh * a.head_stride;
}

}  // namespace

// The FP32 kernels' pass (attention_causal_fp32.cu); `few`: for items of at most out->rows
// rows, where a class has a kernel of smaller blocks for them (else the same pass).
template <typename P>
int causal_fp32_pass(m40llm_cuda_state *st, int head_dim, int gt, bool few, CausalPass *out);
// The tensor-core prefill kernel's pass (attention_causal_mma.cu) for an FP16 cache without
// rotation or protected tokens: a null kernel where this build or GPU has none (before sm_80,
// head_dim past 256 or not a multiple of 8).
int causal_mma_pass(m40llm_cuda_state *st, int head_dim, int gt, CausalPass *out);
