#!/bin/bash
# One device call: plan_call's tier passes looked up once a call (the review's mend), its
# compute_52 test_gpu carried in .ab/t/p52mend.tar.xz and a native build made here: test_gpu
# small mode, groups tiers, graph and policy. Results in $OUT/m.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
R=$OUT/m; mkdir -p $R
mkdir -p /tmp/p52 && tar -C /tmp/p52 -xJf .ab/t/p52mend.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_EXAMPLES=OFF > /tmp/cfg.log 2>&1 &&
  cmake --build /tmp/nat -j14 --target test_gpu > /tmp/b.log 2>&1; echo "native build rc=$?" >> $R/log.txt ) &
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph,policy timeout 150 \
  /tmp/p52/ffi_tests/test_gpu > $R/test_gpu_ptx52.txt 2>&1; echo "ptx52 rc=$?" >> $R/log.txt
wait
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph,policy timeout 100 \
  /tmp/nat/ffi_tests/test_gpu > $R/test_gpu_native.txt 2>&1; echo "native rc=$?" >> $R/log.txt
