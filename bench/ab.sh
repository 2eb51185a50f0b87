#!/usr/bin/env bash
# A/B of the attention kernels on the GPU machine: builds bench_attention from two trees (the
# previous main, carried as a plain copy, and this one) for the machine's GPU, then times both
# over the same shapes in alternating rounds in one run, and writes a table of the medians.
#
#   bench/ab.sh BASE_TREE OUTDIR [ROUNDS] [-- bench_attention args, e.g. --shape 1,32,8,128,512]
#
# Without shape arguments it runs the whole grid plus the head_dim 48-112 tail. Make BASE_TREE
# here with: git archive <rev> | tar -x -C .ab/base (and carry .ab). OUTDIR gets ab.md, ab.json
# and each run's JSON. Env: CUDA_ARCHS (default: the GPU's), AB_BUILD (default /tmp/m40llm-ab),
# AB_BINS=DIR: time DIR/base/bench_attention and DIR/new/bench_attention as they are, built
# elsewhere (e.g. compute_52 PTX with CUDA 11.8: the M40's path through the JIT); BASE_TREE is
# then unused.
set -uo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 BASE_TREE OUTDIR [ROUNDS] [-- bench args]" >&2; exit 2; fi
BASE=$(cd "$1" && pwd); OUT=$2; shift 2
ROUNDS=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then ROUNDS=$1; shift; fi
[ "${1:-}" = "--" ] && shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${AB_BUILD:-/tmp/m40llm-ab}
ARCHS=${CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)}
mkdir -p "$OUT"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

build() {  # tree, dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
    -DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF >"$2.log" 2>&1 &&
    cmake --build "$2" --target bench_attention >>"$2.log" 2>&1
}
if [ -n "${AB_BINS:-}" ]; then
  for side in base new; do
    mkdir -p "$BUILD-$side/bench" && cp "$AB_BINS/$side/bench_attention" "$BUILD-$side/bench/"
  done
else
  build "$BASE" "$BUILD-base" & b1=$!
  build "$ROOT" "$BUILD-new" & b2=$!
  wait $b1 || { echo "ab: base build failed"; tail -30 "$BUILD-base.log"; exit 1; }
  wait $b2 || { echo "ab: new build failed"; tail -30 "$BUILD-new.log"; exit 1; }
fi

args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  for s in 8,32,8,80,8192 32,32,8,80,8192 1,32,8,80,32768 8,64,8,112,8192 32,32,8,48,8192 \
           32,32,8,96,8192; do
    args+=(--shape "$s")
  done
  args=(--all-grid "${args[@]}")
fi
run() {  # which, round
  local extra=()
  if [ "${args[0]}" = --all-grid ]; then
    "$BUILD-$1/bench/bench_attention" --json "$OUT/$1_r$2_grid.json" >"$OUT/$1_r$2_grid.txt" 2>&1
    extra=("${args[@]:1}")
  else
    extra=("${args[@]}")
  fi
  "$BUILD-$1/bench/bench_attention" "${extra[@]}" --json "$OUT/$1_r$2.json" >"$OUT/$1_r$2.txt" 2>&1
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then run base "$r"; run new "$r"; else run new "$r"; run base "$r"; fi
  echo "ab: round $r done ($SECONDS s)"
done
python3 "$ROOT/bench/ab_table.py" "$OUT" | tee "$OUT/ab.md"
