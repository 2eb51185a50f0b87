#!/bin/bash
# The variants run (variants/, ncu_main/), on the GPU machine: main 47b7835 in .ab/base (git archive), the
# working tree main with runtime_count.patch applied (git apply), carrying .ab. first/ was the same
# with configs base, new0 (M40LLM_X_L2=0), new64, new256 and newall (1000000), no SKIP.
cd "$(dirname "$0")/../../.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
build() {  # tree dir targets
  local t=$1 d=$2; shift 2
  (cmake -S $t -B $d -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_TESTS=OFF &&
    cmake --build $d --target "$@") > $d.log 2>&1
}
build .ab/base /tmp/base bench_attention & b1=$!
build . /tmp/new bench_attention & b2=$!
wait $b1 || { echo base build failed; grep -m5 -A5 error /tmp/base.log; }
wait $b2 || { echo new build failed; grep -m5 -A5 error /tmp/new.log; exit 1; }
echo "built $((SECONDS-t0)) s"
SH=""
for s in 1,8,1,256,8192 1,8,1,256,32768 1,8,1,256,131072 1,16,8,256,8192 1,16,2,256,32768 1,8,8,128,4096 1,8,8,128,8192 1,8,8,128,16384 1,32,8,128,4096 1,32,8,128,8192 1,32,8,128,32768 1,28,4,128,8192 1,64,8,64,7680 1,32,32,128,2048 1,32,32,128,8192 1,8,1,128,32768 8,32,8,128,1024 8,32,8,128,8192 32,32,8,128,8192 8,8,1,256,8192 32,16,8,256,8192 64,64,8,128,2048; do SH="$SH --shape $s"; done
mkdir -p /tmp/ab
for r in 1 2; do for cfg in base n0s0 n64s0 n32s64 n64s64 n128s64 n16s0; do
  side=new; x=${cfg#n}; skip=${x#*s}; x=${x%s*}; [ $cfg = base ] && side=base && x=0 && skip=0
  M40LLM_X_L2=$x M40LLM_X_L2_SKIP=$skip /tmp/$side/bench/bench_attention --budget-ms 200 $SH --json /tmp/ab/r${r}_$cfg.json > /tmp/ab/r${r}_$cfg.txt 2>&1
  echo "bench r$r $cfg $((SECONDS-t0)) s"
done; done
tar czf $OUT/ab.tgz -C /tmp ab
for s in 1,32,8,128,4096 1,8,8,128,8192 1,8,1,256,32768; do
  timeout 60 ncu --clock-control none --cache-control none --kernel-name regex:attn_ --launch-skip 40 --launch-count 6 \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size \
    /tmp/base/bench/bench_attention --shape $s --no-graph --no-check --budget-ms 20 --sample-ms 0.05 --warmup-ms 5 > $OUT/ncu_$(echo $s | tr , _).txt 2>&1
  echo "ncu $s rc=$? $((SECONDS-t0)) s"
done
