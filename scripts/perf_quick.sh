#!/usr/bin/env bash
# On the GPU machine: native build, the GPU test suite, and bench_attention on a few key shapes
# (no PyTorch) — the fast loop for kernel changes. Usage: scripts/perf_quick.sh [bench args]
set -uo pipefail
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  >/dev/null && cmake --build build-native >/dev/null || exit 1
M40LLM_REQUIRE_GPU=1 build-native/ffi_tests/test_gpu | tail -n 1 || exit 1
shapes=(--shape 1,32,32,128,2048 --shape 1,32,8,128,2048 --shape 1,32,8,128,32768
        --shape 32,32,32,128,8192 --shape 32,32,8,128,8192 --shape 8,64,8,128,8192
        --shape 32,32,8,64,8192)
build-native/bench/bench_attention "${shapes[@]}" "$@" | tail -n 12
