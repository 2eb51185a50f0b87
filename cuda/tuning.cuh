// Every tuning knob of the CUDA kernels, each once, with the reason in a line. The measurements
// behind each value are in bench/RESULTS.md ("The tuning table"). The one build switch is
// M40LLM_NO_TENSOR_CORES (CMake: -DM40LLM_TENSOR_CORES=OFF), which keeps every GPU on the FP32
// kernels.
#pragma once

// ---- FP32 split kernel (attention_fp32.cu) ----
// 128 threads x 8 resident blocks = 64 registers a thread, 50% occupancy on sm_52; larger
// register budgets with deeper load batches ran slower on every GPU measured, except for wide
// 8-head tiles (below).
constexpr int kAttnThreads = 128;
constexpr int kAttnMinBlocksPerSm = 8;
// Query heads per block: a K/V head's group is done in tiles of up to this many heads.
constexpr int kMaxGroupTile = 8;
// Head-dim classes the kernel is compiled for; a cache uses the smallest that fits.
constexpr int kHeadDimClasses[] = {64, 128, 256};

// 8-head tiles at head_dim 128 and 256, in the kernels of a head_dim equal to its class, are
// "wide": 128 registers a thread (4 blocks an SM, 25%
// occupancy on sm_52), tiles of 32 + 32 bytes a thread, all 8 heads in one pass. In 64 registers
// they took 16 + 16 bytes and two passes of 4 heads (K widened twice, a reduction per pass): 18.1
// issue slots per F16 element at head_dim 128 on sm_52 against 12.8 (bench/RESULTS.md, "Wide
// 8-head tiles").
// At head_dim 64 a wide kernel (16-position tiles) was faster at batch 1 and slower where blocks
// fill the GPU (compute_52 on an H100: B1 64/8 D64 L32K 60.4 -> 52.4 us, B8 L8K 86.5 -> 103.3,
// B32 L2K 86.3 -> 104.3), so those keep 64 registers, as do runtime head_dims (index walks: a wide
// one was 15% slower, B8 64/8 D112 L8K 162.1 -> 186.9 us).
__host__ __device__ constexpr bool wide_tile(int group_tile, int dmax, bool exact) {
  return group_tile >= 8 && dmax >= 128 && exact;
}
// The split kernel's resident blocks an SM, its launch bounds: 64 registers a thread, or 128 for
// a wide tile.
__host__ __device__ constexpr int attn_min_blocks(bool wide) { return wide ? 4 : kAttnMinBlocksPerSm; }

// Positions per tile: one register batch of K and V per thread, all loads of a tile in flight
// at once (32 + 32 bytes of F16 a thread; sm_5x/6x 16 + 16 for tiles of 8 heads in 64 registers,
// and for `tight` ones: 4 heads with a quantized K or V and head_dim known only at run time,
// where 32 + 32 spill and the M40's bandwidth x latency needs less). `dense` (sm_5x/6x): a
// quantized tile at a compile-time head_dim (dense_tiles in attention_fp32.cuh: up to 4 heads,
// and most wide ones) takes twice the rows, up to 32: its codes are a quarter to half F16's
// bytes, so F16's rows left few bytes in flight and paid a tile's barriers and softmax per 16
// (compute_52 on an H100, Q4 at 4 heads: 0.65-0.90x the time); so does an F16 wide tile, for
// its score pass's two rows a lane (score_rows). The host pass (no __CUDA_ARCH__) takes the
// largest value, which sizes shared memory and the splits' granularity for every device pass.
__host__ __device__ constexpr int tile_rows(int group_tile, int dmax, bool tight, bool wide,
                                            bool dense = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  return dense ? (dmax >= 128 ? 4096 / dmax : 32)
               : (wide ? 2048 : group_tile >= 8 || (group_tile >= 4 && tight) ? 1024 : 2048) / dmax;
#elif defined(__CUDA_ARCH__)
  return (void)group_tile, (void)tight, (void)wide, (void)dense, 2048 / dmax;
#else
  return (void)group_tile, (void)tight, (void)wide,
         dense && dmax >= 128 ? 4096 / dmax : 2048 / dmax;
#endif
}

// Query heads a thread takes at once over the same K or V registers: all 8 of an 8-head tile
// spill in 64 registers, so those take passes (sm_5x/6x: 4; sm_70+, larger tiles: 2); a wide
// tile takes all 8.
__host__ __device__ constexpr int heads_per_pass(int group_tile, bool wide) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  return wide ? group_tile : group_tile > 4 ? 4 : group_tile;
#else
  return wide ? group_tile : group_tile > 4 ? 2 : group_tile;
#endif
}

// K rows a lane takes in the score pass: 2 in a wide tile whose lanes would otherwise hold 4 or
// more chunks of a row (head_dim 128 at 32 positions, 256 at 16), so that each chunk of q loaded
// from shared memory serves two rows: half the score pass's shared loads, whose L1 wavefronts
// bound the wide kernels on an H100 through the compute_52 PTX (L1/TEX at 78%, issue at 45%;
// with two rows 0.72-0.77x the time at group 8: bench/RESULTS.md, "Wide 8-head tiles share...").
__host__ __device__ constexpr int score_rows(bool wide, int t, int dmax) {
  return wide && dmax / 8 / (kAttnThreads / t) >= 4 ? 2 : 1;
}

// V columns per thread in the output pass: heads x columns accumulators stay at 8-16 registers.
// `wide`: 4 heads over a quantized V at a compile-time head_dim take 4 (16 accumulators): a row's
// codes and parameters are then two registers for 4 columns, and the tile 32 + 32 bytes of F16.
__host__ __device__ constexpr int pv_columns(int group_tile, bool wide = false) {
  return group_tile == 1 ? 8 : group_tile == 2 || (group_tile == 4 && wide) ? 4 : 2;
}

// ---- FP32 causal kernels (attention_causal_fp32.cu) ----
// causal_warp_kernel (head_dim class 64): query vectors x head-dim class a block holds, 64 x 64
// (q, a K/V tile and the weights in 35 KB of shared memory, 2 blocks an SM on sm_52).
constexpr int kCausalVectorDims = 4096;
// Query vectors a warp, so 8 warps a block. A score step of 4 dims is a K load and 8 broadcast q
// loads for 32 FFMAs, an output step of 4 positions 8 broadcast weight loads and 4 V loads for
// 64 FFMAs.
constexpr int kCausalWarpVectors = 8;
// Threads an SM it is compiled for: 128 registers a thread, 2 blocks. At head_dim 128 (which it
// served until causal_wide_kernel took that class) on an H200 the version with 136 registers (3
// blocks of 4 warps an SM) ran at 0.89-1.49x the previous kernel's time, the one with 169-182 (2
// blocks) at 1.11-1.17x; with 126 registers (4 blocks, which registers limit there) at
// 0.85-0.90x (bench/RESULTS.md, "The M40's causal kernel").
constexpr int kCausalWarpSmThreads = 512;
// Its score pass walks the head in steps of this many dims, its output pass the tile in steps of
// this many positions, each step unrolled whole (dims up to the next step are zeros): the whole
// head and tile. The M40 model (sm_52 SASS of a full tile, bench/m40_causal_model.md) 58-59% of
// the FP32 peak (steps of 4) -> 68-69%, 118 registers, no spill; the M40 path on an H200
// 0.953-0.987x the time at prefill.
constexpr int kCausalWarpScoreDims = 64;
constexpr int kCausalWarpOutputRows = 32;
// causal_wide_kernel (head_dim classes 128 and 256, and 64 for items of at most 16 / the group
// tile rows): query vectors a block (4 warps, a lane 4 of them in both passes), and blocks an SM
// it is compiled for, so 128 registers a thread (38 KB of shared memory at 128, 46 KB at 256: 2
// blocks an SM on sm_52, 4 on sm_90). At 256 with 146 registers (launch bounds for 2 blocks) it
// ran 1.03-1.30x the time at prefill on the M40 path.
constexpr int kCausalWideVectors = 16;
constexpr int kCausalWideMinBlocksPerSm = 4;
// Positions per K/V tile, both kernels: a lane each in causal_warp_kernel's score pass.
constexpr int kCausalTile = 32;
// Positions a split of a causal call takes at least (its partials stay a few % of its K/V).
constexpr int kCausalMinSplitRows = 256;

// ---- Split planning (attention_dispatch.cu) ----
// Positions per query head a split takes at least: the partials it writes and the combine
// reads back stay near 3% of its K/V bytes.
constexpr int kSplitRowsPerHead = 64;
// Blocks a plan aims for, in waves of resident blocks: the FP32 kernel's 8 blocks per SM need
// two waves to even out; the tensor-core kernel's 1-4 were best at one.
constexpr int kAttnWaves = 2;
// Protected tokens: rows per split of the FP16 slots (a multiple of the tile where the tile is
// smaller): short splits run a window's few rows side by side. 32 against 1 tile, 16, 64, 128,
// 256 (M40 path, 9 shapes): best or within 2 us everywhere; longer ones up to 14 us slower.
constexpr int kKeptSplitRows = 32;
// Protected tokens on the FP32 kernel: plans whose splits take this many rows or more read the
// kept rows in the codes' splits (M40LLM_PLAN_MIXED), shorter ones in splits of their own
// (M40LLM_PLAN_PARTS). A split that holds kept rows and codes runs a tile or two more; where
// splits are a few tiles long that block is the call's longest (M40 path on an H200, B1 32/8
// D128 L1K, 64-row splits: 10.9 -> 13.3 us); at 256 rows and up the grid's fewer blocks win
// (B32 32/8 D128 L2K Q4: 126 -> 90 us).
constexpr int kFp32MixedMinRows = 256;
constexpr int kMmaWaves = 1;

// ---- Combine (attention_combine.cu) ----
// Plans of at most this many splits per item at head_dim <= kCombineFewMaxDim: one warp per
// query head, every split's partials loaded at once, kCombineFewHeads heads a block.
constexpr int kCombineFewSplits = 8;
constexpr int kCombineFewHeads = 4;
constexpr int kCombineFewMaxDim = 128;
// Longer plans: a block of kCombineWarps warps per (item, head), each warp loading
// combine_batch(K) splits at once, K float4 words a lane (one memory round trip for 48 splits
// up to head_dim 128, for 32 above), in 64 registers (50% on sm_52; 8 splits of one word
// spilled). Blocks of half a head's dims at head_dim 256 (K = 1, twice the blocks) ran slower
// there: B1 8/1 D256 L32K 1.08x with the broad pass (H200, bench/RESULTS.md).
constexpr int kCombineWarps = 8;
constexpr int kCombineMinBlocksPerSm = 4;
__host__ __device__ constexpr int combine_batch(int words) { return words == 1 ? 6 : 4; }
// Plans whose splits take a block of kCombineWarps more than one round trip, on a grid of at
// most a block an SM (batch 1 with few K/V heads at long contexts; the FP32 kernel's longer
// plans), take blocks of kCombineWideWarps, one round trip for up to 192 (head_dim <= 128) or
// 128 splits, on SMs that were idle: on an H200 B1 16/1 D64 L32K 0.88x the time, 8/1 D256 L32K
// 0.91x, 28/4 D128 L32K 0.93x; the M40 path 0.94-1.00x at batch 1 of few K/V heads (16 warps
// not measured; bench/RESULTS.md, "The combine in blocks of 32 warps").
constexpr int kCombineWideWarps = 32;
constexpr bool combine_wide(int max_splits, int words, long long blocks, int sm_count) {
  return max_splits > kCombineWarps * combine_batch(words) && blocks <= sm_count;
}
// attn_weights_kernel (exported scores into weights): a block per (item, query head, about
// kWeightsChunk positions of the longest item).
constexpr int kWeightsThreads = 256;
constexpr int kWeightsChunk = 2048;
// attn_importance_kernel: a block per (item, K/V head, slice of positions), at least
// kImportanceChunk positions a block (a position a thread), its group's scores loaded together.
// At 2048 / group positions a block (the weights kernel's scores a block) it took 12.2 us against
// the weights kernel's 9.5 (H100, ncu, B1 32/8 D128 L8K); at one position a thread, see
// bench/RESULTS.md, "Importance".
constexpr int kImportanceChunk = kWeightsThreads;
// The grid: at most one wave of this many resident blocks an SM (its launch bounds), whole
// kImportanceChunks a block, so that a block's merge of its heads' partials is paid once a block
// slot, not once every 256 positions (with the merge by warps: compute_52 on an H100, B1 32/8
// L32K 85.9 -> 69.3 us). 6 hold its 40 registers on sm_52; at 8 (32 registers) it spilled.
// Other values were not measured.
constexpr int kImportanceBlocksPerSm = 6;
// attn_observe_kernel: a block per (item, slice of positions), kObservePositions positions at a
// time, each position's query heads split among kObserveHeadGroups threads (at 32 heads, 8
// loads a thread, issued together). A thread a position and its heads in turn took 12.1 us
// (ncu, base clocks, B8 32/8 L8K); other values were not measured.
constexpr int kObservePositions = 64;
constexpr int kObserveHeadGroups = 4;
// Query heads whose softmax states (8 bytes each) attn_observe_kernel holds in shared memory:
// caches placed by importance with more are refused at create (cuda_check_cache).
constexpr int kObserveMaxHeads = 4096;
// Splits a lane loads at once when a warp merges a head's partials: up to 128 splits in one
// memory round trip (B1 32/8 L32K: 128 splits on an H100, about 50 on the M40).
constexpr int kImportanceMergeBatch = 4;

// ---- Tensor-core split kernel (attention_mma.cu, sm_80+ builds) ----
#ifdef M40LLM_NO_TENSOR_CORES
constexpr bool kTensorCores = false;
#else
constexpr bool kTensorCores = true;
#endif
// Warps per block: 8 below head_dim 128 (fewer, larger splits), 4 from it (2 blocks per SM).
__host__ __device__ constexpr int mma_warps(int head_dim) { return head_dim >= 128 ? 4 : 8; }
// Plans of at most one block an SM (few K/V heads at batch 1: MQA, 28/4) leave half the warps
// an SM holds idle. Above head_dim 128, where each block still takes kMmaBroadMinRows positions
// or more, they run blocks of twice the warps, planned for no more blocks: more warps in flight
// and no more partials for the combine (more, shorter splits cost short calls more in the
// combine than the idle warps did: "Small tensor-core plans fill..." in bench/RESULTS.md). At
// head_dim 128 such blocks ran as fast or slower (B1 28/4 D128 L8K 1.07x). 0: no such pass.
__host__ __device__ constexpr int mma_broad_warps(int head_dim) {
  return head_dim > 128 ? 2 * mma_warps(head_dim) : 0;
}
constexpr int kMmaBroadMinRows = 256;
// Warps that share a step's positions above head_dim 128, each taking a slice of every row: a
// warp's output accumulators (hi and lo rows, 16 head_dim / 32 a lane) and its K/V steps in
// flight fit its registers up to 128 dims. head_dim 192 and 256 take two, which add their
// slices' scores through shared memory at each step.
__host__ __device__ constexpr int mma_dim_split(int head_dim) { return head_dim > 128 ? 2 : 1; }
// Plans of more blocks than a wave whose blocks take at most this many positions use blocks of
// half the warps: twice the resident blocks overlap one's start and end with the others' loops.
constexpr int kMmaFineMaxChunk = 1024;
// Rows of its split (FP16 K and V) a block asks L2 for as it starts, before it waits for the
// grid before it and reads q: one warp's first step. On an H200, B1 and B8 calls up to 8K
// positions 0.93-1.00x the time against none, median 0.97 (a build with the count read at run
// time: 1.5-4% of it against that build at none); a block's whole first step, 64 rows,
// 0.92-0.93x where a block is alone on an SM but up to 1.03x where two are; 256 rows up to
// 1.15x, the whole split up to 1.38x: prefetches ahead of the warps' own loads delay those
// (bench/RESULTS.md, "A block's first rows into L2").
constexpr int kMmaL2Rows = 16;
// A small problem's plan makes as many blocks as the tensor-core kernel keeps resident (not one
// an SM) where each still takes at least this many positions: B8 and B32 8/1 D256 (248 a block)
// 0.88-0.90x the time; shorter blocks ran slower (B1 8/1 D256 L8K, 31 a block, 1.24x; B1 28/4
// D128 L8K, 124, 1.16x; H200, bench/RESULTS.md).
constexpr int kMmaFillMinRows = 192;
// A tiered call of several tiers runs as one launch of the kernel of every pair
// (attn_mma_tiers_kernel, CUDA 12.1+ builds) where its rows x K/V head units are at most this
// many an SM, else as a launch per tier, chained: on an H200, four tiers at B1 and B8 1K-8K (up
// to 993 an SM) took 0.68-0.87x the chain's time, from B1 32/8 D128 L32K (1986) on 1.05-1.20x:
// that kernel runs 1.08-1.14x longer per byte than a pair's own (its step's loads are scheduled
// later), which the chain's launches outweigh only in short calls.
constexpr int kTierOneLaunchRowsPerSm = 1024;
// ... and where it makes at least this many launches (tiers with rows in the call): two chained
// launches, each a whole number of blocks an SM, took 0.64-0.92x one launch's time for the
// 6-bit plan's K8V4 and K4V3 at B1 1K-8K, B8 1K-2K and head_dims 64 and 256 on an H200, and
// 0.89-1.07x for K8V8 with K8V4 (1.07x at B1 16/8 D256 L8K); four tiers keep one launch.
constexpr int kTierOneLaunchMinLaunches = 3;
// Resident warps per SM the register budget is set for: 8 above head_dim 64 (~200 registers),
// 16 up to 64 (~115 registers).
__host__ __device__ constexpr int mma_sm_warps(int head_dim) { return head_dim > 64 ? 8 : 16; }
__host__ __device__ constexpr int mma_min_blocks(int head_dim, int warps) {
  return mma_sm_warps(head_dim) > warps ? mma_sm_warps(head_dim) / warps : 1;
}
// sm_90 images built with CUDA 12+ stage K/V steps in shared memory with bulk copies, up to
// kMmaMaxStages steps a warp, where it pays: head_dim kMmaStagedMinDim..kMmaStagedMaxDim (the
// register kernel needs a tail step or more steps per byte there) and splits of at least
// kMmaStagedMinSteps steps a warp (a bulk copy's first bytes arrive later than a load's).
#if defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12
#define M40LLM_MMA_BULK_BUILT 1
#else
#define M40LLM_MMA_BULK_BUILT 0
#endif
constexpr int kMmaMaxStages = 4;
constexpr int kMmaStagedMinDim = 80;
constexpr int kMmaStagedMaxDim = 112;
constexpr int kMmaStagedMinSteps = 8;
// Causal rows on tensor cores (kMmaCausal): an item's rows in pieces of at most this many, each
// piece an item of its own: bounds a launch's grid (K/V heads x rows x group / 8 tiles) and its
// partials (rows x a decode call's).
constexpr int kCausalMmaMaxRows = 64;
// A sliding window's causal rows take the tensor cores where the positions before every row's
// window (which they read, masked) are at most this share of an item's: at 3-10x the FP32
// kernel's speed they still come out ahead (H200, bench/RESULTS.md). Not tuned.
constexpr double kCausalMmaMaxUnseen = 0.75;
// The causal prefill kernel on tensor cores (attention_causal_mma.cu): positions a K/V tile
// (64 query vectors a block share it; half that at head_dim 256), resident blocks an SM its
// registers are bounded for (2 x 128 threads: up to 255 registers; its shared memory, two tiles
// of K and V: 36 KB a block at head_dim 64, 68 KB at 128, and with q's fragments 130 KB at 256,
// one block an SM there), and the query rows from which an item takes it rather than
// attend_rows' decode tiles: at 128 rows on P 4096 it took 0.41-0.83x their time, at 64
// 0.98-1.09x (H200, 32/8 heads, head_dim 64-256; bench_causal's short axis, bench/RESULTS.md).
constexpr int kCausalMmaTile = 64;
constexpr int kCausalMmaBlocksPerSm = 2;
constexpr int kCausalPrefillMinRows = 128;
// The prefill kernel sums each tile's products in registers of their own before adding them to
// its output in FP32 (exact to FP32 on peaked rows, where the MMA's own accumulation truncates:
// 3.6e-5 at head_dim 256 summed in place), this many n-tiles (8 dims each) of the output at a
// time. Up to 128, a tile's whole output (no spills at 64, 48-64 bytes at 128: 1.07x the time in
// place); at 256 half of it (the whole spilled 336 bytes, a half 96: 1.05-1.09x the time in
// place, geomean 1.076; a quarter the same, an eighth 1.086; at 128 quarters ran 1.010x the
// whole, H200).
template <int DMAX>
constexpr int kCausalMmaSumTiles = DMAX <= 128 ? DMAX / 8 : 16;
// Shorter items take it too where their rows fill a block's 64 query vectors (rows x the group
// tile: 16 rows at group 4) and their prefix is at least this long: speculative T 16 on P 32768
// 0.61-0.72x the decode tiles' time, on P 4096 1.10-1.55x (H200, head_dim 64-256; T 2 and 4,
// a part of a block, 1.4-2.6x). Prefixes between were not measured.
constexpr int kCausalPrefillLongPrefix = 32768;

// ---- Append (append.cu) ----
// Threads per block, and at most this many blocks (a grid-stride loop covers the rest).
constexpr int kAppendThreads = 256;
constexpr int kAppendMaxBlocks = 4096;

// ---- 16-bit q and out rows (io_rows.cu) ----
// Element-wise grid-stride loops over a call's rows (a few hundred KB at most): one wave's worth.
constexpr int kIoThreads = 256;
constexpr int kIoMaxBlocks = 1024;
