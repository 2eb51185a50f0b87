#!/bin/bash
# One device call: the observe call's reduction into the accumulators fused into one kernel and
# the ranking's merge into its last block (this change) against the previous main (b823c09),
# both built here natively (sm_90) from the tree and .ab/t/old_src.tgz, and both carried as
# compute_52 PTX builds (.ab/t/p52new.tar.xz, .ab/t/p52old.tar.xz: test_gpu, bench_attention,
# bench_policy). test_gpu's groups policy, tiers, graph, importance and weights on both new
# builds; bench_attention --observe and --importance and bench_policy, old and new alternating,
# two rounds (and the plain call, new); the new observe call's kernels under ncu. Two calls, one
# right after the other (the machine kept warm): `rerun.sh 1` (the native builds beside the
# compute_52 runs), then `rerun.sh 2` (the native runs).
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r$1; mkdir -p $R
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
nat() { # $1 source, $2 build dir, targets...
  local src=$1 dir=$2; shift 2
  cmake -S $src -B $dir -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DM40LLM_BUILD_BENCH=ON > $dir.cfg.log 2>&1 && cmake --build $dir -j8 --target "$@" > $dir.log 2>&1
}
G=policy,tiers,graph,importance,weights
T=Q8Q8:0.1,Q8Q4:0.2,Q4Q3:0.3,Q4Q2:0.4
S="--shape 8,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,9,3,64,2048"
obs() { # $1 bin, $2 tag, $3 mode flag
  timeout 60 $1 $S --tiers $T $3 --budget-ms 150 --json $R/$2.json > $R/$2.txt 2>&1
  log "$2 rc=$?"
}
ab() { # $1 build tag, $2 new dir, $3 old dir
  for round in 1 2; do
    for side in old new; do
      d=$3; [ $side = new ] && d=$2
      timeout 90 $d/bench_policy $R/policy_$1_${side}_$round.json > $R/policy_$1_${side}_$round.txt 2>&1
      log "policy $1 $side $round rc=$?"
      obs $d/bench_attention obs_$1_${side}_$round --observe
      obs $d/bench_attention imp_$1_${side}_$round --importance
    done
  done
  obs $2/bench_attention plain_$1 ""
}
if [ "$1" = 1 ]; then
mkdir -p /tmp/p52new /tmp/p52old /tmp/oldsrc
tar -C /tmp/p52new -xJf .ab/t/p52new.tar.xz
tar -C /tmp/p52old -xJf .ab/t/p52old.tar.xz
tar -C /tmp/oldsrc -xzf .ab/t/old_src.tgz
( nat . /tmp/nat test_gpu bench_policy bench_attention; log "native new build rc=$?" ) &
( nat /tmp/oldsrc /tmp/natold bench_policy bench_attention; log "native old build rc=$?" ) &
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=$G timeout 240 stdbuf -oL -eL /tmp/p52new/test_gpu > $R/t_ptx52.txt 2>&1
log "ptx52 $G rc=$? $(tail -1 $R/t_ptx52.txt)"
ab ptx52 /tmp/p52new /tmp/p52old
timeout 100 ncu --kernel-name regex:"attn|combine|tier_rank" --launch-skip 30 --launch-count 24 \
  --metrics gpu__time_duration.sum /tmp/p52new/bench_attention --shape 8,32,8,128,8192 --tiers $T \
  --observe --no-graph --no-check --sample-ms 0.05 --budget-ms 10 > $R/ncu_obs_ptx52_new.txt 2>&1
log "ncu rc=$?"
wait
cp /tmp/nat.log /tmp/natold.log $R/ 2>/dev/null
else
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=$G timeout 150 stdbuf -oL -eL \
  /tmp/nat/ffi_tests/test_gpu > $R/t_native.txt 2>&1
log "native $G rc=$? $(tail -1 $R/t_native.txt)"
mkdir -p /tmp/n /tmp/o
cp /tmp/nat/bench/bench_policy /tmp/nat/bench/bench_attention /tmp/n/
cp /tmp/natold/bench/bench_policy /tmp/natold/bench/bench_attention /tmp/o/
ab native /tmp/n /tmp/o
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
fi
tar czf $OUT/r$1.tgz -C $OUT r$1
