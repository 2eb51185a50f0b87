#!/usr/bin/env bash
# Tiered caches on the GPU machine: bench_attention over a few decode shapes with
#   - the uniform caches Q8, Q8Q4, Q4Q3 and Q4Q2,
#   - one tier of Q4Q3 (over exactly the uniform Q4Q3 cache's bytes),
#   - four tiers, the study's pairs (bench/fidelity/results/buckets.md), a quarter each
#     (or the tiered runs TIERS_MIXES names),
# all with the library's defaults (rotation, 4 sinks, a window of 128), and a table of each
# run's time and bandwidth (bench/tiers_table.py).
#
#   bench/tiers.sh BENCH_BINARY OUTDIR [bench_attention args, default: the shapes below]
#   bench/tiers.sh --mixes     the tiered runs' names and --tiers specs, a line each
#   bench/tiers.sh --shapes    the default shapes (B,H,Hkv,D,L), a line each
set -uo pipefail
SHAPES="1,32,8,128,8192 8,32,8,128,8192 32,32,8,128,8192 1,32,8,128,32768 8,32,32,128,8192"
# TIERS_MIXES: other tiered runs, a line each: a name and a --tiers spec of the four pairs.
MIXES=${TIERS_MIXES:-"tier-Q4Q3 Q4Q3:1
tiers-4 Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25"}
case ${1:-} in
  --mixes) echo "$MIXES"; exit 0 ;;
  --shapes) tr ' ' '\n' <<<"$SHAPES"; exit 0 ;;
esac
if [ $# -lt 2 ]; then echo "usage: $0 BENCH_BINARY OUTDIR [bench args]" >&2; exit 2; fi
BIN=$1; OUT=$2; shift 2
mkdir -p "$OUT"
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  for s in $SHAPES; do args+=(--shape "$s"); done
fi
run() {  # name, bench args...
  local name=$1; shift
  "$BIN" "$@" "${args[@]}" --json "$OUT/$name.json" >"$OUT/$name.txt" 2>&1 ||
    echo "tiers: $name exited $?"
}
run Q8 --format Q8
run Q8Q4 --format Q8Q4
run Q4Q3 --format Q4Q3
run Q4Q2 --format Q4Q2
echo "$MIXES" >"$OUT/mixes.txt"
while read -r name mix; do run "$name" --tiers "$mix"; done <<<"$MIXES"
python3 "$(dirname "$0")/tiers_table.py" "$OUT" | tee "$OUT/tiers.md"
