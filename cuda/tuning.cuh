// Every tuning knob of the attention kernels, per architecture, in one place.
#pragma once

// 8 resident blocks (64 registers/thread, 50% occupancy on sm_52). Measured on an H200 (bench/
// RESULTS.md): 4 blocks with 128 registers and deeper load batches ran 25-35% slower there, so
// every architecture keeps the M40's budget.
constexpr int kAttnMinBlocksPerSm = 8;

// Compile-time shape of the split kernel (same on every GPU: it must fit sm_52's limits).
constexpr int kAttnThreads = 128;  // 4 warps
constexpr int kAttnTile = 128;     // positions per tile: one per thread in the score pass
constexpr int kKLanes = 4;         // lanes sharing one K row in the score pass (64 B per quad)
// 16-byte K loads a lane issues before using any: as many as registers allow without spilling
// (larger head tiles hold more accumulators).
__host__ __device__ constexpr int k_batch(int group_tile) {
  return group_tile == 1 ? 2 : 1;
}


// Query heads per block: one K/V head's group is done in tiles of this many heads.
constexpr int kMaxGroupTile = 8;

// Columns of V per thread in the output pass: fewer for larger head tiles so the FP32
// accumulators (tile x columns) stay at 8 registers, which keeps sm_52 at 64 without spills;
// but at least head_dim / kAttnThreads so one pass of the block covers a row.
constexpr int pv_columns(int group_tile, int head_dim) {
  return 8 / group_tile >= (head_dim + 127) / 128 ? 8 / group_tile : (head_dim + 127) / 128;
}

// Run-time split-K heuristics.
struct AttnTuning {
  int min_cc_major;  // first architecture the row applies to
  int waves;         // target blocks = SMs x resident blocks per SM x waves
  int min_chunk;     // never split a sequence into pieces shorter than this
};

constexpr AttnTuning kAttnTuning[] = {
    {9, 2, 128},  // Hopper: 132 SMs want many blocks; partials are cheap next to 4.8 TB/s
    {7, 2, 128},  // Volta .. Ada
    {0, 2, 128},  // Maxwell (M40: 24 SMs), Pascal
};

inline const AttnTuning &attn_tuning(int cc_major) {
  for (const AttnTuning &t : kAttnTuning)
    if (cc_major >= t.min_cc_major) return t;
  return kAttnTuning[sizeof kAttnTuning / sizeof kAttnTuning[0] - 1];
}
