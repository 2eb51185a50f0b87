#!/bin/bash
# The ranking's comparisons on integer keys (the scores' bits) instead of doubles: compute_52
# builds only (.ab/t/p52new.tar.xz: this tree; .ab/t/p52prev.tar.xz: 7a90872's kernels), the
# policy group of test_gpu on the new one, then bench_policy and the observe call, old and new.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
R=$OUT/k; mkdir -p $R /tmp/n /tmp/o
t0=$SECONDS
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
tar -C /tmp/n -xJf .ab/t/p52new.tar.xz
tar -C /tmp/o -xJf .ab/t/p52prev.tar.xz
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy timeout 170 /tmp/n/test_gpu > $R/t_ptx52.txt 2>&1
log "ptx52 policy rc=$? $(tail -n 1 $R/t_ptx52.txt)"
T=Q8Q8:0.1,Q8Q4:0.2,Q4Q3:0.3,Q4Q2:0.4
for side in o n o n; do
  timeout 60 /tmp/$side/bench_policy $R/policy_$side.json >> $R/policy_$side.txt 2>&1
  timeout 30 /tmp/$side/bench_attention --shape 8,32,8,128,8192 --shape 1,32,8,128,32768 \
    --tiers $T --observe --budget-ms 100 >> $R/obs_$side.txt 2>&1
  log "$side rc=$?"
done
tar czf $OUT/k.tgz -C $OUT k
