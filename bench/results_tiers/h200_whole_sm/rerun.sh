#!/bin/bash
# One device call: a tiered call's launches without the tiers none of its items has rows in, and
# chained launches planned for whole blocks an SM (cuda/attention_tiers.cu), against the tree
# before them (the planner's tree: .ab/t/base_src.tgz, and its compute_52 build
# .ab/t/p52plan.tar.xz), the new tree's compute_52 build in .ab/t/p52tiers.tar.xz (test_gpu,
# test_capacity, decode_loop, bench_attention). Both sides native (sm_90, built here) and
# compute_52 (the M40's code): bench_attention over tiered caches (four tiers a quarter each;
# the 2-tier mixes m40llm_kvcache_plan_tiers gives for 5.5 and 6 bits at 8K; one tier of
# Q4Q3), alternating, 2 rounds; examples/decode_loop's step (32 layers, 8 x 8K, 32/8, D128)
# with --tiers, --bits 6 and --bits 5.5; test_gpu small mode, groups tiers, graph, policy.
# Results in $OUT/r.tgz.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; tar czf $OUT/r.tgz -C $OUT r 2>/dev/null; }
mkdir -p /tmp/p52base /tmp/p52new && tar -C /tmp/p52base -xJf .ab/t/p52plan.tar.xz &&
  tar -C /tmp/p52new -xJf .ab/t/p52tiers.tar.xz && tar -C /tmp -xzf .ab/t/base_src.tgz
build() {  # tree dir targets...
  local tree=$1 dir=$2; shift 2
  cmake -S $tree -B $dir -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON -DM40LLM_BUILD_TESTS=$([ $dir = /tmp/nnew ] && echo ON || echo OFF) \
    > $dir.cfg.log 2>&1 && cmake --build $dir -j8 --target "$@" > $dir.log 2>&1
  log "build $dir rc=$?"
}
build /tmp/basesrc /tmp/nbase bench_attention decode_loop &
build . /tmp/nnew bench_attention decode_loop test_gpu &
SH="--shape 1,32,8,128,8192 --shape 8,32,8,128,8192 --shape 32,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,32,32,128,8192 --shape 8,32,8,128,1024 --shape 1,32,8,128,2048"
MIXES="tiers-4 Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25
plan-5.5 Q8Q4:0.361,Q4Q3:0.639
plan-6 Q8Q4:0.5868,Q4Q3:0.4132
tier-Q4Q3 Q4Q3:1"
steps() {  # decode_loop tag
  for mode in "--tiers" "--bits 6" "--bits 5.5"; do
    timeout 90 $1 32 cuda --layers 32 --seqs 8 --heads 32 --kv-heads 8 --head-dim 128 \
      --context 8192 --no-prefill-attention $mode > $R/step_$2_$(echo $mode | tr -d ' -').txt 2>&1
  done
  log "steps $2"
}
ab() {  # kind(ptx52|native) base_bench new_bench
  for f in Q8 Q8Q4 Q4Q3 Q4Q2; do
    $2 --format $f $SH --json $R/$1_uniform_$f.json > $R/$1_uniform_$f.txt 2>&1
  done
  for r in 1 2; do
    for side in base new; do
      local bin=$2; [ $side = new ] && bin=$3
      d=$R/$1_${side}_r$r; mkdir -p $d; echo "$MIXES" > $d/mixes.txt
      for f in Q8 Q8Q4 Q4Q3 Q4Q2; do cp $R/$1_uniform_$f.json $d/$f.json; done
      while read -r name mix; do
        $bin --tiers "$mix" $SH --json $d/$name.json > $d/$name.txt 2>&1
      done <<<"$MIXES"
      python3 bench/tiers_table.py $d > $d/tiers.md
    done
  done
  log "ab $1"
}
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph,policy timeout 300 \
  /tmp/p52new/ffi_tests/test_gpu > $R/test_gpu_ptx52.txt 2>&1; log "test_gpu ptx52 rc=$?"
/tmp/p52new/ffi_tests/test_capacity > $R/test_capacity_ptx52.txt 2>&1; log "test_capacity ptx52 rc=$?"
steps /tmp/p52base/examples/decode_loop ptx52base
steps /tmp/p52new/examples/decode_loop ptx52new
ab ptx52 /tmp/p52base/bench/bench_attention /tmp/p52new/bench/bench_attention
wait
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph,policy timeout 240 \
  /tmp/nnew/ffi_tests/test_gpu > $R/test_gpu_native.txt 2>&1; log "test_gpu native rc=$?"
steps /tmp/nbase/examples/decode_loop nativebase
steps /tmp/nnew/examples/decode_loop nativenew
ab native /tmp/nbase/bench/bench_attention /tmp/nnew/bench/bench_attention
tar czf $OUT/r.tgz -C $OUT r
