#!/usr/bin/env bash
# Runs on the GPU machine (the device tool), from the repository root, after
# scripts/build_carry.sh here. Steps (default: all): native ptx52 rust sanitize bench append
#   native    build with the machine's CUDA for its GPU (e.g. sm_90) and run ctest
#   ptx52     run the carried compute_52-PTX C tests: the M40 code path through the JIT
#   rust      run the carried Rust test binaries
#   sanitize  compute-sanitizer memcheck and racecheck over the GPU tests (small shapes), the
#             native build and the carried compute_52-PTX one (M40LLM_TEST_ONLY=causal,... in
#             the environment: those groups of test_gpu's cases only); racecheck's report
#             is judged by scripts/racecheck/hazards.py after its pair-barrier probe
#   bench     bench/run_gpu.sh: m40llm vs PyTorch SDPA vs the copy roofline
#   append    bench_append (a decode step's append, batched vs one call per sequence), native
#             and compute_52-PTX builds: tables in append.log, JSON in $OUT/append_*.json
#   formats   bench/formats.sh: F16, Q8, Q4, Q8Q4, Q4Q3, Q4Q2 side by side, native and
#             compute_52-PTX builds
#   causal    causal attention (issue 17): test_gpu (all its cases; the causal ones in
#             ffi_tests/cases_causal.c) native and compute_52-PTX, then bench_causal on both
#             builds, and PyTorch SDPA (fp16, fp32) on the same shapes: tables in causal.log,
#             JSON in $OUT/causal_native.json, causal_ptx52.json and causal_sdpa.json (the
#             sanitize step covers the causal cases too)
#   step      issue 22's decode step: examples/decode_loop (32 layers, 32/8 heads, head_dim 128,
#             8 and 64 sequences, contexts 1K and 8K), eager and as a CUDA graph a step, against
#             the step's K/V bytes over the copy bandwidth; native and compute_52-PTX builds
#             (step.log). test_gpu's graph cases (ffi_tests/cases_graph.c) run in native/ptx52
#   ab        bench/ab.sh: the previous main (.ab/base, carried) against this tree, native, and
#             the carried compute_52-PTX benchmarks (.ab/bins/base, .gpu-carry/bench52)
#   m40       bench/m40_proxy.py: the M40 proxy grid (compute_52 PTX on this GPU against its copy
#             bandwidth, issue 20's targets), A/B against .ab/bins/base where carried: $OUT/m40
#   abcausal  bench/ab_causal.py: the causal kernel's A/B, the previous main's compute_52
#             bench_causal (.ab/bins/base) against this tree's (.gpu-carry/bench52): $OUT/abcausal
#   abcausalnative  the same on this GPU's own build: the previous main's (.ab/base, carried)
#             and this tree's bench_causal built here for it: $OUT/abcausalnative
#   weights   what m40llm_kvcache_attn_weights_ex costs over the plain call (bench/weights_cost.py:
#             F16 and Q4, both with and without weights, alternating rounds), native and
#             compute_52-PTX builds: $OUT/weights_native, $OUT/weights_ptx52
#   importance the same for m40llm_kvcache_attn_importance_ex (weights_cost.py --mode
#             importance): $OUT/importance_native, $OUT/importance_ptx52 (both steps also time
#             a four-tier cache, the format "tiers")
#   abexport  the exporting calls' A/B on the M40 path: the previous main's compute_52
#             bench_attention (.ab/bins/base) against this tree's, F16 and Q4, with --weights and
#             with --importance, over weights_cost.py's shapes: $OUT/abexport/*/ab.md
#             (EXPORT_FORMATS="F16" times one format)
#   abtiers   the tiered caches' A/B on the M40 path: the previous main's compute_52
#             bench_attention (.ab/bins/base) against this tree's, bench/tiers.sh's tiered runs
#             and shapes: $OUT/abtiers/*/ab.md
#   tiers     tiered caches (bench/tiers.sh): one tier against the uniform cache of its formats
#             (the same bytes), and a four-tier mix, native and compute_52-PTX builds:
#             $OUT/tiers_native, $OUT/tiers_ptx52
#   abformats the M40 path's K/V formats: the previous main's compute_52 bench_attention
#             (.ab/bins/base) against this tree's, bench/ab.sh over bench/formats_shapes.sh for
#             F16, Q8, Q4, Q8Q4 (library defaults) and Q8, Q4 plain: $OUT/abformats/*/ab.md
#             (AB_EXTRA_SHAPES="B,H,Hkv,D,L ..." adds shapes; AB_FORMATS="Q4Q3;Q4Q2" takes
#             those formats instead)
#   abformatsnative  the same on this GPU's own build (its tensor-core kernels on sm_80+): the
#             previous main (.ab/base, carried) and this tree built here: $OUT/abformats_native
# Logs and results go to $OUT (or ./gpu-out). Every GPU test must run: a skip is a failure here.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export M40LLM_REQUIRE_GPU=1
steps=${*:-native ptx52 rust sanitize bench append}
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)
declare -A result

run_step() {  # name, command...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then result[$name]="PASS"; else result[$name]="FAIL"; fi
  result[$name]+=" ($((SECONDS - t0)) s)"
  tail -n 25 "$out/$name.log"
}

native() {
  cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" &&
    cmake --build build-native && ctest --test-dir build-native --output-on-failure
}

run_all() {  # dir: every executable in it must exit 0
  local rc=0 f
  for f in "$1"/*; do
    [ -x "$f" ] || continue
    echo "--- $f"
    "$f" || { echo "FAILED: $f"; rc=1; }
  done
  return $rc
}

sanitize() {  # needs build-native (the native step); each run gets SANITIZE_TIMEOUT seconds
  local rc=0 tool bin name
  [ -x build-native/ffi_tests/test_gpu ] || native || return 1
  # The native build and the carried compute_52-PTX one (the M40's code path, JIT-compiled).
  local bins=(build-native/ffi_tests/test_gpu)
  if [ -x .gpu-carry/ptx52/test_gpu ]; then bins+=(.gpu-carry/ptx52/test_gpu)
  else echo "no .gpu-carry/ptx52/test_gpu (scripts/build_carry.sh): the PTX build is NOT sanitized"; rc=1; fi
  # racecheck reports races after barriers of pairs of warps where there are none (the probe,
  # race-free, is flagged by the CUDA 13.0 tool): where it does, the hazards of the kernels
  # with such barriers are counted but not judged (scripts/racecheck/hazards.py).
  local unjudged=() probe
  probe=$(mktemp -d)/pair_barrier_probe
  if nvcc -O3 -arch=native -o "$probe" scripts/racecheck/pair_barrier_probe.cu \
      >"$out/racecheck-probe.txt" 2>&1; then
    compute-sanitizer --tool racecheck "$probe" >>"$out/racecheck-probe.txt" 2>&1
    if ! python3 scripts/racecheck/hazards.py "$out/racecheck-probe.txt" >/dev/null; then
      echo "racecheck flags the race-free pair-barrier probe: split-dims kernels not judged"
      unjudged=(--pair-barriers-unjudged)
    fi
  else
    echo "the pair-barrier probe did not build"; rc=1
  fi
  # The error-path tests make cudaMalloc fail on purpose: API errors are not reported. The
  # device-fault test is skipped (M40LLM_TEST_NO_FAULT=1): its fault is on purpose too.
  # racecheck counts warnings too: any judged hazard fails the step.
  for bin in "${bins[@]}"; do
    name=$(basename "$(dirname "$(dirname "$bin")")")  # build-native or .gpu-carry
    for tool in memcheck racecheck; do
      echo "--- compute-sanitizer --tool $tool $bin"
      # racecheck: hazards.py judges the whole report (every hazard printed); the tests' own
      # exit code stays the run's
      local opts=(--error-exitcode 1)
      [ $tool = racecheck ] && opts=(--print-limit 1000000)
      M40LLM_TEST_SMALL=1 M40LLM_TEST_NO_FAULT=1 timeout "${SANITIZE_TIMEOUT:-300}" \
        compute-sanitizer --tool "$tool" --report-api-errors no "${opts[@]}" "$bin" \
        >"$out/$tool-$name.txt" 2>&1 || rc=1
      tail -n 3 "$out/$tool-$name.txt"
      if [ $tool = racecheck ]; then
        python3 scripts/racecheck/hazards.py "$out/$tool-$name.txt" ${unjudged[@]+"${unjudged[@]}"} ||
          rc=1
      fi
    done
  done
  return $rc
}

append_bench() {  # needs build-native (the native step)
  [ -x build-native/bench/bench_append ] || native || return 1
  build-native/bench/bench_append "$out/append_native.json" &&
    .gpu-carry/bench52/bench_append "$out/append_ptx52.json"
}

formats() {  # needs build-native (the native step)
  [ -x build-native/bench/bench_attention ] || native || return 1
  bash bench/formats.sh build-native/bench/bench_attention "$out/formats_native" &&
    bash bench/formats.sh .gpu-carry/bench52/bench_attention "$out/formats_ptx52"
}

causal() {  # builds only its targets in build-native (the native step builds them too)
  local rc=0 bin
  cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" &&
    cmake --build build-native --target test_gpu bench_causal || return 1
  for bin in build-native/ffi_tests/test_gpu .gpu-carry/ptx52/test_gpu; do
    echo "--- $bin"
    "$bin" || rc=1
  done
  build-native/bench/bench_causal "$out/causal_native.json" || rc=1
  .gpu-carry/bench52/bench_causal "$out/causal_ptx52.json" || rc=1
  python3 bench/sdpa_causal.py "$out/causal_sdpa.json" --m40llm "$out/causal_native.json" || rc=1
  return $rc
}

decode_step() {  # builds only decode_loop in build-native (the native step builds it too)
  local rc=0 bin seqs ctx
  cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" &&
    cmake --build build-native --target decode_loop || return 1
  for bin in build-native/examples/decode_loop .gpu-carry/ptx52/decode_loop; do
    for seqs in 8 64; do
      for ctx in 1024 8192; do
        echo "--- $bin: $seqs sequences, context $ctx"
        "$bin" "${STEP_STEPS:-32}" cuda --layers 32 --seqs "$seqs" --heads 32 --kv-heads 8 \
          --head-dim 128 --context "$ctx" --no-prefill-attention || rc=1
      done
    done
  done
  return $rc
}

# bench/ab.sh on the M40 path: the previous main's compute_52 bench_attention (.ab/bins/base)
# against this tree's (.gpu-carry/bench52), AB_ROUNDS rounds (2).
#   ab_m40 OUTDIR [bench_attention args]
ab_m40() {
  local dir=$1; shift
  mkdir -p /tmp/ab52_bins/base /tmp/ab52_bins/new &&
    cp .ab/bins/base/bench_attention /tmp/ab52_bins/base/ &&
    cp .gpu-carry/bench52/bench_attention /tmp/ab52_bins/new/ &&
    AB_BINS=/tmp/ab52_bins AB_BUILD=/tmp/m40llm-ab52 bash bench/ab.sh .ab/base "$dir" \
      "${AB_ROUNDS:-2}" ${1:+--} "$@"
}

ab_native() {  # dir, bench_attention args: the previous main (.ab/base) and this tree, built here
  local dir=$1; shift
  bash bench/ab.sh .ab/base "$dir" "${AB_ROUNDS:-2}" ${1:+--} "$@"
}

ab() {
  local rc=0
  ab_native /tmp/ab_native || rc=1
  ab_m40 /tmp/ab_ptx52 || rc=1
  tar czf "$out/ab.tgz" -C /tmp ab_native ab_ptx52
  return $rc
}

m40_proxy() {
  local base=()
  [ -x .ab/bins/base/bench_attention ] && base=(--base .ab/bins/base/bench_attention)
  python3 bench/m40_proxy.py "$out/m40" --bin .gpu-carry/bench52/bench_attention "${base[@]}" \
    --rounds "${M40_ROUNDS:-2}" --work /tmp/m40_proxy
}

ab_causal_native() {
  local base=/tmp/m40llm-ab-native
  cmake -S .ab/base -B "$base" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DM40LLM_BUILD_BENCH=ON -DM40LLM_BUILD_TESTS=OFF \
    -DM40LLM_BUILD_EXAMPLES=OFF && cmake --build "$base" --target bench_causal &&
    cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" && cmake --build build-native --target bench_causal ||
    return 1
  python3 bench/ab_causal.py "$out/abcausalnative" --base "$base/bench/bench_causal" \
    --new build-native/bench/bench_causal --rounds "${AB_ROUNDS:-2}"
}

ab_causal() {
  python3 bench/ab_causal.py "$out/abcausal" --base .ab/bins/base/bench_causal \
    --new .gpu-carry/bench52/bench_causal --rounds "${AB_ROUNDS:-2}"
}

ab_formats() {  # runner (ab_m40 or ab_native), results' folder under $OUT
  local run=$1 dest=$2 rc=0 spec shapes=() FORMAT_SHAPES
  source bench/formats_shapes.sh
  # shellcheck disable=SC2206  # AB_EXTRA_SHAPES: more B,H,Hkv,D,L shapes, space-separated
  FORMAT_SHAPES+=(${AB_EXTRA_SHAPES:-})
  for spec in "${FORMAT_SHAPES[@]}"; do shapes+=(--shape "$spec"); done
  local specs=(F16 Q8 Q4 Q8Q4 "Q8 --kv-rotation none --kv-protect 0,0"
               "Q4 --kv-rotation none --kv-protect 0,0")
  # AB_FORMATS: other format specs, ';'-separated (e.g. "Q4Q3;Q4Q2")
  [ -n "${AB_FORMATS:-}" ] && IFS=';' read -r -a specs <<<"$AB_FORMATS"
  for spec in "${specs[@]}"; do
    local name=${spec%% *}
    [ "$name" != "$spec" ] && name+=-plain
    # shellcheck disable=SC2086  # spec is a format and its options
    "$run" "$out/$dest/$name" --format $spec "${shapes[@]}" || rc=1
  done
  return $rc
}

weights_cost() {  # mode (weights or importance); needs build-native (the native step)
  [ -x build-native/bench/bench_attention ] || native || return 1
  local tiers=(--tiers Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25)
  python3 bench/weights_cost.py "$out/$1_native" --mode "$1" "${tiers[@]}" \
    --bin build-native/bench/bench_attention &&
    python3 bench/weights_cost.py "$out/$1_ptx52" --mode "$1" "${tiers[@]}" \
      --bin .gpu-carry/bench52/bench_attention
}

ab_export() {
  local rc=0 fmt mode shapes=()
  for s in $(python3 bench/weights_cost.py --list-shapes); do shapes+=(--shape "$s"); done
  for fmt in ${EXPORT_FORMATS:-F16 Q4}; do
    for mode in weights importance; do
      ab_m40 "$out/abexport/$fmt-$mode" --format "$fmt" "--$mode" "${shapes[@]}" || rc=1
    done
  done
  return $rc
}

ab_tiers() {
  local rc=0 name mix shapes=()
  for s in $(bash bench/tiers.sh --shapes); do shapes+=(--shape "$s"); done
  while read -r name mix; do
    ab_m40 "$out/abtiers/$name" --tiers "$mix" "${shapes[@]}" || rc=1
  done < <(bash bench/tiers.sh --mixes)
  return $rc
}

tiers_bench() {  # needs build-native (the native step)
  [ -x build-native/bench/bench_attention ] || native || return 1
  bash bench/tiers.sh build-native/bench/bench_attention "$out/tiers_native" &&
    bash bench/tiers.sh .gpu-carry/bench52/bench_attention "$out/tiers_ptx52"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
for s in $steps; do
  case $s in
    native) run_step native native ;;
    ptx52) run_step ptx52 run_all .gpu-carry/ptx52 ;;
    rust) run_step rust bash .gpu-carry/rust/run_all.sh ;;
    sanitize) run_step sanitize sanitize ;;
    bench) run_step bench bash bench/run_gpu.sh "$out" ;;
    append) run_step append append_bench ;;
    formats) run_step formats formats ;;
    causal) run_step causal causal ;;
    step) run_step step decode_step ;;
    ab) run_step ab ab ;;
    m40) run_step m40 m40_proxy ;;
    abcausal) run_step abcausal ab_causal ;;
    abcausalnative) run_step abcausalnative ab_causal_native ;;
    abformats) run_step abformats ab_formats ab_m40 abformats ;;
    abformatsnative) run_step abformatsnative ab_formats ab_native abformats_native ;;
    weights) run_step weights weights_cost weights ;;
    importance) run_step importance weights_cost importance ;;
    tiers) run_step tiers tiers_bench ;;
    abexport) run_step abexport ab_export ;;
    abtiers) run_step abtiers ab_tiers ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
echo "=== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1))"
fail=0
for s in $steps; do
  echo "$s: ${result[$s]}"
  case ${result[$s]} in PASS*) ;; *) fail=1 ;; esac
done
exit $fail
