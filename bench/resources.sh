#!/usr/bin/env bash
# Kernel resources on the M40 (sm_52) without a GPU: builds the library's CUDA sources with the
# project's own CMake flags plus -Xptxas=-v for sm_52 only, then bench/m40_resources.py parses
# every entry function ptxas reports (registers, shared memory, stack, spills), computes GM200
# occupancy, and predicts the M40 time of each benchmark shape from the bytes-moved model.
#
#   bench/resources.sh [BUILD_DIR] [-- extra m40_resources.py args, e.g. --block 'append=256']
#
# The causal kernels' threads are compile-time expressions of their shapes (WarpShape<DMAX>::NT,
# WideShape<DMAX>::NT): given here.
# Writes bench/m40_resources.md and bench/m40_resources.json. Needs a CUDA toolkit that can still
# target sm_52 (CUDA 11.8 here; nvcc 13 cannot).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=/tmp/m40llm-resources
if [ $# -gt 0 ] && [ "$1" != "--" ]; then BUILD=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
CMAKE_ARGS=(-S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_CUDA_ARCHITECTURES=52-real "-DCMAKE_CUDA_FLAGS=-Xptxas=-v"
  -DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_BENCH=OFF)
cmake "${CMAKE_ARGS[@]}" >"$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log"; exit 1; }
grep -q 'm40llm: CUDA backend ON' "$BUILD.configure.log" ||
  { echo "resources: the CUDA backend is not enabled in $BUILD (no CUDA toolkit?)"; exit 1; }

LOG="$BUILD/ptxas.log"
# Only the CUDA objects (from c/sources.txt's "cuda" group): the C files don't matter here.
# Verbose, so the log names each source before its ptxas report; cleaned first so every file is
# compiled (and reported) again; -k 0 so one broken file doesn't hide the others' reports.
TARGETS=()
while read -r group path; do
  [ "$group" = cuda ] && TARGETS+=("CMakeFiles/m40llm.dir/$path.o")
done < <(grep -E '^cuda ' "$ROOT/c/sources.txt")
cmake --build "$BUILD" --target clean >/dev/null 2>&1 || true
set +e
cmake --build "$BUILD" -v -- -k 0 "${TARGETS[@]}" >"$LOG" 2>&1
BUILD_RC=$?
set -e
if [ $BUILD_RC -ne 0 ]; then
  grep -E 'error|FAILED' "$LOG" | head -20
  echo "resources: some CUDA sources failed to build (full log: $LOG); reporting the kernels that built"
fi
NVCC=$(grep -m1 '^CMAKE_CUDA_COMPILER:' "$BUILD/CMakeCache.txt" | cut -d= -f2-)
NVCC_VER=$("$NVCC" --version | grep -m1 release || true)
python3 "$ROOT/bench/m40_resources.py" --log "$LOG" --src "$ROOT/cuda" \
  --md "$ROOT/bench/m40_resources.md" --json "$ROOT/bench/m40_resources.json" \
  --nvcc "$NVCC_VER" \
  --cmd "cmake -S . -B BUILD ${CMAKE_ARGS[*]:4} && cmake --build BUILD -v -- <cuda objects>" \
  --block 'causal_warp_kernel<.*, 64>$=256' --block 'causal_wide_kernel<=128' \
  --block 'attn_combine_kernel<\d+, 8>=256' --block 'attn_combine_kernel<\d+, 32>=1024' "$@"
