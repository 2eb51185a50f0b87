#!/usr/bin/env bash
# Builds fuzz/fuzz_api.c (libFuzzer, ASan + UBSan, the library's CPU sources) with clang and runs
# it for FUZZ_SECONDS (default 60) over a copy of the seed corpus fuzz/corpus; any finding (a
# crash, a sanitizer report, a mismatch with the model) fails. Needs clang (apt-get install clang).
#   scripts/fuzz.sh                  the CI run
#   FUZZ_SECONDS=3600 scripts/fuzz.sh    longer; extra libFuzzer flags may follow, e.g. -jobs=4
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cc=${FUZZ_CC:-$(command -v clang || true)}
[ -n "$cc" ] || { echo "fuzz.sh: no clang (apt-get install clang)" >&2; exit 1; }
out="$root/build-fuzz"
mkdir -p "$out/corpus"
srcs=$(sed -n 's|^common \(.*\)|'"$root"'/\1|p' "$root/c/sources.txt")
# shellcheck disable=SC2086
"$cc" -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
  -I"$root/c/include" -I"$root/c/src" $srcs "$root/fuzz/fuzz_api.c" -lm -o "$out/fuzz_api"
cp -n "$root"/fuzz/corpus/* "$out/corpus/" 2>/dev/null || true
# Findings are written to build-fuzz/ (crash-*, leak-*); the run exits nonzero on the first one.
"$out/fuzz_api" -max_total_time="${FUZZ_SECONDS:-60}" -print_final_stats=1 \
  -artifact_prefix="$out/" "$@" "$out/corpus" "$root/fuzz/corpus"
