// What the decode-attention kernel families share: the launch arguments, where a split block's
// work lies, how a block hands its result to the output or to the combine kernel, and how each
// family describes its launches to the dispatcher (attention_dispatch.cu).
//   attention_fp32.cu     the FP32 split kernel (every GPU; the M40's)
//   attention_mma.cuh     the tensor-core split kernel (sm_80+ builds; instances in
//                         attention_mma.cu, attention_mma_tiers.cu, attention_mma_causal.cu,
//                         and for calls with weights attention_mma_scores.cu and
//                         attention_mma_tiers_scores.cu)
//   attention_combine.cu  the combine kernels, which merge a sequence's split partials
#pragma once

#include "attention_plan.h"
#include "common.cuh"
#include "kv_format.cuh"
#include "rotation.cuh"
#include "softmax.cuh"
#include "tuning.cuh"

struct AttnArgs {
  KvPlanes k, v;    // this layer's K and V from its first row: [seq][kv_head][pos][dim]
  const float *q;   // [item][n_heads][head_dim]
  float *out;       // [item][n_heads][head_dim]
  float *part_o;    // [split][n_heads][head_dim]
  float *part_m;    // [split][n_heads]
  float *part_l;    // [split][n_heads]
  size_t seq_stride;   // elements between sequences of one layer
  size_t head_stride;  // elements between K/V heads of one sequence
  int n_heads;
  int group;        // query heads per K/V head
  int head_dim;
  float q_scale;    // scale * log2(e)
  int stages;       // tensor-core kernel: K/V steps each warp stages in shared memory (0: none)
  // Quantized caches: K and V rotated (q is rotated to meet K, the output back
  // from V's frame) by rot_scale's transform. (This struct is at 120 bytes; at 160 the sm_52
  // kernels of 4 and 8 heads spilled, with CUDA 11.8.)
  bool rot_k, rot_v;
  float rot_scale;
};

using SplitKernel = void (*)(AttnArgs, m40llm_attn_plan);

// A split kernel's grid (split_grid): x is the tile of a K/V head's query heads, y the split, z
// the K/V head, so that a K/V head's tiles of one split run side by side and share its reads
// (with the tiles apart, a call's tiles of a split could run a wave apart). y's bound, 65535,
// is M40LLM_PLAN_MAX_SPLITS: a built plan stays near its target of a few blocks an SM, and a
// protected one widens its kept splits to fit (m40llm_attn_plan_protect, _tier).
__device__ __forceinline__ int block_split() { return (int)blockIdx.y; }
__device__ __forceinline__ int block_head_tile() { return (int)blockIdx.x; }
__device__ __forceinline__ int block_kv_head() { return (int)blockIdx.z; }
__device__ __forceinline__ int grid_kv_heads() { return (int)gridDim.z; }

constexpr float kLog2e = 1.4426950408889634f;

// One split block's share: its split, K/V head and tile of the head's query heads (block_split).
// P: the cache's KvPair of formats.
template <typename P>
struct SplitBlock {
  int item, split, n_splits;
  int p_begin, p_end;  // positions (or, for a plan's kept rows, FP16 slot rows)
  bool skip;           // the split is another launch's (m40llm_attn_plan_protect)
  bool kept;           // the split is of a kept part (FP16 slot rows) of a protected cache
  int h0, nh;          // first query head, heads in this tile (<= the tile size)
  typename P::K::Ptr k;  // this sequence's and K/V head's rows
  typename P::V::Ptr v;
};

// kProtected: the kernel may be launched over a plan of protected tokens or of a tiered
// cache's launch (the FP32 family; in the tensor-core kernels the branch cost 1-2%).
// kRange: the split's rows are wanted (not where a kernel only needs its block's coordinates
// again at the end). kNumber: a plan of M40LLM_PLAN_TIER's split number and count are wanted
// (else they are the caller's: tier_split_number).
template <typename P, bool kProtected, bool kRange = true, bool kNumber = true>
__device__ __forceinline__ SplitBlock<P> split_block(const AttnArgs &a,
                                                     const m40llm_attn_plan &plan,
                                                     int group_tile) {
  SplitBlock<P> b;
  b.split = block_split();
  int lo = 0, hi = plan.n_items - 1;  // the item owning this split
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (plan.split_begin[mid] <= b.split) lo = mid; else hi = mid - 1;
  }
  b.item = lo;
  b.n_splits = plan.split_begin[lo + 1] - plan.split_begin[lo];
  b.p_begin = (b.split - plan.split_begin[lo]) * plan.chunk;
  b.p_end = min(plan.len[lo], b.p_begin + plan.chunk);
  b.skip = b.kept = false;
  if (kProtected && kRange && plan.role == M40LLM_PLAN_TIER) {  // the split's number and rows
    const m40llm_attn_tier_split t =
        m40llm_attn_tier_split_of(&plan, lo, b.split - plan.split_begin[lo]);
    if (kNumber) {
      b.split = t.split;
      b.n_splits = plan.max_splits;  // at least 2: always a partial, merged with the others'
    }
    b.kept = t.kept;
    b.p_begin = t.begin;
    b.p_end = t.end;
  } else if (kProtected && kRange && plan.role != M40LLM_PLAN_ALL &&
             plan.role != M40LLM_PLAN_MIXED) {  // protected tokens: the split's part
    const m40llm_attn_parts parts =
        m40llm_attn_item_parts(plan.len[lo], plan.window_begin[lo], plan.sinks, plan.window);
    int j = b.split - plan.split_begin[lo], part = 3;
    b.p_begin = b.p_end = 0;  // an empty item's one split: the codes launch writes zeros
    for (int k = 0; k < 4; k++) {
      const int chunk = k < 3 ? plan.kept_chunk : plan.chunk;
      const int splits = (parts.count[k] + chunk - 1) / chunk;
      if (j < splits) {
        part = k;
        b.p_begin = parts.first[k] + j * chunk;
        b.p_end = min(parts.first[k] + parts.count[k], b.p_begin + chunk);
        break;
      }
      j -= splits;
    }
    b.kept = part < 3;
    b.skip = plan.role != M40LLM_PLAN_PARTS &&
             (b.kept ? M40LLM_PLAN_KEPT : M40LLM_PLAN_CODES) != plan.role;
  }
  const int kvh = block_kv_head();
  b.h0 = kvh * a.group + block_head_tile() * group_tile;
  b.nh = min(group_tile, (kvh + 1) * a.group - b.h0);
  const size_t base = (size_t)plan.seq[lo] * a.seq_stride + (size_t)kvh * a.head_stride;
  b.k = P::K::at(a.k, base);
  b.v = P::V::at(a.v, base);
  return b;
}

// A decode step's new K/V rows (plan.append_k: m40llm_kvcache_append_attn_ex on an F16 cache,
// whose lengths already count them): each block holding an item's last position, one a tile
// of its K/V head's query heads, writes that head's row there before it reads it. The row is
// stored as an append stores it (FP16 kept bit for bit, FP32 and BF16 rounded to nearest
// even), so the call's results are the two calls'. The reads that follow go through the
// read-only path, which is safe because no block reads any 32-byte sector of the row before
// its own write: rows are whole sectors (head_dim a multiple of 16: cuda_attention_appends)
// and no split reads past its end. The fences put the row in L2, where the staged kernel's
// bulk copies (the async proxy) see it too, before the block's barrier.
template <typename P, typename Block>
__device__ __forceinline__ void write_appended_row(const AttnArgs &a,
                                                   const m40llm_attn_plan &plan, const Block &b) {
  if constexpr (std::is_same<P, KvPair<KvF16, KvF16>>::value) {
    if (!plan.append_k || b.p_begin >= b.p_end || b.p_end != plan.len[b.item]) return;
    const int D = a.head_dim;
    const size_t src = ((size_t)b.item * (a.n_heads / a.group) + block_kv_head()) * D;
    const size_t dst = (size_t)(b.p_end - 1) * D;
    for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) {
      const int t = i >= D, d = i - t * D;
      const void *from = t ? plan.append_v : plan.append_k;
      __half x;
      if (plan.append_dtype == M40LLM_DTYPE_F16)
        x = static_cast<const __half *>(from)[src + d];
      else if (plan.append_dtype == M40LLM_DTYPE_BF16)
        x = __float2half_rn(__uint_as_float(
            (unsigned)static_cast<const unsigned short *>(from)[src + d] << 16));
      else
        x = __float2half_rn(static_cast<const float *>(from)[src + d]);
      const_cast<__half *>(t ? b.v : b.k)[dst + d] = x;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && M40LLM_MMA_BULK_BUILT
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the staged kernel's bulk copies
#endif
    __threadfence();
    __syncthreads();
  }
}

// The call's number of this block's split in a launch of M40LLM_PLAN_TIER, apart from
// split_block (the FP32 kernel keeps it in shared memory: on sm_52 any value of split_block's
// kept through the tile loop is spilled).
__device__ __forceinline__ int tier_split_number(const m40llm_attn_plan &plan) {
  const int split = block_split();
  int lo = 0, hi = plan.n_items - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (plan.split_begin[mid] <= split) lo = mid; else hi = mid - 1;
  }
  return plan.split_base[lo] + split - plan.split_begin[lo];
}

// A split's first row's position less the row: 0 but for a kept part's FP16 slots, whose two
// ring runs hold the window's positions, in order, from window_begin on. (A tier's rows are
// slots in no order: their positions are plan.map's.) split: the launch's block y.
__device__ __forceinline__ int split_pos_shift(const m40llm_attn_plan &plan, int item, int split) {
  // (A TIER plan's kept rows lead an item, kept_chunk 0, only in the tensor-core kernels',
  // which place their scores themselves.)
  if (plan.role == M40LLM_PLAN_ALL || (plan.role == M40LLM_PLAN_TIER && !plan.kept_k)) return 0;
  const int len = plan.role == M40LLM_PLAN_TIER ? plan.full_len[item] : plan.len[item];
  const m40llm_attn_parts parts =
      m40llm_attn_item_parts(len, plan.window_begin[item], plan.sinks, plan.window);
  // Parts 0-2 by name, not by index: an indexed part puts them in local memory on sm_52.
  const int c = plan.kept_chunk, wb = plan.window_begin[item];
  int j = split - plan.split_begin[item] - (parts.count[0] + c - 1) / c;
  if (j < 0) return 0;
  j -= (parts.count[1] + c - 1) / c;
  if (j < 0) return wb - parts.first[1];
  j -= (parts.count[2] + c - 1) / c;
  return j < 0 ? wb + parts.count[1] - parts.first[2] : 0;
}

// A head's (max, sum) partial of a block whose sequence has several splits.
__device__ __forceinline__ void store_split_stats(const AttnArgs &a, int split, int h,
                                                  const SoftmaxState &s) {
  const size_t p = (size_t)split * a.n_heads + h;
  a.part_m[p] = s.m;
  a.part_l[p] = s.l;
}

// A block's result for one (query head h, dim d): the normalised output when the sequence has
// one split, else the (max, sum, unnormalised output) partial the combine kernel merges. A zero
// sum means no position had weight: the documented output is zeros.
template <typename Block>
__device__ __forceinline__ void store_split_result(const AttnArgs &a, const Block &b, int h,
                                                   int d, float o, const SoftmaxState &s) {
  if (b.n_splits == 1) {
    a.out[((size_t)b.item * a.n_heads + h) * a.head_dim + d] = s.normalise(o);
  } else {
    a.part_o[((size_t)b.split * a.n_heads + h) * a.head_dim + d] = o;
    if (d == 0) store_split_stats(a, b.split, h, s);
  }
}

// The same for a kernel that normalises the output itself, 4 dims at a time (d a multiple of
// 4): normalised with one split, else unnormalised, with the head's (max, sum) stored apart.
template <typename Block>
__device__ __forceinline__ void store_split_out4(const AttnArgs &a, const Block &b, int h, int d,
                                                 float4 o) {
  if (b.n_splits == 1) {
    store4(a.out + ((size_t)b.item * a.n_heads + h) * a.head_dim + d, o);
  } else {
    // The workspace is the library's: rows of head_dim (a multiple of 4) floats, 16-byte aligned.
    reinterpret_cast<float4 *>(a.part_o + ((size_t)b.split * a.n_heads + h) * a.head_dim)[d / 4] = o;
  }
}

// The same, one element already normalised where the sequence has one split (its head's (max,
// sum) stored apart where it has several).
template <typename Block>
__device__ __forceinline__ void store_split_value(const AttnArgs &a, const Block &b, int h, int d,
                                                  float x) {
  const int row = b.n_splits == 1 ? b.item : b.split;
  (b.n_splits == 1 ? a.out : a.part_o)[((size_t)row * a.n_heads + h) * a.head_dim + d] = x;
}

// How a cache's query heads map onto blocks: each K/V head's group of query heads in tiles of
// gt (a power of two up to kMaxGroupTile), units blocks per (sequence, split).
struct Grouping {
  int group, gt, head_tiles, units;
};

inline Grouping grouping_for(const m40llm_kvcache_options *o) {
  Grouping g;
  g.group = o->n_heads / o->n_kv_heads;
  g.gt = 1;
  while (g.gt < g.group && g.gt < kMaxGroupTile) g.gt <<= 1;
  g.head_tiles = (g.group + g.gt - 1) / g.gt;
  g.units = o->n_kv_heads * g.head_tiles;
  return g;
}

// The split kernels' grid (block_split): total_splits splits of every unit.
inline dim3 split_grid(int total_splits, const Grouping &g) {
  return dim3((unsigned)g.head_tiles, (unsigned)total_splits, (unsigned)(g.units / g.head_tiles));
}

// Bytes of the combine's partials of `splits` rows: output, max and sum of every head.
inline size_t attn_partial_bytes(int splits, int n_heads, int head_dim) {
  return (size_t)splits * n_heads * ((size_t)head_dim + 2) * sizeof(float);
}

// A split kernel as the dispatcher launches it: its block shape and how many blocks fill the GPU.
struct SplitPass {
  SplitKernel kernel;
  int threads;
  size_t smem;
  int tile;        // positions a block consumes per step: split chunks are multiples of it
  int target;      // SMs x resident blocks x waves
  int stages;      // AttnArgs::stages
  bool dependent;  // launched as a programmatic dependent of the kernel before it
  bool mixed;      // reads a protected cache's kept rows itself (M40LLM_PLAN_MIXED): one launch
  bool parts;      // FP32: runs the kept parts' splits too (M40LLM_PLAN_PARTS): one launch (where
                   // mixed is not set, or the plan's splits are under kFp32MixedMinRows)
  // Blocks a small problem's plan still makes where each takes kMmaFillMinRows positions or
  // more (0, or fewer positions: one an SM). The tensor-core kernel's 1-4 resident blocks an SM
  // want all of theirs: with one an SM, an MQA head_dim 256 call left half an SM's warps idle.
  int fill;
};

// The tensor-core family's passes for a cache (attention_mma.cu):
//   pass    mma_warps() warps a block, at head_dims kMmaStagedMinDim..kMmaStagedMaxDim with K/V
//           staged where the GPU can
//   direct  the same loading through registers, for plans whose splits are too short for
//           staging to pay
//   fine    the same in blocks of half the warps, for plans of more blocks than a wave
//   broad   direct in blocks of mma_broad_warps(), for plans of at most a block an SM
// Each of the first three is the one before it where there is no other; broad has no kernel
// where there is none.
struct SplitPasses {
  SplitPass pass, direct, fine, broad;
};

// The FP32 family's pass for the cache (never fails to have one). P: the KvPair of formats.
// scores: a call with weights (m40llm_attn_plan), whose kernel exports the scores.
template <typename P>
int fp32_split_pass(m40llm_cuda_state *st, int head_dim, const Grouping &g, bool scores,
                    SplitPass *out);

// The tensor-core family's passes where this build and GPU have its kernels for head_dim and
// the formats (every pair; quantized ones at head_dims that are multiples of 32, up to 128,
// and 192 and 256); otherwise pass.kernel is null.
template <typename P>
int mma_split_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *out);
// The same for a call with weights: instances that also write each score at its position and
// every split's (max, sum), a lone one's too (attention_mma_scores.cu); through registers, no
// broad pass.
template <typename P>
int mma_split_scores_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *out);
// The same for a tiered call's launches (M40LLM_PLAN_TIER: a tier's rows, after an item's kept
// rows in the launch that reads them), for every tier pair (attention_mma_tiers.cu); pass and
// direct are one. mma_tier_scores_passes: their instances that also write each score at its
// position (a call with weights: plan.weights, plan.map; attention_mma_tiers_scores.cu).
template <typename P>
int mma_tier_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *out);
template <typename P>
int mma_tier_scores_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *out);
// A pair of formats as one number.
__host__ __device__ constexpr int kv_pair_id(int k_format, int v_format) {
  return k_format * kKvFormats + v_format;
}

// One launch for all of a tiered call's tiers on tensor cores (attention_mma_tiers.cu): every
// tier's plan travels in its parameters, over 4 KB, which CUDA 12.1 and later pass on sm_70+
// (and drivers of 12.1 and later). A build that also has older architectures' code (e.g.
// sm_52 beside sm_90) cannot compile such a kernel for them, and has none (kMmaOneLaunch).
#if defined(__CUDACC_VER_MAJOR__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
#define M40LLM_MMA_ONE_LAUNCH 1
#else
#define M40LLM_MMA_ONE_LAUNCH 0
#endif
#if M40LLM_MMA_ONE_LAUNCH
#ifdef __CUDA_ARCH_LIST__
constexpr int kBuiltArchs[] = {__CUDA_ARCH_LIST__};
#else
constexpr int kBuiltArchs[] = {0};
#endif
constexpr bool all_archs_volta() {
  for (int arch : kBuiltArchs)
    if (arch < 700) return false;
  return true;
}
constexpr bool kMmaOneLaunch = kTensorCores && all_archs_volta();
// Launch l of a tiered call's (a tier's rows, the first also the items' kept rows): its pair
// (kv_pair_id), arguments and plan (M40LLM_PLAN_TIER), whose blocks are grid y y0[l] on: its
// plan's split_begin counts from there.
struct MmaTierLaunch {
  int n;
  int pair[M40LLM_MAX_TIERS];
  int y0[M40LLM_MAX_TIERS];
  AttnArgs args[M40LLM_MAX_TIERS];
  m40llm_attn_plan plan[M40LLM_MAX_TIERS];
};
// Its passes at head_dim (pass: mma_warps() warps, fine: half; direct is pass), where this
// build, GPU and driver have the kernel (*have); their kernel fields stay null:
// mma_tiers_launch finds the kernel of a pass.
int mma_tiers_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *out, bool *have);
int mma_tiers_launch(cudaStream_t stream, int head_dim, const SplitPass &pass, dim3 grid,
                     bool dependent, const MmaTierLaunch &l);
#endif
// The same for causal rows (kMmaCausal: an item's query rows packed into a tile's rows, each
// masked at its own position; attention_mma_causal.cu), for the uniform caches' pairs.
template <typename P>
int mma_causal_passes(m40llm_cuda_state *st, int head_dim, SplitPasses *out);

// The shortest split a plan makes (a small problem's may be shorter, to fill the SMs).
inline int split_min_chunk(const Grouping &g, int tile) {
  return kSplitRowsPerHead * g.gt > tile ? kSplitRowsPerHead * g.gt : tile;
}

// A launch's arguments with the call's q, out and partials (those of io).
inline AttnArgs with_call_io(AttnArgs args, const AttnArgs &io) {
  args.q = io.q;
  args.out = io.out;
  args.part_o = io.part_o;
  args.part_m = io.part_m;
  args.part_l = io.part_l;
  return args;
}

// Plans a launch over items of lengths lens and picks its pass: the tensor-core family's staged
// pass unless its splits come out too short for staging (then the direct pass), its fine pass
// where the plan has more blocks than a wave of short splits, its broad pass where it has at
// most a block an SM, of kMmaBroadMinRows positions or more, and an SM holds two.
inline SplitPass plan_split_pass(m40llm_cuda_state *st, const SplitPasses &passes,
                                 const Grouping &g, const int32_t *seq_ids, const int32_t *lens,
                                 int n, m40llm_attn_plan *plan) {
  SplitPass pass = passes.pass;
  int64_t unit_rows = 0;  // positions x units: the work the blocks share
  for (int i = 0; i < n; i++) unit_rows += (int64_t)lens[i] * g.units;
  const auto build = [&] {
    const int min_chunk = split_min_chunk(g, pass.tile);
    const bool fill = pass.fill > 0 && unit_rows >= (int64_t)kMmaFillMinRows * pass.fill;
    m40llm_attn_plan_build(plan, seq_ids, lens, n, g.units, pass.target,
                           fill ? pass.fill : st->sm_count, min_chunk, pass.tile);
  };
  build();
  if (pass.stages > 0 && plan->chunk < kMmaStagedMinSteps * pass.tile) {
    pass = passes.direct;  // as many blocks as it fits: its splits are no longer
    build();
  }
  if (pass.stages == 0 && passes.fine.threads < pass.threads && plan->chunk <= kMmaFineMaxChunk &&
      (int64_t)plan->total_splits * g.units > pass.target) {
    pass = passes.fine;
    build();
  }
  // Where the broad kernel holds one block an SM, its plan has no more blocks than this one
  // (its target and fill are the SM count, this plan's minimum) and no shorter splits.
  if (passes.broad.kernel && passes.broad.target <= st->sm_count &&
      pass.target >= 2 * st->sm_count && (int64_t)plan->total_splits * g.units <= st->sm_count &&
      plan->chunk >= kMmaBroadMinRows) {
    pass = passes.broad;
    build();
  }
  return pass;
}

// Rows per split of protected tokens' kept parts: a few tiles, so that a window's rows, which
// are few, run in parallel rather than one tile after another in one block.
inline int kept_chunk(int tile) {
  return tile >= kKeptSplitRows ? tile : kKeptSplitRows / tile * tile;
}

// Asks what the combine needs before a call's first launch (whether its image waits).
int combine_prepare(m40llm_cuda_state *st, bool *dependent);
// Merges the partials of a plan with several splits for some item.
int combine_launch(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan,
                   bool dependent);

// Turns the scores a plan with weights had its split kernel export into softmax weights, from
// every split's (max, sum) partial (attention_weights.cu).
// With imp.rows set, it reduces them into importance instead (m40llm_kvcache_attn_importance_ex):
// rows[(item * n_kv_heads + g) * stride + p] = decay * itself + the largest weight of p over
// K/V head g's query heads. With imp.acc set (m40llm_kvcache_attn_observe_ex), it adds the
// largest weight of p over every query head to acc[plan.seq[item] * acc_stride + p] and counts
// the call, every query head's merged softmax state first put into states ([item][n_heads]).
struct ImportanceArgs {
  float *rows;
  int64_t stride;
  float decay;
  m40llm_imp_acc *acc = nullptr;
  int64_t acc_stride = 0;
  float2 *states = nullptr;
};
int weights_launch(m40llm_cuda_state *st, const AttnArgs &a, const m40llm_attn_plan &plan,
                   const ImportanceArgs &imp);
// A scratch buffer of at least `floats` floats for the weights an importance call reduces, and
// after them `states` softmax states (grown, never shrunk; the context's own).
int scores_stage(m40llm_cuda_state *st, size_t floats, size_t states, float **out,
                 float2 **out_states);

// What a call does besides its output, for its first item: the weights it exports (NULL:
// none) in rows weights_stride apart, written as scores by the split kernels and turned into
// weights (or, with imp.rows, reduced into importance) by weights_launch; or the rows it
// appends (m40llm_attn_plan's append_k; an F16 cache's), of row_bytes an item. For the items
// from `first` on: at(first).
struct CallExport {
  float *weights;
  size_t weights_stride;
  ImportanceArgs imp;
  int n_heads, n_kv_heads;
  const char *append_k = nullptr, *append_v = nullptr;
  int append_dtype = M40LLM_DTYPE_F32;
  size_t append_row_bytes = 0;
  CallExport at(int first) const {
    CallExport x = *this;
    // The staged scores of an importance or observe call are a launch's: not moved.
    if (imp.rows) x.imp.rows += (size_t)first * n_kv_heads * (size_t)imp.stride;
    else if (weights && !imp.acc) x.weights += (size_t)first * n_heads * weights_stride;
    if (append_k) {
      x.append_k += (size_t)first * append_row_bytes;
      x.append_v += (size_t)first * append_row_bytes;
    }
    return x;
  }
};

// Attention of one launch's worth of items (at most M40LLM_PLAN_MAX_ITEMS) of a uniform cache
// (attention_dispatch.cu), `rows` FP32 query rows each, [item][rows][n_heads][head_dim]: with
// rows 1 and no window the decode call's (lens: the items' lengths); otherwise causal rows on
// the tensor cores (the caller has asked mma_causal_passes), row t of item i seeing the
// positions before lens[i] - rows + t + 1 (with window W > 0, the last W of them). Never
// allocates: a causal launch's splits are cut to the workspace.
template <typename P>
int attend_rows(const m40llm_kvcache *c, int layer, const int32_t *seq_ids, const int32_t *lens,
                int n, int rows, int window, const float *q, float *out, float scale);

// Decode attention over a tiered cache (attention_tiers.cu): FP32 rows of n_seqs sequences.
// limits: each row's visible positions (those before limits[i]), or null for every position of
// its sequence; with limits the FP32 kernels' instances with scores run the call (they mask a
// tier's rows by its slot map; the tensor-core kernels read it only for the scores they write).
int tier_attention(const m40llm_kvcache *c, int layer, const int32_t *seq_ids,
                   const int32_t *limits, int n_seqs, const float *q, float *out, float scale,
                   const CallExport &x);
// Causal attention over a tiered cache without a sliding window: each query row as a decode
// row of its sequence that sees the positions up to its own (the tiers read once a row).
int tier_attention_causal(const m40llm_kvcache *c, int layer, const m40llm_append_item *items,
                          int n_items, const float *q, float *out, float scale);

// Launches a kernel of any family on `stream`, as a programmatic dependent of the kernel before
// it there where `dependent`.
template <typename Kernel, typename... Args>
int launch_attention_kernel(cudaStream_t stream, const char *what, Kernel kernel, dim3 grid,
                            int threads, size_t smem, bool dependent, const Args &...args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent ? 1 : 0;
  return m40llm_cuda_status(cudaLaunchKernelEx(&cfg, kernel, args...), what);
}
