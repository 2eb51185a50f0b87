#!/bin/bash
# device call 30: find test_gpu's segfault (groups one process each, line-buffered; gdb's
# backtrace of a crashing group where gdb exists), compute_52 and native; bench_policy after the
# host-side fixes (scores computed once a copy, one copy a layer).
cd "$(dirname "$0")/.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY M40LLM_TEST_SMALL=1
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R /tmp/p52
tar -C /tmp/p52 -xJf .ab/t/p52.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_BENCH=ON >/tmp/nat_cfg.log 2>&1 &&
  cmake --build /tmp/nat -j12 --target test_gpu bench_policy >/tmp/nat_build.log 2>&1; echo "native build rc=$? $((SECONDS-t0)) s" >> $R/log.txt ) &
echo "gdb: $(command -v gdb)" >> $R/log.txt
groups() { # $1 binary, $2 tag
  for g in context errors sequences rounding attention quantized append masked causal dtype weights importance tiers policy graph decode; do
    M40LLM_TEST_ONLY=$g timeout 200 stdbuf -oL -eL $1 > $R/t_$2_$g.txt 2>&1; rc=$?
    echo "$2 $g rc=$rc $((SECONDS-t0)) s $(tail -1 $R/t_$2_$g.txt)" >> $R/log.txt
    if [ $rc = 139 ] && command -v gdb >/dev/null; then
      M40LLM_TEST_ONLY=$g timeout 200 gdb -batch -ex run -ex bt $1 > $R/gdb_$2_$g.txt 2>&1
    fi
  done
}
groups /tmp/p52/ffi_tests/test_gpu ptx52
timeout 60 /tmp/p52/bench/bench_policy $R/policy_ptx52.json > $R/policy_ptx52.txt 2>&1; echo "ptx52 policy rc=$? $((SECONDS-t0)) s" >> $R/log.txt
wait
cp /tmp/nat_build.log $R/ 2>/dev/null
timeout 60 /tmp/nat/bench/bench_policy $R/policy_native.json > $R/policy_native.txt 2>&1; echo "native policy rc=$? $((SECONDS-t0)) s" >> $R/log.txt
[ $((SECONDS-t0)) -lt 420 ] && groups /tmp/nat/ffi_tests/test_gpu native
tar czf $OUT/r.tgz -C $OUT r
