#!/usr/bin/env bash
# What a 16-bit caller pays: bench_attention with q and out as f32, f16 and bf16 (--io) over the
# same shapes, one binary, in one run; prints the time per call of each and the 16-bit calls'
# extra microseconds (the widening and rounding launches of cuda/io_rows.cu).
#   bench/io_cost.sh BENCH_ATTENTION OUTDIR [bench_attention args, e.g. --shape 1,32,8,128,512]
set -euo pipefail
bin=$1; out=$2; shift 2
mkdir -p "$out"
for io in f32 f16 bf16; do
  "$bin" --io "$io" --json "$out/io_$io.json" "$@" > "$out/io_$io.txt"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
runs = {io: json.load(open(f"{out}/io_{io}.json"))["shapes"] for io in ("f32", "f16", "bf16")}
print("| shape | f32 us | f16 us | bf16 us | f16 - f32 | bf16 - f32 | timed as |")
print("|---|---|---|---|---|---|---|")
for a, b, c in zip(runs["f32"], runs["f16"], runs["bf16"]):
    name = f"B{a['batch']} {a['n_heads']}/{a['n_kv_heads']} D{a['head_dim']} L{a['ctx']}"
    t = [x["time_us"] for x in (a, b, c)]
    print(f"| {name} | {t[0]:.2f} | {t[1]:.2f} | {t[2]:.2f} | {t[1] - t[0]:+.2f} | "
          f"{t[2] - t[0]:+.2f} | {a['time_source']} |")
PY
