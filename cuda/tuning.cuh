// Every tuning knob of the attention kernels in one place.
#pragma once

// Threads per block, on every GPU. 8 resident blocks = 64 registers/thread = 50% occupancy on
// sm_52. Measured on an H200: 4 blocks x 128 registers with deeper per-thread load batches ran
// 25-35% slower, so every architecture keeps the M40's budget.
constexpr int kAttnThreads = 128;
constexpr int kAttnMinBlocksPerSm = 8;

// Query heads per block: one K/V head's group is done in tiles of up to this many heads.
constexpr int kMaxGroupTile = 8;

// Head-dim classes the split kernel is compiled for; a cache uses the smallest that fits.
constexpr int kHeadDimClasses[] = {64, 128, 256};

// Positions per tile. Decode attention is latency-bound unless every thread issues all its
// loads for a tile at once, so a tile is sized to one register batch per thread: 32 bytes of K
// and 32 of V (64 + 64 spilled at 64 registers; 16 + 16 at 8 heads ran 25% slower on an
// H200). sm_5x/6x batch 16 + 16 for tiles of 2+ heads: the M40's bandwidth x latency is ~7 KB
// per SM, well under 8 blocks x 128 threads x 32 B, and 32 + 32 spills there. The host pass
// (no __CUDA_ARCH__) gets the largest value, which sizes shared memory for every device pass.
__host__ __device__ constexpr int tile_rows(int group_tile, int dmax) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  return (group_tile >= 2 ? 1024 : 2048) / dmax;
#else
  return (void)group_tile, 2048 / dmax;
#endif
}

// Query heads a thread takes at once in the score and output passes, over the same K or V
// registers. All 8 of an 8-head tile at once spill in the 64-register budget (sm_5x/6x: 4 bytes;
// sm_70+, whose tiles are larger: 16 bytes, reloaded every tile), so those take passes of 4 and
// 2; smaller tiles take all their heads at once.
__host__ __device__ constexpr int heads_per_pass(int group_tile) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  return group_tile > 4 ? 4 : group_tile;
#else
  return group_tile > 4 ? 2 : group_tile;
#endif
}

// Columns of V per thread in the output pass: accumulators (heads x columns) stay at 8-16
// registers, and a row is covered by at most kAttnThreads threads.
__host__ __device__ constexpr int pv_columns(int group_tile) {
  return group_tile == 1 ? 8 : group_tile == 2 ? 4 : 2;
}

// A split writes and the combine reads back (head_dim + 2) floats per query head, about
// 2 x heads / positions of the split's K/V bytes, and pays a block's start and end: at least
// this many positions per query head keeps that near 3% (H200: 32 was slower at batch 1; H100:
// 32 and 16 each won and lost about 10% on different small shapes, bench/RESULTS.md). A build
// may override it: -DM40LLM_SPLIT_ROWS_PER_HEAD=N.
#ifndef M40LLM_SPLIT_ROWS_PER_HEAD
#define M40LLM_SPLIT_ROWS_PER_HEAD 64
#endif
constexpr int kSplitRowsPerHead = M40LLM_SPLIT_ROWS_PER_HEAD;

// The combine takes plans of at most this many splits per item (batch 8 and up to contexts of
// about 2K, batch 1 up to 512) one warp per query head, every split's partials loaded at once;
// longer plans take a block per head, a warp per split. H100, graph, same run: B32 32/8 D64
// L512 18.3 -> 16.5 us and B8 64/8 L512 12.0 -> 11.2 us (2 splits); at 8 splits within 0.1 us
// either way (B1 L512), where the block per head at 4 splits a batch was 0.4 us slower for MHA.
// Override: -DM40LLM_COMBINE_FEW_SPLITS=N (0: never).
#ifndef M40LLM_COMBINE_FEW_SPLITS
#define M40LLM_COMBINE_FEW_SPLITS 8
#endif
constexpr int kCombineFewSplits = M40LLM_COMBINE_FEW_SPLITS;

// Blocks the split heuristic aims for, in waves of resident blocks (resident blocks per SM are
// measured per kernel and GPU). The FP32 kernel keeps 8 blocks per SM, and a single wave then
// leaves some SMs a block short while the others set the pace (H100, B8 32/32 L8K: 78% of copy
// at 1 wave, 98% at 2). The tensor-core kernel keeps 8-16 warps per SM (1-4 blocks), where one
// wave of even splits was as fast or faster at every shape measured (B1 32/8 L32K: 81% against
// 76%). A build may override either to tune (-DM40LLM_ATTN_WAVES=N or -DM40LLM_MMA_WAVES=N in
// CMAKE_CUDA_FLAGS; scripts/perf_quick.sh compares builds).
#ifndef M40LLM_ATTN_WAVES
#define M40LLM_ATTN_WAVES 2
#endif
#ifndef M40LLM_MMA_WAVES
#define M40LLM_MMA_WAVES 1
#endif
constexpr int kAttnWaves = M40LLM_ATTN_WAVES;
constexpr int kMmaWaves = M40LLM_MMA_WAVES;

// The tensor-core split kernel (sm_80+ builds, attention_mma.cu): warps per block, each taking
// kMmaRows positions per step, and the smallest group that uses it. It takes MHA too: it
// issues far fewer instructions per K/V byte than the FP32 kernel even with one query head in
// its 8 rows, which decides short contexts (H100, 32/32 L512: B1 9.6 -> 7.8 us, B32 101 -> 95
// us) and ties at large ones (B32 L8K: 1409 against 1404 us). For GQA the FP32 kernel runs out
// of issue slots before it runs out of bandwidth (B8 64/8 L8K: 50% of copy against 85%).
// -DM40LLM_MMA_MIN_GROUP=1000 keeps every shape on the FP32 kernel.
constexpr int kMmaRows = 16;
// Warps per block, by head_dim: 8 below M40LLM_MMA_FOUR_WARP_MIN_DIM, 4 from it. With the same
// warps per SM, 8-warp blocks at head_dim 64 and 80 take fewer, larger splits (fewer partials to
// write and merge, q converted once for twice the positions): H100, same run, B32 32/8 D64 L512
// 16.4 -> 14.9 us, B8 D64 L512 7.7 -> 7.0, B32 D64 L8K 183 -> 179, B32 32/8 D80 L8K 238 -> 230,
// B1 32/8 D64 L128K 95.0 -> 92.9. At head_dim 128, where a block has 2 per SM, they were
// slower: B8 64/8 L512 11.3 -> 11.9, B64 64/8 L512 53 -> 59, B1 32/8 L2K 8.1 -> 8.9.
// Plans of more blocks than one wave whose blocks take at most kMmaFineMaxChunk positions take
// blocks of half the warps: twice the resident blocks then overlap one's start and end (q, the
// merge, the partials) with the others' loops. H100, same run: B64 32/8 D64 L512 28.3 -> 26.9
// us, D80 45.8 -> 37.2, B64 64/8 D128 L512 53.4 -> 50.9, B32 32/32 L512 94.7 -> 93.0; from 2K
// positions a block it was within 1% either way (B64 32/8 L8K 698 -> 705, B64 64/8 L2K 183.5 ->
// 181.6).
#ifndef M40LLM_MMA_FINE_MAX_CHUNK
#define M40LLM_MMA_FINE_MAX_CHUNK 1024
#endif
constexpr int kMmaFineMaxChunk = M40LLM_MMA_FINE_MAX_CHUNK;
#ifndef M40LLM_MMA_FOUR_WARP_MIN_DIM
#define M40LLM_MMA_FOUR_WARP_MIN_DIM 128
#endif
__host__ __device__ constexpr int mma_warps(int head_dim) {
  return head_dim >= M40LLM_MMA_FOUR_WARP_MIN_DIM ? 4 : 8;
}
// Resident warps per SM the register budget (and the staged kernel's shared memory) is set for,
// by head_dim: 8 above 64 (4-warp blocks at head_dim 128: 12 warps, 166 registers, ran 9% slower
// on an H100, B32 32/8 L8K 389 against 357 us, and 3 staged blocks leave room for 2 steps each,
// 12% slower), 16 up to 64 (~115 registers). Override: -DM40LLM_MMA_SM_WARPS_WIDE=N and
// -DM40LLM_MMA_SM_WARPS_NARROW=N (up to head_dim 64).
#ifndef M40LLM_MMA_SM_WARPS_WIDE
#define M40LLM_MMA_SM_WARPS_WIDE 8
#endif
#ifndef M40LLM_MMA_SM_WARPS_NARROW
#define M40LLM_MMA_SM_WARPS_NARROW 16
#endif
__host__ __device__ constexpr int mma_sm_warps(int head_dim) {
  return head_dim > 64 ? M40LLM_MMA_SM_WARPS_WIDE : M40LLM_MMA_SM_WARPS_NARROW;
}
__host__ __device__ constexpr int mma_min_blocks(int head_dim, int warps) {
  return mma_sm_warps(head_dim) > warps ? mma_sm_warps(head_dim) / warps : 1;
}
// sm_90+, built with CUDA 12+: each warp of the tensor-core kernel has its next K/V steps
// copied into shared memory by the bulk-copy (TMA) engine, as many steps deep as fit beside the
// resident blocks, up to kMmaMaxStages. Loads in flight then hold no registers and cost one
// instruction per 16 rows. -DM40LLM_MMA_BULK=0 keeps them in registers, as on sm_80/89.
#ifndef M40LLM_MMA_BULK
#define M40LLM_MMA_BULK 1
#endif
#ifndef M40LLM_MMA_STAGES
#define M40LLM_MMA_STAGES 4
#endif
constexpr int kMmaMaxStages = M40LLM_MMA_STAGES;
// Where staging pays (H100, against loads through registers, same run): head_dim 80-112 (B32
// 32/8 L8K: D80 293 -> 238 us, D96 286 -> 268, B8 64/8 D112 L8K 87.7 -> 86.2; the register
// kernel loads those with a 16-dim tail step or more steps per byte), and splits of at least
// this many steps per warp (a bulk copy's first bytes arrive later than a load's: B1 32/8 D128
// L512, 4 steps, 6.1 -> 6.5 us). At head_dim 128 the register kernel, down to ~200 registers
// at 2 blocks per SM, leads the 3 staged steps that fit beside it by 1-2% (B32 32/8 L8K 352 us
// against 357, B1 32/8 L32K 51.4 against 52.4). D64 fell from 94% of copy to 80%: its slots
// leave room for 3 blocks per SM where the register kernel fits 4, and B32's 512 blocks then
// took 1.29 waves instead of 0.97; sized for 4 blocks (3 steps), it only matched registers.
#ifndef M40LLM_MMA_STAGED_MIN_DIM
#define M40LLM_MMA_STAGED_MIN_DIM 80
#endif
#ifndef M40LLM_MMA_STAGED_MAX_DIM
#define M40LLM_MMA_STAGED_MAX_DIM 112
#endif
#ifndef M40LLM_MMA_STAGED_MIN_STEPS
#define M40LLM_MMA_STAGED_MIN_STEPS 8
#endif
constexpr int kMmaStagedMinDim = M40LLM_MMA_STAGED_MIN_DIM;
constexpr int kMmaStagedMaxDim = M40LLM_MMA_STAGED_MAX_DIM;
constexpr int kMmaStagedMinSteps = M40LLM_MMA_STAGED_MIN_STEPS;
#ifndef M40LLM_MMA_MIN_GROUP
#define M40LLM_MMA_MIN_GROUP 1
#endif
constexpr int kMmaMinGroup = M40LLM_MMA_MIN_GROUP;
