#!/bin/bash
# A uniform cache's calls with weights (weights and importance calls) on the tensor-core
# kernels' kMmaDirectScores instances (this change), against the tree before it (.ab/t/old_src.tgz:
# b7a0afe, where they ran the FP32 kernels' instances with scores), both built here natively
# (sm_90) into .ab/nat and .ab/natold. Native test_gpu (small), groups weights, importance,
# tiers, policy and graph; then old and new alternating, two rounds: bench_attention plain,
# --weights and --importance, F16 and Q4 (its defaults). Results in $OUT/r (r.tgz).
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
( nat . $PWD/.ab/nat test_gpu bench_attention; log "native new build rc=$?" ) &
( nat .ab/oldsrc $PWD/.ab/natold bench_attention; log "native old build rc=$?" ) &
wait
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=weights,importance,tiers,policy,graph \
  timeout 150 stdbuf -oL -eL .ab/nat/ffi_tests/test_gpu > $R/t_native.txt 2>&1
log "native weights,importance,tiers,policy,graph rc=$? $(tail -1 $R/t_native.txt)"
F16_SHAPES="--shape 8,32,8,128,8192 --shape 1,32,8,128,32768 --shape 1,8,8,128,8192 --shape 8,32,8,64,2048 --shape 1,16,8,256,8192 --shape 4,6,2,80,4096 --shape 1,32,8,128,1024"
Q4_SHAPES="--shape 8,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,32,8,64,2048 --shape 1,32,8,128,1024"
for round in 1 2; do
  for side in old new; do
    d=.ab/natold; [ $side = new ] && d=.ab/nat
    for fmt in F16 Q4; do
      shapes=$F16_SHAPES; [ $fmt = Q4 ] && shapes=$Q4_SHAPES
      for mode in plain weights importance; do
        flag=; [ $mode != plain ] && flag=--$mode
        timeout 60 $d/bench/bench_attention $shapes --format $fmt $flag --budget-ms 100 \
          --json $R/${fmt}_${mode}_${side}_$round.json > $R/${fmt}_${mode}_${side}_$round.txt 2>&1
        log "$fmt $mode $side $round rc=$?"
      done
    done
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
cp .ab/nat.log .ab/natold.log $R/ 2>/dev/null
tar czf $OUT/r.tgz -C $OUT r
