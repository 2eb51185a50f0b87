#!/bin/bash
# device call 19: the final tree natively (only the used instances of the kernel of every pair):
# test_gpu's tiers and graph groups.
cd "$(dirname "$0")/.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
(cmake -S . -B /tmp/new -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_BENCH=OFF && cmake --build /tmp/new --target test_gpu) > /tmp/new.log 2>&1 || { echo build failed; grep -m5 -A5 error /tmp/new.log; exit 1; }
echo "built $((SECONDS-t0)) s"
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph timeout 60 /tmp/new/ffi_tests/test_gpu > $OUT/test_native_tiers.txt 2>&1
echo "native tiers,graph rc=$? $((SECONDS-t0)) s"; tail -n 2 $OUT/test_native_tiers.txt; grep -m5 FAIL $OUT/test_native_tiers.txt
