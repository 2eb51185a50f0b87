#!/bin/bash
# The native run (native/): the combine's wide blocks (this tree) against main 9fd9015 (.ab/base), natively
# (nvcc 13, sm_90): both built here (this tree with its tests), test_gpu small mode, then
# bench/ab.sh's whole grid (2 rounds) and the B1 shapes of few K/V heads (3 rounds).
cd "$(dirname "$0")/../../.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
(cmake -S .ab/base -B /tmp/base -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_TESTS=OFF &&
  cmake --build /tmp/base --target bench_attention) > /tmp/base.log 2>&1 & b1=$!
(cmake -S . -B /tmp/new -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF &&
  cmake --build /tmp/new --target bench_attention test_gpu) > /tmp/new.log 2>&1 & b2=$!
wait $b2 || { echo new build failed; grep -m5 -A5 error /tmp/new.log; exit 1; }
echo "new built $((SECONDS-t0)) s"
(M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout 200 /tmp/new/ffi_tests/test_gpu > $OUT/test_gpu_native.txt 2>&1
 echo "test_gpu native rc=$? $((SECONDS-t0)) s: $(tail -n 1 $OUT/test_gpu_native.txt)") &
p=$!
wait $b1 || { echo base build failed; grep -m5 -A5 error /tmp/base.log; exit 1; }
echo "base built $((SECONDS-t0)) s"
wait $p
mkdir -p /tmp/bins/base /tmp/bins/new
cp /tmp/base/bench/bench_attention /tmp/bins/base/ && cp /tmp/new/bench/bench_attention /tmp/bins/new/
AB_BINS=/tmp/bins timeout $((500 - SECONDS)) bash bench/ab.sh .ab/base /tmp/abgrid 2
echo "ab rc=$? $((SECONDS-t0)) s"
tar czf $OUT/abgrid.tgz -C /tmp abgrid
sh=(); for s in 1,8,1,256,32768 1,16,1,256,131072 1,8,1,128,32768 1,16,1,64,32768 1,64,1,128,32768 \
  1,28,4,128,8192 1,28,4,128,32768 1,32,8,128,32768 1,8,1,256,8192 2,16,2,128,16384; do sh+=(--shape $s); done
AB_BINS=/tmp/bins timeout $((580 - SECONDS)) bash bench/ab.sh .ab/base /tmp/abb1 3 -- "${sh[@]}"
echo "ab b1 rc=$? $((SECONDS-t0)) s"
tar czf $OUT/abb1.tgz -C /tmp abb1
