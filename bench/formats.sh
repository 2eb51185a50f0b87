#!/usr/bin/env bash
# K/V formats side by side on the GPU machine: bench_attention with --format F16, Q8, Q4, Q8Q4,
# Q4Q3 and Q4Q2 (and Q8, Q4 plain and unrotated) over the same shapes, in one run, and a table of each format's time against F16's.
#
#   bench/formats.sh BENCH_BINARY OUTDIR [bench_attention args, default: the shapes below]
#
# Run it with the native build (sm_80+: every format on the tensor-core kernel) and with the
# carried compute_52-PTX build (every format on the M40's FP32 kernel).
set -uo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 BENCH_BINARY OUTDIR [bench args]" >&2; exit 2; fi
BIN=$1; OUT=$2; shift 2
mkdir -p "$OUT"
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  source "$(dirname "$0")/formats_shapes.sh"
  for s in "${FORMAT_SHAPES[@]}"; do args+=(--shape "$s"); done
fi
for f in F16 Q8 Q4 Q8Q4 Q4Q3 Q4Q2; do
  "$BIN" --format "$f" "${args[@]}" --json "$OUT/$f.json" >"$OUT/$f.txt" 2>&1 ||
    echo "formats: $f exited $?"
done
# The quantized formats plain too (no rotation, no protected tokens: both on by default), and
# protected but unrotated: what each costs.
for f in Q8 Q4; do
  "$BIN" --format "$f" --kv-rotation none --kv-protect 0,0 "${args[@]}" \
    --json "$OUT/$f-plain.json" >"$OUT/$f-plain.txt" 2>&1 || echo "formats: $f plain exited $?"
  "$BIN" --format "$f" --kv-rotation none "${args[@]}" --json "$OUT/$f-norot.json" \
    >"$OUT/$f-norot.txt" 2>&1 || echo "formats: $f unrotated exited $?"
done
python3 "$(dirname "$0")/formats_table.py" "$OUT" | tee "$OUT/formats.md"
