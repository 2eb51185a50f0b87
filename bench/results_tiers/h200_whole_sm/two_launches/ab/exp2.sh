#!/bin/bash
# The A/B of kTierOneLaunchMinLaunches, as run: one launch for 2-tier calls
# (M40LLM_EXP_MIN_LIVE=2, the rule before) or only from 3 launches (=3, the 2-tier calls
# chained), native sm_90. The switch was a patch of one_launch_pass for that call only
# (`getenv("M40LLM_EXP_MIN_LIVE")` in place of the constant); the tree has the constant.
cd "$(dirname "$0")/.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
R=$OUT/e; mkdir -p $R
cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_BENCH=ON \
  -DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF > /tmp/cfg.log 2>&1 &&
  cmake --build /tmp/nat -j16 --target bench_attention > /tmp/b.log 2>&1 || { tail -20 /tmp/b.log; exit 1; }
B=/tmp/nat/bench/bench_attention
SH="--shape 1,32,8,128,1024 --shape 1,32,8,128,2048 --shape 1,32,8,128,4096 --shape 1,32,8,128,8192 --shape 8,32,8,128,1024 --shape 8,32,8,128,2048 --shape 1,16,8,256,8192 --shape 1,32,8,64,8192"
for f in Q8Q4 Q4Q3 Q8; do $B --format $f $SH --json $R/u_$f.json > $R/u_$f.txt 2>&1; done
for r in 1 2; do for m in 2 3; do
  M40LLM_EXP_MIN_LIVE=$m $B --tiers Q8Q4:0.5868,Q4Q3:0.4132 $SH --json $R/plan6_m${m}_r$r.json > $R/plan6_m${m}_r$r.txt 2>&1
  M40LLM_EXP_MIN_LIVE=$m $B --tiers Q8Q8:0.3,Q8Q4:0.7 $SH --json $R/hi_m${m}_r$r.json > $R/hi_m${m}_r$r.txt 2>&1
done; done
tar czf $OUT/e.tgz -C $OUT e
