#!/usr/bin/env bash
# On the GPU machine: native build, the GPU test suite, and bench_attention on a few key shapes
# (no PyTorch) — the fast loop for kernel changes. Usage: scripts/perf_quick.sh [bench args]
# Env: BUILD (build dir, default build-native), CMAKE_ARGS (e.g. "-DM40LLM_TENSOR_CORES=OFF"),
# SHAPES ("B,H,Hkv,D,L ..." instead of the default shapes). To compare tuning-table values, edit
# cuda/tuning.cuh in a copy and use bench/ab.sh.
set -uo pipefail
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
build=${BUILD:-build-native}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  ${CMAKE_ARGS:-} >/dev/null && cmake --build "$build" >/dev/null || exit 1
echo "== $build ${CMAKE_ARGS:-}"
M40LLM_REQUIRE_GPU=1 "$build"/ffi_tests/test_gpu | tail -n 1 || exit 1
shapes=()
for s in ${SHAPES:-1,32,32,128,2048 1,32,8,128,2048 1,32,8,128,32768 32,32,32,128,8192
                   32,32,8,128,8192 8,64,8,128,8192 32,32,8,64,8192}; do
  shapes+=(--shape "$s")
done
# The table: its header and one row per shape.
"$build"/bench/bench_attention "${shapes[@]}" "$@" | grep -E '^ *(B|[0-9]+) ' 
