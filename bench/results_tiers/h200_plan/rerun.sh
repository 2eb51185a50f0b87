#!/bin/bash
# One device call: tiered caches whose rows m40llm_kvcache_plan_tiers sets for a target of bits
# a value (issue 15), on the carried compute_52 PTX build (.ab/t/p52plan.tar.xz: test_capacity,
# decode_loop, bench_attention; the M40's code) and on a native sm_90 build made here:
#   - test_capacity (the planner, and a planned cache filled on CUDA),
#   - bench/tiers.sh with the uniform formats, four tiers a quarter each, and the 2-tier mixes
#     the planner gives at 5.5 and 6 bits for 32/8 heads, D128, 8K positions
#     (Q8Q4:0.361,Q4Q3:0.639 and Q8Q4:0.5868,Q4Q3:0.4132),
#   - examples/decode_loop's decode step (32 layers, 8 sequences, 32/8, D128, 8K): F16, four
#     tiers by age (--tiers), and tiers planned for 6 and 5.5 bits (--bits).
# Results in $OUT/r.tgz.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
mkdir -p /tmp/p52 && tar -C /tmp/p52 -xJf .ab/t/p52plan.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON > /tmp/nat.cfg.log 2>&1 &&
  cmake --build /tmp/nat -j12 --target test_capacity decode_loop bench_attention > /tmp/nat.log 2>&1
  log "native build rc=$?" ) &
export TIERS_MIXES="tiers-4 Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25
plan-5.5 Q8Q4:0.361,Q4Q3:0.639
plan-6 Q8Q4:0.5868,Q4Q3:0.4132"
runs() { # $1 test_capacity, $2 decode_loop, $3 bench_attention, $4 tag
  $1 > $R/$4_test_capacity.txt 2>&1; log "$4 test_capacity rc=$?"
  bash bench/tiers.sh $3 $R/$4_tiers > $R/$4_tiers.log 2>&1; log "$4 tiers.sh rc=$?"
  for mode in "" "--tiers" "--bits 6" "--bits 5.5"; do
    tag=$4_$(echo "f16 $mode" | tr -d ' -' | sed 's/^f16//')
    timeout 90 $2 32 cuda --layers 32 --seqs 8 --heads 32 --kv-heads 8 --head-dim 128 \
      --context 8192 --no-prefill-attention $mode > $R/step_$tag.txt 2>&1
    log "step $tag rc=$?"
  done
}
runs /tmp/p52/ffi_tests/test_capacity /tmp/p52/examples/decode_loop /tmp/p52/bench/bench_attention ptx52
wait
runs /tmp/nat/ffi_tests/test_capacity /tmp/nat/examples/decode_loop /tmp/nat/bench/bench_attention native
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
