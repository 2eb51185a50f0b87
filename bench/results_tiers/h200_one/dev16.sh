#!/bin/bash
# device call 16: one launch for every tier, each pair's code a function of its own (new) or
# inlined (var), against HEAD (base): ptxas, tiers,graph tests (new), tiers bench 2 rounds.
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
build . /tmp/new bench_attention test_gpu & b2=$!
EXTRA="-DCMAKE_CUDA_FLAGS=-DM40LLM_TIER_BODY_INLINE=__forceinline__" build . /tmp/var bench_attention & b3=$!
nvcc -std=c++17 -O3 -arch=sm_90 -DM40LLM_HAVE_CUDA=1 -Ic/include -Ic/src -Icuda -c cuda/attention_mma_tiers.cu \
  -o /tmp/tiers.o -Xptxas -v > /tmp/ptxas_tiers.txt 2>&1
echo "ptxas rc=$? $((SECONDS-t0)) s"
grep -A4 "Compiling entry function '_Z21attn_mma_tiers" /tmp/ptxas_tiers.txt | grep -E "Compiling|registers|stack" | sed -E 's/.*(attn_mma_tiers_kernelILi[0-9]ELi[0-9]).*/\1/' | paste - - - | cut -c1-200
grep -B1 -A3 "Function properties for .*tier_body" /tmp/ptxas_tiers.txt | grep -E "stack|spill" | sort | uniq -c | head
wait $b1 || { echo base build failed; tail -20 /tmp/base.log; }
wait $b2 || { echo new build failed; grep -m5 -B2 -A5 error /tmp/new.log; tail -5 /tmp/new.log; exit 1; }
wait $b3 || { echo var build failed; tail -5 /tmp/var.log; }
echo "built $((SECONDS-t0)) s"
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph timeout 150 /tmp/new/ffi_tests/test_gpu > /tmp/test_new.txt 2>&1
echo "test_gpu rc=$? $((SECONDS-t0)) s"; tail -n 1 /tmp/test_new.txt; grep -m5 FAIL /tmp/test_new.txt
mkdir -p /tmp/ab/base /tmp/ab/new /tmp/ab/var
for s in base new var; do cp /tmp/$s/bench/bench_attention /tmp/ab/$s/; done
for r in 1 2; do
  for side in base new var; do
    bash bench/tiers.sh /tmp/ab/$side/bench_attention /tmp/tiers/${side}_r$r > /dev/null 2>&1
  done
  echo "round $r $((SECONDS-t0)) s"
done
for side in base new var; do echo "== $side r2"; grep "tiers-4\|tier-Q4Q3" /tmp/tiers/${side}_r2/tiers.md | cut -d'|' -f2-5,7; done
tar czf $OUT/all.tgz -C /tmp tiers base.log new.log var.log ptxas_tiers.txt test_new.txt
