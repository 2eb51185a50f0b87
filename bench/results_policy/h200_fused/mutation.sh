#!/bin/bash
# Does the policy group see a wrong merge of a tier's chunks? test_gpu (native, sm_90) of the
# tree and of the tree with tier_rank_kernel's last block merging only chunk 0's list: the
# mutant's policy group (its case with a 4,300-row tier ranks it in two chunks), and the tree's
# groups policy, tiers, graph, importance and weights (the final tree's host code).
cd "$(dirname "$0")/../../.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
R=$OUT/m; mkdir -p $R /tmp/mut
t0=$SECONDS
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
tar --exclude=./.ab --exclude=./.git --exclude="./build*" --exclude=./rust -cf - . | tar -C /tmp/mut -xf -
sed -i 's/for (int i = lane; i < chunks \* kLow; i += 32)/for (int i = lane; i < kLow; i += 32)/' \
  /tmp/mut/cuda/tier_policy.cu
grep -c "i < kLow; i += 32" /tmp/mut/cuda/tier_policy.cu > $R/mutated.txt
nat() { # $1 source, $2 build dir
  cmake -S $1 -B $2 -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > $2.cfg.log 2>&1 &&
    cmake --build $2 -j8 --target test_gpu > $2.log 2>&1
}
( nat . /tmp/nat; log "tree build rc=$?" ) &
( nat /tmp/mut /tmp/natmut; log "mutant build rc=$?" ) &
wait
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers,graph,importance,weights timeout 100 \
  /tmp/nat/ffi_tests/test_gpu > $R/t_nat.txt 2>&1
log "tree policy,tiers,graph,importance,weights rc=$? $(tail -n 1 $R/t_nat.txt)"
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy timeout 100 /tmp/natmut/ffi_tests/test_gpu \
  > $R/t_natmut.txt 2>&1
log "mutant policy rc=$? $(tail -n 1 $R/t_natmut.txt)"
tar czf $OUT/m.tgz -C $OUT m
