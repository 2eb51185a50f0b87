#!/bin/bash
# One device call: a short tiered call of two launches chained, not one launch of every pair's
# kernel (kTierOneLaunchMinLaunches, cuda/tuning.cuh), native sm_90 built here: test_gpu small
# mode, groups tiers, graph and policy, and bench_attention over the 6-bit plan's mix and K8V8
# with K8V4 at the short calls' shapes. (The A/B itself ran with a run-time switch between the
# rules in one build: bench/RESULTS.md, "Tiers planned for a target of bits".) Results in
# $OUT/t.tgz.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
R=$OUT/t; mkdir -p $R
cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DM40LLM_BUILD_BENCH=ON -DM40LLM_BUILD_EXAMPLES=OFF > /tmp/cfg.log 2>&1 &&
  cmake --build /tmp/nat -j16 --target test_gpu bench_attention > /tmp/b.log 2>&1 ||
  { tail -20 /tmp/b.log; exit 1; }
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph,policy timeout 200 \
  /tmp/nat/ffi_tests/test_gpu > $R/test_gpu_native.txt 2>&1
echo "test_gpu rc=$?" >> $R/log.txt
SH="--shape 1,32,8,128,1024 --shape 1,32,8,128,2048 --shape 1,32,8,128,4096 --shape 1,32,8,128,8192 --shape 8,32,8,128,1024 --shape 8,32,8,128,2048 --shape 1,16,8,256,8192 --shape 1,32,8,64,8192"
/tmp/nat/bench/bench_attention --tiers Q8Q4:0.5868,Q4Q3:0.4132 $SH > $R/plan6.txt 2>&1
/tmp/nat/bench/bench_attention --tiers Q8Q8:0.3,Q8Q4:0.7 $SH > $R/hi.txt 2>&1
/tmp/nat/bench/bench_attention --tiers Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25 $SH > $R/tiers4.txt 2>&1
tar czf $OUT/t.tgz -C $OUT t
