#!/bin/bash
# A tiered cache's calls with weights (observe calls, weights, importance) on the tensor-core
# tier kernels (this change) against the previous main (a87d9f9), both built here natively
# (sm_90) from the tree and from .ab/t/old_src.tgz into .ab/nat and .ab/natold (kept while the
# machine stays warm: a second call rebuilds only what changed). Native test_gpu (small), groups tiers,
# policy, weights, importance and graph; then old and new alternating, ROUNDS rounds (default
# "1 2"): bench_attention over the study's four tiers, plain, --observe and --weights, and
# bench_policy (a decode step with importance placement). Results in $OUT/r (r.tgz).
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R .ab/oldsrc
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
nat() { # $1 source, $2 build dir, targets...
  local src=$1 dir=$2; shift 2
  cmake -S $src -B $dir -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_BENCH=ON > $dir.cfg.log 2>&1 &&
    cmake --build $dir -j8 --target "$@" > $dir.log 2>&1
}
[ -f .ab/oldsrc/CMakeLists.txt ] || tar -C .ab/oldsrc -xzf .ab/t/old_src.tgz
( nat . $PWD/.ab/nat test_gpu bench_policy bench_attention; log "native new build rc=$?" ) &
( nat .ab/oldsrc $PWD/.ab/natold bench_policy bench_attention; log "native old build rc=$?" ) &
wait
if [ "${TESTS:-1}" = 1 ]; then
  M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,policy,weights,importance,graph \
    timeout 150 stdbuf -oL -eL .ab/nat/ffi_tests/test_gpu > $R/t_native.txt 2>&1
  log "native tiers,policy,weights,importance,graph rc=$? $(tail -1 $R/t_native.txt)"
fi
TIERS=Q8Q8:0.1,Q8Q4:0.2,Q4Q3:0.3,Q4Q2:0.4
SHAPES="--shape 8,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,32,8,128,1024 --shape 1,16,8,256,8192"
for round in ${ROUNDS:-1 2}; do
  for side in old new; do
    d=.ab/natold; [ $side = new ] && d=.ab/nat
    for mode in plain observe weights; do
      flag=; [ $mode != plain ] && flag=--$mode
      timeout 60 $d/bench/bench_attention $SHAPES --tiers $TIERS $flag --budget-ms 120 \
        --json $R/${mode}_${side}_$round.json > $R/${mode}_${side}_$round.txt 2>&1
      log "$mode $side $round rc=$?"
    done
    timeout 90 $d/bench/bench_policy $R/policy_${side}_$round.json > $R/policy_${side}_$round.txt 2>&1
    log "policy $side $round rc=$?"
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
cp .ab/nat.log .ab/natold.log $R/ 2>/dev/null
tar czf $OUT/r.tgz -C $OUT r
