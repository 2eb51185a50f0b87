#!/bin/bash
# The merge A/B (ptx52/merge/) (M40 path, compute_52 PTX through the JIT): the 8-warp combine's merge as main
# has it (new2, landed) against main (base) and against the shuffle merge in both kernels (new1),
# short and long batch-1 shapes, 3 rounds each.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
mkdir -p /tmp/p1/base /tmp/p1/new /tmp/p2/base /tmp/p2/new
cp .ab/bins/base/bench_attention /tmp/p1/base/; cp .ab/bins/new2/bench_attention /tmp/p1/new/
cp .ab/bins/new1/bench_attention /tmp/p2/base/; cp .ab/bins/new2/bench_attention /tmp/p2/new/
sh=(); for s in 1,32,32,128,512 1,32,32,128,2048 1,32,32,128,8192 1,32,8,128,512 1,32,8,128,2048 \
  1,64,8,128,512 1,64,8,128,2048 1,32,8,64,512 8,32,8,128,512 1,8,1,256,8192 1,8,1,256,32768 \
  1,16,1,256,131072 1,32,8,128,32768 1,8,1,128,32768; do sh+=(--shape $s); done
mkdir -p .ab/empty
AB_BINS=/tmp/p1 timeout 250 bash bench/ab.sh .ab/empty /tmp/main_vs_new2 3 -- "${sh[@]}"
echo "ab1 rc=$? $((SECONDS-t0)) s"
AB_BINS=/tmp/p2 timeout $((560 - SECONDS)) bash bench/ab.sh .ab/empty /tmp/new1_vs_new2 3 -- "${sh[@]}"
echo "ab2 rc=$? $((SECONDS-t0)) s"
tar czf $OUT/merge.tgz -C /tmp main_vs_new2 new1_vs_new2
