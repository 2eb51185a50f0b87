#!/usr/bin/env bash
# Here (no GPU): the two trees rerun.sh builds on the device, in .ab/ (carry it):
#   .ab/base   main 8fb7135
#   .ab/early  the same, with a tier kernel's next K loads issued right after the score MMAs
#              (src.after_scores(p0) moved up in attn_mma_block where TIER)
# both with the one-launch bound read from M40LLM_X_ONE_ROWS (unset: kTierOneLaunchRowsPerSm).
set -euo pipefail
cd "$(dirname "$0")/../../.."
rm -rf .ab/base .ab/early
for d in .ab/base .ab/early; do
  mkdir -p "$d"
  git archive 8fb7135 c cuda cmake bench ffi_tests examples CMakeLists.txt | tar -x -C "$d"
  rm -rf "$d"/bench/results* "$d"/bench/fidelity "$d"/bench/profiles
done
python3 - .ab <<'PY'
import sys
def edit(path, pairs):
    s = open(path).read()
    for old, new in pairs:
        assert s.count(old) == 1, (path, old)
        s = s.replace(old, new)
    open(path, "w").write(s)
for tree in ("base", "early"):
    edit(f"{sys.argv[1]}/{tree}/cuda/attention_tiers.cu", [
        ("unit_rows > (int64_t)kTierOneLaunchRowsPerSm * st->sm_count",
         "unit_rows > (int64_t)x_one_rows() * st->sm_count"),
        ("int one_launch_pass(",
         "static int64_t x_one_rows() {\n  const char *e = getenv(\"M40LLM_X_ONE_ROWS\");\n"
         "  return e ? atoll(e) : kTierOneLaunchRowsPerSm;\n}\n\nint one_launch_pass("),
        ])
    p = f"{sys.argv[1]}/{tree}/cuda/attention_tiers.cu"
    s = open(p).read()
    open(p, "w").write("#include <cstdlib>\n" + s)
edit(f"{sys.argv[1]}/early/cuda/attention_mma.cuh", [
    ("      if constexpr (DS > 1) {  // the pair's slices added",
     "      if constexpr (TIER) src.after_scores(p0);\n"
     "      if constexpr (DS > 1) {  // the pair's slices added"),
    ("      run.l += sum;\n      src.after_scores(p0);",
     "      run.l += sum;\n      if constexpr (!TIER) src.after_scores(p0);")])
PY
