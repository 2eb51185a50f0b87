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

// Columns of V per thread in the output pass: accumulators (heads x columns) stay at 8-16
// registers, and a row is covered by at most kAttnThreads threads.
__host__ __device__ constexpr int pv_columns(int group_tile) {
  return group_tile == 1 ? 8 : group_tile == 2 ? 4 : 2;
}

// A split writes and the combine reads back (head_dim + 2) floats per query head, about
// 2 x heads / positions of the split's K/V bytes, and pays a block's start and end: at least
// this many positions per query head keeps that near 3% (H200: 32 was slower at batch 1).
constexpr int kSplitRowsPerHead = 64;

// Blocks the split heuristic aims for, in waves of resident blocks (resident blocks per SM are
// measured per kernel and GPU): 2 balances ragged and uneven work (H200: 1 wave lost 6% at
// batch 32). The per-architecture differences live in tile_rows. A build may override it to tune
// (-DM40LLM_ATTN_WAVES=N in CMAKE_CUDA_FLAGS; scripts/perf_quick.sh compares builds).
#ifndef M40LLM_ATTN_WAVES
#define M40LLM_ATTN_WAVES 2
#endif
constexpr int kAttnWaves = M40LLM_ATTN_WAVES;
