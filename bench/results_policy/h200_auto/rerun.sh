#!/bin/bash
# One device call: the cache's own observe calls (kvcache options version 6, observe_interval).
# test_gpu's groups that the change touches (the observe path, append-and-attend, the scores'
# scratch, graphs) on the carried compute_52 PTX build (.ab/t/p52new.tar.xz: test_gpu,
# bench_policy) and on a native sm_90 build made here; bench_policy of this tree (the plain call
# every step, observe_interval 4 or 1) against the previous main's (d2ab3e5, .ab/t/old_src.tgz:
# observe calls made by the caller), both native, alternating, two rounds, and this tree's
# compute_52 one. Results in $OUT/r.tgz.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
nat() { # $1 source, $2 build dir, targets...
  local src=$1 dir=$2; shift 2
  cmake -S $src -B $dir -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON > $dir.cfg.log 2>&1 && cmake --build $dir -j8 --target "$@" > $dir.log 2>&1
}
G=errors,append,dtype,weights,importance,tiers,policy,graph,decode
mkdir -p /tmp/p52new /tmp/oldsrc
tar -C /tmp/p52new -xJf .ab/t/p52new.tar.xz
tar -C /tmp/oldsrc -xzf .ab/t/old_src.tgz
( nat . /tmp/nat test_gpu bench_policy; log "native new build rc=$?" ) &
( nat /tmp/oldsrc /tmp/natold bench_policy; log "native old build rc=$?" ) &
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=$G timeout 300 stdbuf -oL -eL /tmp/p52new/test_gpu > $R/t_ptx52.txt 2>&1
log "ptx52 $G rc=$? $(tail -1 $R/t_ptx52.txt)"
timeout 60 /tmp/p52new/bench_policy $R/policy_ptx52_new.json > $R/policy_ptx52_new.txt 2>&1
log "policy ptx52 new rc=$?"
wait
cp /tmp/nat.log /tmp/natold.log $R/ 2>/dev/null
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=$G timeout 200 stdbuf -oL -eL \
  /tmp/nat/ffi_tests/test_gpu > $R/t_native.txt 2>&1
log "native $G rc=$? $(tail -1 $R/t_native.txt)"
for round in 1 2; do
  for side in old new; do
    d=/tmp/natold; [ $side = new ] && d=/tmp/nat
    timeout 60 $d/bench/bench_policy $R/policy_native_${side}_$round.json \
      > $R/policy_native_${side}_$round.txt 2>&1
    log "policy native $side $round rc=$?"
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
