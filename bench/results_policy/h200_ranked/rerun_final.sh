#!/bin/bash
# The final tree (a leaving row's cascade a chain, rounds a launch apart), after rerun.sh's call:
# test_gpu's groups policy, tiers and graph on the carried compute_52 build
# (.ab/t/p52new.tar.xz) and on the native build made here; bench_policy on both.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/f; mkdir -p $R /tmp/p52new
tar -C /tmp/p52new -xJf .ab/t/p52new.tar.xz
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON > /tmp/nat.cfg.log 2>&1 &&
  cmake --build /tmp/nat -j14 --target test_gpu bench_policy > /tmp/nat.log 2>&1
  log "native build rc=$?" ) &
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers,graph timeout 300 stdbuf -oL -eL \
  /tmp/p52new/test_gpu > $R/t_ptx52_final.txt 2>&1
log "ptx52 policy,tiers,graph rc=$? $(tail -1 $R/t_ptx52_final.txt)"
timeout 90 /tmp/p52new/bench_policy $R/policy_ptx52_final.json > $R/policy_ptx52_final.txt 2>&1
log "policy ptx52 rc=$?"
wait
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers,graph timeout 100 stdbuf -oL -eL \
  /tmp/nat/ffi_tests/test_gpu > $R/t_native_final.txt 2>&1
log "native policy,tiers,graph rc=$? $(tail -1 $R/t_native_final.txt)"
timeout 60 /tmp/nat/bench/bench_policy $R/policy_native_final.json > $R/policy_native_final.txt 2>&1
log "policy native rc=$?"
tar czf $OUT/f.tgz -C $OUT f
