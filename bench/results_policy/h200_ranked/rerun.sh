#!/bin/bash
# One device call: the placement's ranking on the GPU (this change) against the previous main
# (4d3c34b), both built here natively (sm_90) from .ab/t/old_src.tgz and the tree, and both
# carried as compute_52 PTX builds (.ab/t/p52new.tar.xz, p52old.tar.xz: bench_policy,
# bench_attention; the new one's test_gpu). The whole compute_52 test_gpu (small), and its
# groups policy, tiers, graph, importance and weights native; bench_policy and bench_attention
# --observe, old and new alternating, two rounds.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R /tmp/p52new /tmp/p52old /tmp/oldsrc
tar -C /tmp/p52new -xJf .ab/t/p52new.tar.xz
tar -C /tmp/p52old -xJf .ab/t/p52old.tar.xz
tar -C /tmp/oldsrc -xzf .ab/t/old_src.tgz
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
nat() { # $1 source, $2 build dir, targets...
  local src=$1 dir=$2; shift 2
  cmake -S $src -B $dir -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON > $dir.cfg.log 2>&1 && cmake --build $dir -j8 --target "$@" > $dir.log 2>&1
}
( nat . /tmp/nat test_gpu bench_policy bench_attention; log "native new build rc=$?" ) &
( nat /tmp/oldsrc /tmp/natold bench_policy bench_attention; log "native old build rc=$?" ) &
M40LLM_TEST_SMALL=1 timeout 420 stdbuf -oL -eL /tmp/p52new/test_gpu > $R/t_ptx52.txt 2>&1
log "ptx52 all rc=$? $(tail -1 $R/t_ptx52.txt)"
obs() { # $1 bin, $2 tag
  timeout 60 $1 --shape 8,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,9,3,64,2048 \
    --tiers Q8Q8:0.1,Q8Q4:0.2,Q4Q3:0.3,Q4Q2:0.4 --observe --budget-ms 150 \
    --json $R/obs_$2.json > $R/obs_$2.txt 2>&1
  log "obs $2 rc=$?"
}
ab() { # $1 build tag, $2 new dir, $3 old dir
  for round in 1 2; do
    for side in old new; do
      d=$3; [ $side = new ] && d=$2
      timeout 90 $d/bench_policy $R/policy_$1_${side}_$round.json > $R/policy_$1_${side}_$round.txt 2>&1
      log "policy $1 $side $round rc=$?"
      obs $d/bench_attention $1_${side}_$round
    done
  done
}
ab ptx52 /tmp/p52new /tmp/p52old
wait
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers,graph,importance,weights timeout 150 stdbuf -oL -eL \
  /tmp/nat/ffi_tests/test_gpu > $R/t_native.txt 2>&1
log "native policy,tiers,graph,importance,weights rc=$? $(tail -1 $R/t_native.txt)"
mkdir -p /tmp/n /tmp/o
cp /tmp/nat/bench/bench_policy /tmp/nat/bench/bench_attention /tmp/n/
cp /tmp/natold/bench/bench_policy /tmp/natold/bench/bench_attention /tmp/o/
ab native /tmp/n /tmp/o
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
cp /tmp/nat.log /tmp/natold.log $R/ 2>/dev/null
tar czf $OUT/r.tgz -C $OUT r
