#!/bin/bash
# One device call: the landed tree after review (the FP16 slots' tier, as in plan_call, also in
# one_launch_pass's count; the chain decided before any launch is planned; the tests' new cases:
# tiers empty at both ends with the slots in an F16 launch of their own and in causal rows, and
# versions 4 and 5 of the options under the planner). Its compute_52 build carried in
# .ab/t/p52final.tar.xz (test_gpu, test_capacity, decode_loop, bench_attention) and a native
# build made here: test_gpu small mode, groups tiers, graph and policy; test_capacity; the
# decode step with planned tiers; bench_attention over the planned mixes. Results in $OUT/f.tgz.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/f; mkdir -p $R
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; tar czf $OUT/f.tgz -C $OUT f 2>/dev/null; }
mkdir -p /tmp/p52 && tar -C /tmp/p52 -xJf .ab/t/p52final.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON > /tmp/nat.cfg.log 2>&1 &&
  cmake --build /tmp/nat -j14 --target test_gpu test_capacity decode_loop bench_attention \
    > /tmp/nat.log 2>&1; log "native build rc=$?" ) &
run() {  # tag dir
  M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph,policy timeout 200 \
    $2/ffi_tests/test_gpu > $R/test_gpu_$1.txt 2>&1; log "test_gpu $1 rc=$?"
  $2/ffi_tests/test_capacity > $R/test_capacity_$1.txt 2>&1; log "test_capacity $1 rc=$?"
  for b in 6 5.5; do
    timeout 90 $2/examples/decode_loop 32 cuda --layers 32 --seqs 8 --heads 32 --kv-heads 8 \
      --head-dim 128 --context 8192 --no-prefill-attention --bits $b > $R/step_$1_$b.txt 2>&1
  done
  $2/bench/bench_attention --tiers Q8Q4:0.5868,Q4Q3:0.4132 --shape 1,32,8,128,32768 \
    --shape 8,32,8,128,8192 --shape 1,32,8,128,4096 > $R/plan6_$1.txt 2>&1
  log "runs $1"
}
run ptx52 /tmp/p52
wait
run native /tmp/nat
