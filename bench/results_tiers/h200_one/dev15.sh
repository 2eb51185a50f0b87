#!/bin/bash
# device call 15: one launch for every tier (attn_mma_tiers_kernel, nvcc 13): native base (HEAD)
# and new; ptxas of the tiers TU; test_gpu tiers,graph; tiers bench, 2 alternating rounds.
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
build() {  # tree dir targets...
  local tree=$1 dir=$2; shift 2
  cmake -S $tree -B $dir -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF > $dir.log 2>&1 &&
    cmake --build $dir --target "$@" >> $dir.log 2>&1
}
build .ab/base /tmp/base bench_attention & b1=$!
build . /tmp/new bench_attention test_gpu & b2=$!
nvcc -std=c++17 -O3 -arch=sm_90 -DM40LLM_HAVE_CUDA=1 -Ic/include -Ic/src -Icuda -c cuda/attention_mma_tiers.cu \
  -o /tmp/tiers.o -Xptxas -v > /tmp/ptxas_tiers.txt 2>&1
echo "ptxas rc=$? $((SECONDS-t0)) s"; grep -A2 'attn_mma_tiers_kernel' /tmp/ptxas_tiers.txt | grep -E 'registers|spill' | sort | uniq -c
wait $b1 || { echo base build failed; tail -20 /tmp/base.log; }
wait $b2 || { echo new build failed; grep -m5 -B2 -A5 error /tmp/new.log; tail -5 /tmp/new.log; cp /tmp/new.log $OUT/; exit 1; }
echo "built $((SECONDS-t0)) s"
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph timeout 150 /tmp/new/ffi_tests/test_gpu > /tmp/test_new.txt 2>&1
echo "test_gpu rc=$? $((SECONDS-t0)) s"; tail -n 4 /tmp/test_new.txt; grep -m5 FAIL /tmp/test_new.txt
mkdir -p /tmp/ab/base /tmp/ab/new
cp /tmp/base/bench/bench_attention /tmp/ab/base/; cp /tmp/new/bench/bench_attention /tmp/ab/new/
for r in 1 2; do
  for side in base new; do
    bash bench/tiers.sh /tmp/ab/$side/bench_attention /tmp/tiers/${side}_r$r > /dev/null 2>&1
  done
  echo "round $r $((SECONDS-t0)) s"
done
for side in base new; do for r in 1 2; do echo "== $side r$r"; grep "tiers-4\|tier-Q4Q3\|shape" /tmp/tiers/${side}_r$r/tiers.md; done; done
tar czf $OUT/all.tgz -C /tmp tiers base.log new.log ptxas_tiers.txt test_new.txt
