#!/bin/bash
# On the GPU machine (the device tool), carrying .ab: the trees prepare.sh makes here, and the
# compute_52 test_gpu of scripts/build_carry.sh as .ab/bins/ptx52.tar.xz (tar -C .gpu-carry/ptx52
# -cJf .ab/bins/ptx52.tar.xz test_gpu). Both trees natively (nvcc 13, sm_90): main's test_gpu
# (every group, small mode) and the compute_52 one, the early tree's tiers and graph groups with
# every tiered call one launch, ptxas of its tiers TU, and the two tier benches (four tiers; one
# tier of Q4Q3) of each tree with the landed bound and with none, two rounds. (Run as two device
# calls, the bench again in the second; this is both in one.)
cd "$(dirname "$0")/../../.."
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
build() {  # tree dir
  (cmake -S $1 -B $2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DM40LLM_BUILD_EXAMPLES=OFF &&
    cmake --build $2 --target bench_attention test_gpu) > $2.log 2>&1
}
build .ab/base /tmp/base & b1=$!
build .ab/early /tmp/early & b2=$!
mkdir -p /tmp/p52 /tmp/ab && tar -C /tmp/p52 -xJf .ab/bins/ptx52.tar.xz
(M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout 330 /tmp/p52/test_gpu > /tmp/ab/test_gpu_ptx52_main.txt 2>&1
 echo "ptx52 all rc=$? $((SECONDS-t0)) s: $(tail -n 1 /tmp/ab/test_gpu_ptx52_main.txt)") &
p=$!
wait $b1 || { echo base build failed; grep -m5 -A5 error /tmp/base.log; }
wait $b2 || { echo early build failed; grep -m5 -A5 error /tmp/early.log; }
echo "built $((SECONDS-t0)) s"
(nvcc -std=c++17 -O3 -arch=sm_90 -DM40LLM_HAVE_CUDA=1 -I.ab/early/c/include -I.ab/early/c/src -I.ab/early/cuda -c .ab/early/cuda/attention_mma_tiers.cu \
  -o /tmp/tiers.o -Xptxas -v > /tmp/ab/ptxas_early_tiers.txt 2>&1; echo "ptxas rc=$?") &
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout 130 /tmp/base/ffi_tests/test_gpu > /tmp/ab/test_gpu_native_main.txt 2>&1
echo "native main all rc=$? $((SECONDS-t0)) s"; tail -n 1 /tmp/ab/test_gpu_native_main.txt
M40LLM_X_ONE_ROWS=1000000000 M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 M40LLM_TEST_ONLY=tiers,graph timeout 60 /tmp/early/ffi_tests/test_gpu > /tmp/ab/test_gpu_native_early_one_launch_tiers.txt 2>&1
echo "native early tiers,graph no bound rc=$? $((SECONDS-t0)) s"; tail -n 1 /tmp/ab/test_gpu_native_early_one_launch_tiers.txt
wait $p
SH="--shape 1,32,8,128,1024 --shape 1,32,8,128,4096 --shape 8,32,8,128,1024 --shape 8,32,8,128,2048 --shape 1,16,8,256,8192 --shape 1,32,8,64,8192 --shape 1,32,8,128,8192 --shape 8,32,8,128,8192 --shape 32,32,8,128,8192 --shape 1,32,8,128,32768 --shape 8,32,32,128,8192"
for r in 1 2; do for cfg in base early base_nb early_nb; do
  side=${cfg%_nb}; env=(); [ $cfg != $side ] && env=(M40LLM_X_ONE_ROWS=1000000000)
  d=/tmp/ab/r$r/$cfg; mkdir -p $d
  env "${env[@]}" /tmp/$side/bench/bench_attention --budget-ms 250 --tiers Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25 $SH --json $d/tiers-4.json > $d/tiers-4.txt 2>&1
  env "${env[@]}" /tmp/$side/bench/bench_attention --budget-ms 250 --tiers Q4Q3:1 $SH --json $d/tier-Q4Q3.json > $d/tier-Q4Q3.txt 2>&1
  echo "bench r$r $cfg $((SECONDS-t0)) s"
done; done
tar czf $OUT/ab.tgz -C /tmp ab
# Here: tar xzf ab.tgz; mv ab/* bench/results_tiers/h200_early/; python3 bench/config_table.py 'bench/results_tiers/h200_early/r{r}/{cfg}/tiers-4.json' (and tier-Q4Q3)
