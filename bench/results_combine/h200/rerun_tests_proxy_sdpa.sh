#!/bin/bash
# The tests, the M40 proxy grid and PyTorch (ptx52/, sdpa/): compute_52 PTX test_gpu of this tree (small mode; .ab/bins/ptx52.tar.xz, built
# here), the M40 proxy grid A/B (bench/m40_proxy.py, 2 rounds), and PyTorch SDPA over the grid
# beside native/abgrid/new_r1_grid.json, the first version's native grid (bench/compare.py --m40-json).
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
mkdir -p /tmp/t52 && tar -C /tmp/t52 -xJf .ab/bins/ptx52.tar.xz
M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout 320 /tmp/t52/test_gpu > $OUT/test_gpu_ptx52.txt 2>&1
echo "test_gpu ptx52 rc=$? $((SECONDS-t0)) s: $(tail -n 1 $OUT/test_gpu_ptx52.txt)"
timeout 130 python3 bench/m40_proxy.py --bin .ab/bins/new/bench_attention --base .ab/bins/base/bench_attention --rounds 2 /tmp/proxy > /tmp/proxy.log 2>&1
echo "proxy rc=$? $((SECONDS-t0)) s"; tail -n 30 /tmp/proxy.log
tar czf $OUT/proxy.tgz -C /tmp proxy proxy.log
left=$((585 - SECONDS))
[ $left -gt 60 ] && timeout $left python3 bench/compare.py --m40-json bench/results_combine/h200/native/abgrid/new_r1_grid.json --outdir /tmp/cmp --sdpa-timeout $((left - 10)) > /tmp/cmp.log 2>&1
echo "compare rc=$? $((SECONDS-t0)) s"; tail -n 5 /tmp/cmp.log
tar czf $OUT/cmp.tgz -C /tmp cmp cmp.log
