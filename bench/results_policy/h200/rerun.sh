#!/bin/bash
# device call 31: after the 0-row tier fix: test_gpu's policy and tiers groups on both builds
# (native built here), then the whole compute_52 test_gpu (small); bench_policy and
# bench_attention --observe/--importance/plain on both builds.
cd "$(dirname "$0")/.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R /tmp/p52
tar -C /tmp/p52 -xJf .ab/t/p52.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_BENCH=ON >/tmp/nat_cfg.log 2>&1 &&
  cmake --build /tmp/nat -j12 --target test_gpu bench_policy bench_attention >/tmp/nat_build.log 2>&1; echo "native build rc=$? $((SECONDS-t0)) s" >> $R/log.txt ) &
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers timeout 200 stdbuf -oL -eL /tmp/p52/ffi_tests/test_gpu > $R/t_ptx52_policy.txt 2>&1; echo "ptx52 policy,tiers rc=$? $((SECONDS-t0)) s $(tail -1 $R/t_ptx52_policy.txt)" >> $R/log.txt
timeout 60 /tmp/p52/bench/bench_policy $R/policy_ptx52.json > $R/policy_ptx52.txt 2>&1; echo "ptx52 policy bench rc=$? $((SECONDS-t0)) s" >> $R/log.txt
obs() { # $1 bin, $2 tag
  for m in plain importance observe; do
    f=; [ $m != plain ] && f=--$m
    timeout 60 $1 --shape 8,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,9,3,64,2048 \
      --tiers Q8Q8:0.1,Q8Q4:0.2,Q4Q3:0.3,Q4Q2:0.4 $f --budget-ms 150 --json $R/obs_$2_$m.json > $R/obs_$2_$m.txt 2>&1
    echo "$2 $m rc=$? $((SECONDS-t0)) s" >> $R/log.txt
  done
}
obs /tmp/p52/bench/bench_attention ptx52
wait
M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=policy,tiers timeout 100 stdbuf -oL -eL /tmp/nat/ffi_tests/test_gpu > $R/t_native_policy.txt 2>&1; echo "native policy,tiers rc=$? $((SECONDS-t0)) s $(tail -1 $R/t_native_policy.txt)" >> $R/log.txt
timeout 60 /tmp/nat/bench/bench_policy $R/policy_native.json > $R/policy_native.txt 2>&1; echo "native policy bench rc=$? $((SECONDS-t0)) s" >> $R/log.txt
obs /tmp/nat/bench/bench_attention native
left=$((570 - SECONDS + t0))
[ $left -gt 60 ] && { M40LLM_TEST_SMALL=1 timeout $left stdbuf -oL -eL /tmp/p52/ffi_tests/test_gpu > $R/t_ptx52_all.txt 2>&1; echo "ptx52 all rc=$? $((SECONDS-t0)) s $(tail -1 $R/t_ptx52_all.txt)" >> $R/log.txt; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
