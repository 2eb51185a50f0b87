#!/usr/bin/env bash
# On the GPU machine: Nsight Compute profile of the attention kernels on a few shapes, and a quick
# timing pass. Usage: scripts/profile.sh [OUT]  (shapes: bench --shape B,H,Hkv,D,L)
set -uo pipefail
out=${1:-${OUT:-$PWD/gpu-out}}
mkdir -p "$out"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF >/dev/null && cmake --build build-native >/dev/null || exit 1
bin=build-native/bench/bench_attention
shapes=${SHAPES:-32,32,32,128,8192 32,32,8,128,8192 1,32,8,128,2048}
for s in $shapes; do
  ncu --kernel-name regex:attn_ --launch-skip 20 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
    --section Occupancy --section SchedulerStats --section LaunchStats \
    "$bin" --shape "$s" --no-check --no-graph --sample-ms 0.05 > "$out/ncu_${s//,/_}.txt" 2>&1
  grep -E "attn_|Duration|DRAM Throughput|Warp Cycles Per Issued|Issued Warp|Shared|Bank|Pipe|stalled|Executed Ipc" \
    "$out/ncu_${s//,/_}.txt" | head -60
done
