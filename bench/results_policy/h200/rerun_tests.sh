#!/bin/bash
# device call 32: after review fixes (fork over a longer sequence, the copy only for appends that
# take rows out of the window) and the grown policy cases: test_gpu's policy group on both builds.
cd "$(dirname "$0")/.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY M40LLM_TEST_SMALL=1
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R /tmp/p52
tar -C /tmp/p52 -xJf .ab/t/p52t.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >/tmp/nat_cfg.log 2>&1 &&
  cmake --build /tmp/nat -j14 --target test_gpu >/tmp/nat_build.log 2>&1; echo "native build rc=$? $((SECONDS-t0)) s" >> $R/log.txt ) &
M40LLM_TEST_ONLY=policy timeout 200 stdbuf -oL -eL /tmp/p52/ffi_tests/test_gpu > $R/t_ptx52_policy.txt 2>&1; echo "ptx52 policy rc=$? $((SECONDS-t0)) s $(tail -1 $R/t_ptx52_policy.txt)" >> $R/log.txt
wait
M40LLM_TEST_ONLY=policy timeout 100 stdbuf -oL -eL /tmp/nat/ffi_tests/test_gpu > $R/t_native_policy.txt 2>&1; echo "native policy rc=$? $((SECONDS-t0)) s $(tail -1 $R/t_native_policy.txt)" >> $R/log.txt
tar czf $OUT/r.tgz -C $OUT r
