#!/bin/bash
# The importance placement's hysteresis (kvcache options version 7, demote_margin): the policy
# and tiers groups of test_gpu (small mode) natively (sm_90, built here from the tree into
# .ab/nat) and on the M40's code (the compute_52 PTX test_gpu of CUDA 11.8, carried in .ab/t),
# then bench_policy (a decode step with importance placement, margins 0, 0.25 and 1) of both
# builds (.ab/t/bench_policy the compute_52 one; BENCH=0 leaves it out). Make .ab/t here:
# scripts/build_carry.sh, then copy build-ptx52/ffi_tests/test_gpu and
# build-ptx52/bench/bench_policy. Results in $OUT/r.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
R=$OUT/r; mkdir -p $R
t0=$SECONDS
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
cmake -S . -B .ab/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_BENCH=ON > $R/nat_cfg.log 2>&1 &&
  cmake --build .ab/nat -j16 --target test_gpu bench_policy > $R/nat_build.log 2>&1
log "native build rc=$?"
for b in nat:.ab/nat/ffi_tests/test_gpu ptx52:.ab/t/test_gpu; do
  M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers timeout 150 \
    stdbuf -oL -eL ${b#*:} > $R/test_gpu_${b%%:*}.txt 2>&1
  log "test_gpu ${b%%:*} policy,tiers rc=$? $(tail -1 $R/test_gpu_${b%%:*}.txt)"
done
[ "${BENCH:-1}" = 1 ] && for b in nat:.ab/nat/bench/bench_policy ptx52:.ab/t/bench_policy; do
  timeout 120 ${b#*:} $R/policy_${b%%:*}.json > $R/policy_${b%%:*}.txt 2>&1
  log "bench_policy ${b%%:*} rc=$?"
done
