#!/bin/bash
# device call 17: one launch for every tier (inlined pairs) against HEAD: Nsight Compute of the
# one-tier call (per-pair tier kernel vs the every-pair kernel), tiers bench on short contexts.
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
build() {  # tree dir targets...
  local tree=$1 dir=$2; shift 2
  cmake -S $tree -B $dir -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF $EXTRA > $dir.log 2>&1 &&
    cmake --build $dir --target "$@" >> $dir.log 2>&1
}
build .ab/base /tmp/base bench_attention & b1=$!
EXTRA="-DCMAKE_CUDA_FLAGS=-DM40LLM_TIER_BODY_INLINE=__forceinline__" build . /tmp/new bench_attention & b2=$!
wait $b1 || { echo base build failed; tail -20 /tmp/base.log; }
wait $b2 || { echo new build failed; tail -5 /tmp/new.log; exit 1; }
echo "built $((SECONDS-t0)) s"
mkdir -p /tmp/ncu
for side in base new; do
  for s in 8,32,8,128,8192 1,32,8,128,32768; do
    timeout 100 ncu --kernel-name regex:attn_mma --launch-skip 20 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats --section LaunchStats \
      --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
      /tmp/$side/bench/bench_attention --shape $s --tiers Q4Q3:1 --no-check --no-graph --sample-ms 0.05 --budget-ms 20 \
      > /tmp/ncu/${side}_${s//,/_}.txt 2>&1
    echo "== ncu $side $s $((SECONDS-t0)) s"
    grep -E "attn_mma|Duration|DRAM Throughput|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Achieved Occupancy|No Eligible|Theoretical Occ" /tmp/ncu/${side}_${s//,/_}.txt | head -16
  done
done
SH="--shape 1,32,8,128,1024 --shape 1,32,8,128,2048 --shape 1,32,8,128,4096 --shape 8,32,8,128,1024 --shape 8,32,8,128,2048 --shape 1,8,8,128,8192 --shape 1,32,8,64,8192 --shape 1,16,8,256,8192"
for r in 1 2; do
  for side in base new; do
    bash bench/tiers.sh /tmp/$side/bench/bench_attention /tmp/tiers/${side}_r$r $SH > /dev/null 2>&1
  done
  echo "round $r $((SECONDS-t0)) s"
done
for side in base new; do echo "== $side r2"; grep "tiers-4\|tier-Q4Q3" /tmp/tiers/${side}_r2/tiers.md | cut -d'|' -f2-5,7,8; done
tar czf $OUT/all.tgz -C /tmp tiers ncu base.log new.log
