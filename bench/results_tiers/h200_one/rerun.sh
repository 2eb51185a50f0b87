#!/bin/bash
# The final tree against the previous main, on the GPU machine (the device tool, carrying .ab):
# main's previous commit in .ab/base (git archive), the compute_52 test_gpu of scripts/
# build_carry.sh in .ab/bins/ptx52.tar.xz. Native (nvcc 13, sm_90): test_gpu small, every
# group; ptxas of the tiers TU; tiers bench (default and short shapes), each tree's build.
# compute_52 PTX test_gpu (tiers, graph) while the native builds run.
cd "$(dirname "$0")/../../.."
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
mkdir -p /tmp/p52 && tar -C /tmp/p52 -xJf .ab/bins/ptx52.tar.xz
(M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph timeout 250 /tmp/p52/test_gpu > /tmp/test_ptx52.txt 2>&1
 echo "ptx52 tiers,graph rc=$? $((SECONDS-t0)) s: $(tail -n 1 /tmp/test_ptx52.txt)") &
p=$!
nvcc -std=c++17 -O3 -arch=sm_90 -DM40LLM_HAVE_CUDA=1 -Ic/include -Ic/src -Icuda -c cuda/attention_mma_tiers.cu \
  -o /tmp/tiers.o -Xptxas -v > /tmp/ptxas_tiers.txt 2>&1
echo "ptxas rc=$? $((SECONDS-t0)) s"
grep -A4 "Compiling entry function '_Z21attn_mma_tiers" /tmp/ptxas_tiers.txt | grep -E "Compiling|registers|stack" | sed -E 's/.*(attn_mma_tiers_kernelILi[0-9]ELi[0-9]).*/\1/' | paste - - - | cut -c1-160
wait $b1 || { echo base build failed; tail -20 /tmp/base.log; }
wait $b2 || { echo new build failed; grep -m5 -B2 -A5 error /tmp/new.log; tail -5 /tmp/new.log; exit 1; }
echo "built $((SECONDS-t0)) s"
wait $p
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout 200 /tmp/new/ffi_tests/test_gpu > /tmp/test_native.txt 2>&1
echo "native test_gpu rc=$? $((SECONDS-t0)) s"; tail -n 2 /tmp/test_native.txt; grep -m5 FAIL /tmp/test_native.txt
grep -m3 "long call" /tmp/test_native.txt
mkdir -p /tmp/ab/base /tmp/ab/new
for s in base new; do cp /tmp/$s/bench/bench_attention /tmp/ab/$s/; done
SH="--shape 1,32,8,128,1024 --shape 1,32,8,128,4096 --shape 8,32,8,128,1024 --shape 8,32,8,128,2048 --shape 1,16,8,256,8192 --shape 1,32,8,64,8192"
for side in base new; do
  bash bench/tiers.sh /tmp/ab/$side/bench_attention /tmp/tiers/${side} > /dev/null 2>&1
  bash bench/tiers.sh /tmp/ab/$side/bench_attention /tmp/tiers/${side}_short $SH > /dev/null 2>&1
  echo "tiers $side $((SECONDS-t0)) s"
done
for side in base new; do for k in "" _short; do echo "== $side$k"; grep "tiers-4\|tier-Q4Q3" /tmp/tiers/${side}$k/tiers.md | cut -d'|' -f2-5,7,8; done; done
tar czf $OUT/all.tgz -C /tmp tiers base.log new.log ptxas_tiers.txt test_native.txt test_ptx52.txt
