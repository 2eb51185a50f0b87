#!/usr/bin/env bash
# One unattended entry point for the GPU machine: builds natively (sm_90, Release), runs
# bench/compare.py (bench_attention + sdpa_bench.py over the same grid), plots, and copies the
# results to OUTDIR.
#
#   bench/run_gpu.sh OUTDIR [compare.py options, e.g. --quick or --batch 1,8]
#
# OUTDIR gets (5 files): compare.md, compare.json (both raw results inside), bench_plot.png
# (if matplotlib is there), bench_log.txt (everything printed), build_log.txt; and, where a
# compute_52-only bench_attention is carried (scripts/build_carry.sh: .gpu-carry/bench52), the M40
# proxy grid beside the native one (bench/m40_proxy.py: m40_proxy.md, m40_proxy.json).
# Environment: M40LLM_BENCH_BUILD (build dir, default /tmp/m40llm-bench-build),
#              CUDA_ARCHS (default 90), BENCH_TOTAL_S (whole script's time, default 540),
#              M40LLM_PROXY_BIN (the compute_52 bench_attention, default .gpu-carry/bench52/...).
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [compare.py options]" >&2
  exit 2
fi
OUTDIR=$1
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${M40LLM_BENCH_BUILD:-/tmp/m40llm-bench-build}
ARCHS=${CUDA_ARCHS:-90}
WORK=$(mktemp -d /tmp/m40llm-bench-XXXXXX)
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
LOG="$OUTDIR/bench_log.txt"
BLOG="$OUTDIR/build_log.txt"
: >"$BLOG"

say() { echo "run_gpu: $*" | tee -a "$LOG"; }
: >"$LOG"
say "start $(date -u +%FT%TZ) in $ROOT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -2
  cmake --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  python3 -c 'import matplotlib; print("matplotlib", matplotlib.__version__)' 2>&1 | tail -1
} 2>&1 | tee -a "$LOG"

# Build: Release first; if that fails (e.g. -Werror on an optimizer-only warning in the C code),
# retry once with build type None (no per-configuration flags; an empty one means Release in
# CMakeLists.txt) so the benchmark still runs (noted in the log).
build() {  # $1 = build type
  rm -rf "$BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" -DCMAKE_BUILD_TYPE="$1" \
    -DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF >>"$BLOG" 2>&1 &&
    cmake --build "$BUILD" --target bench_attention >>"$BLOG" 2>&1
}
BUILD_TYPE=Release
if ! build Release; then
  say "Release build FAILED (see build_log.txt); retrying with build type None (no -O flags)"
  tail -30 "$BLOG" | tee -a "$LOG"
  BUILD_TYPE=None
  if ! build None; then
    say "build FAILED again; no m40llm results"
    tail -40 "$BLOG" | tee -a "$LOG"
    BUILD_TYPE=failed
  fi
fi
say "build: $BUILD_TYPE (CUDA architectures $ARCHS)"
BIN="$BUILD/bench/bench_attention"

# Both benchmarks share what is left of BENCH_TOTAL_S (default 540 s, for a 600 s command limit);
# each writes its JSON after every shape, so a timeout still leaves partial results.
PROXY_BIN=${M40LLM_PROXY_BIN:-$ROOT/.gpu-carry/bench52/bench_attention}
PROXY_S=0
[ -x "$PROXY_BIN" ] && PROXY_S=60  # the proxy grid's one round, after the comparison
LEFT=$(( ${BENCH_TOTAL_S:-540} - SECONDS - 15 - PROXY_S ))
[ $LEFT -lt 60 ] && LEFT=60
say "benchmarks get ${LEFT} s"
CMP=(python3 "$ROOT/bench/compare.py" --outdir "$WORK" --total-timeout "$LEFT")
if [ -x "$BIN" ]; then
  CMP+=(--bin "$BIN")
else
  # No binary: still run the PyTorch side so the call is not wasted.
  echo '{"tool": "bench_attention", "shapes": [], "note": "build failed"}' >"$WORK/m40llm-empty.json"
  CMP+=(--m40-json "$WORK/m40llm-empty.json")
fi
"${CMP[@]}" "$@" 2>&1 | tee -a "$LOG"
say "compare exit ${PIPESTATUS[0]}"

if [ -f "$WORK/compare.json" ]; then
  python3 "$ROOT/bench/plot.py" "$WORK/compare.json" "$OUTDIR/bench_plot.png" 2>&1 | tee -a "$LOG"
  cp "$WORK/compare.json" "$WORK/compare.md" "$OUTDIR/"
else
  # compare.py died before writing: keep whatever raw JSON exists.
  for f in m40llm.json sdpa.json; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUTDIR/"; done
fi
if [ -x "$PROXY_BIN" ]; then
  say "M40 proxy grid: $PROXY_BIN"
  python3 "$ROOT/bench/m40_proxy.py" "$OUTDIR" --bin "$PROXY_BIN" --work "$WORK/m40" 2>&1 | tee -a "$LOG"
else
  say "no compute_52 bench_attention at $PROXY_BIN (scripts/build_carry.sh): no M40 proxy grid"
fi
say "done $(date -u +%FT%TZ); files: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
