#!/usr/bin/env bash
# Builds the Rust test executables (and the decode_loop example) with the CUDA backend and copies
# them into one folder, with a run_all.sh, to run on a GPU machine that has no Rust toolchain.
# The CUDA runtime is linked statically: the GPU machine needs only the NVIDIA driver (and a
# glibc at least as new as this machine's).
#
# Usage: rust/scripts/build_gpu_tests.sh [OUT_DIR]     (default: rust/target/gpu-tests)
# Env:   M40LLM_CUDA_ARCHS  default "compute_52": PTX only, which any GPU from the M40 (sm_52) to
#                           the H100 JIT-compiles at load. Use e.g. "52,compute_52" for M40 SASS too.
#        CARGO_PROFILE      default "release" ("dev" for a debug build).
# Then:  copy OUT_DIR to the GPU machine and run OUT_DIR/run_all.sh there.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)   # rust/
out=${1:-"$here/target/gpu-tests"}
archs=${M40LLM_CUDA_ARCHS:-compute_52}
profile=${CARGO_PROFILE:-release}
log() { printf 'build_gpu_tests: %s\n' "$*"; }

cd "$here"
log "building tests (profile $profile, CUDA archs $archs)"
json=$(mktemp)
trap 'rm -f "$json"' EXIT
M40LLM_CUDA_ARCHS="$archs" cargo test --workspace --features m40llm/cuda,m40llm/cudarc --profile "$profile" \
  --no-run --message-format=json > "$json"

mkdir -p "$out"
rm -f "$out"/*.test "$out"/*.example
# One executable per line: "<kind> <name> <path>". jq if present, else python3.
if command -v jq >/dev/null 2>&1; then
  list=$(jq -r 'select(.reason == "compiler-artifact" and .executable != null)
    | "\(if .profile.test then "test" else "example" end) \(.target.name) \(.executable)"' "$json")
else
  list=$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        kind = "test" if m["profile"]["test"] else "example"
        print(kind, m["target"]["name"], m["executable"])' "$json")
fi
[ -n "$list" ] || { log "no executables found"; exit 1; }

n=0
while read -r kind name path; do
  # Target names are unique in this workspace (lib tests: m40llm, m40llm_sys).
  dest="$out/$name.$kind"
  cp "$path" "$dest"
  if readelf -d "$dest" 2>/dev/null | grep -q 'NEEDED.*libcudart'; then
    log "WARNING: $dest links libcudart dynamically"
  fi
  log "$kind $name -> $dest"
  n=$((n + 1))
done <<< "$list"

cat > "$out/run_all.sh" <<'EOF'
#!/usr/bin/env bash
# Runs every m40llm Rust test executable in this folder with M40LLM_REQUIRE_GPU=1 (a missing GPU
# fails instead of skipping), then the decode_loop example. Extra arguments go to every test
# executable (e.g. --nocapture, or a test name filter). Set M40LLM_TEST_SEED to replay a seed.
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
export M40LLM_REQUIRE_GPU=1 RUST_BACKTRACE=${RUST_BACKTRACE:-1}
command -v nvidia-smi >/dev/null && nvidia-smi -L
pass=() fail=()
for t in "$dir"/*.test; do
  name=$(basename "$t" .test)
  echo "=== $name"
  if "$t" "$@"; then pass+=("$name"); else fail+=("$name"); fi
done
for e in "$dir"/*.example; do
  [ -e "$e" ] || continue
  name=$(basename "$e" .example)
  echo "=== example $name"
  if "$e" --backend cuda; then pass+=("example:$name"); else fail+=("example:$name"); fi
done
echo "=== summary: ${#pass[@]} passed, ${#fail[@]} failed"
for p in "${pass[@]}"; do echo "PASS $p"; done
for f in "${fail[@]}"; do echo "FAIL $f"; done
[ "${#fail[@]}" -eq 0 ]
EOF
chmod +x "$out/run_all.sh"
log "$n executables + run_all.sh in $out ($(du -sh "$out" | cut -f1))"
