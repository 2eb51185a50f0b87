#!/bin/bash
# The landing run (final/), on the GPU machine carrying .ab: main's previous commit (47b7835) in
# .ab/base (git archive), this tree as the working tree, and in .ab/bins/sm90.tar.xz the CUDA 11.8
# sm_90 test_gpu built here (cmake -B build-sm90 -DCMAKE_CUDA_ARCHITECTURES=90
# -DM40LLM_BUILD_BENCH=OFF; tar -C build-sm90/ffi_tests -cJf .ab/bins/sm90.tar.xz test_gpu).
# Both trees natively (nvcc 13, sm_90), bench/ab.sh's whole grid, 2 rounds; test_gpu (small
# mode) while they build.
cd "$(dirname "$0")/../../.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
build() {  # tree dir
  (cmake -S $1 -B $2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_TESTS=OFF &&
    cmake --build $2 --target bench_attention) > $2.log 2>&1
}
build .ab/base /tmp/base & b1=$!
build . /tmp/new & b2=$!
mkdir -p /tmp/t90 && tar -C /tmp/t90 -xJf .ab/bins/sm90.tar.xz
(M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout 170 /tmp/t90/test_gpu > $OUT/test_gpu_sm90_cuda118.txt 2>&1
 echo "test_gpu (CUDA 11.8 sm_90) rc=$? $((SECONDS-t0)) s: $(tail -n 1 $OUT/test_gpu_sm90_cuda118.txt)") &
p=$!
wait $b1 || { echo base build failed; grep -m5 -A5 error /tmp/base.log; }
wait $b2 || { echo new build failed; grep -m5 -A5 error /tmp/new.log; exit 1; }
echo "built $((SECONDS-t0)) s"
wait $p
mkdir -p /tmp/bins/base /tmp/bins/new
cp /tmp/base/bench/bench_attention /tmp/bins/base/ && cp /tmp/new/bench/bench_attention /tmp/bins/new/
AB_BINS=/tmp/bins timeout $((440 - SECONDS)) bash bench/ab.sh .ab/base /tmp/abgrid 2
echo "ab rc=$? $((SECONDS-t0)) s"
tar czf $OUT/abgrid.tgz -C /tmp abgrid
