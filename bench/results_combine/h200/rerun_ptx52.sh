#!/bin/bash
# The M40 path's A/B (ptx52/ab52, ab52b1): the M40's path, compute_52 PTX (CUDA 11.8, built here) through the JIT:
# .ab/bins/base (main 9fd9015) against .ab/bins/new (this tree), bench/ab.sh's whole grid
# (2 rounds), then the B1 shapes of few K/V heads (3 rounds).
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
t0=$SECONDS
AB_BINS=.ab/bins timeout 430 bash bench/ab.sh .ab/base /tmp/ab52 2
echo "ab rc=$? $((SECONDS-t0)) s"
tar czf $OUT/ab52.tgz -C /tmp ab52
sh=(); for s in 1,8,1,256,32768 1,16,1,256,131072 1,8,1,128,32768 1,16,1,64,32768 1,64,1,128,32768 \
  1,28,4,128,8192 1,28,4,128,32768 1,32,8,128,32768 1,64,8,128,32768 1,8,1,256,8192 2,16,2,128,16384; do sh+=(--shape $s); done
AB_BINS=.ab/bins timeout $((585 - SECONDS)) bash bench/ab.sh .ab/base /tmp/ab52b1 3 -- "${sh[@]}"
echo "ab b1 rc=$? $((SECONDS-t0)) s"
tar czf $OUT/ab52b1.tgz -C /tmp ab52b1
