#!/usr/bin/env bash
# On this machine (Rust, CUDA 11.8, no GPU): builds the SmolLM2 example and its tiny-model test
# with m40llm's CUDA backend, for a GPU machine without Rust, and splits the model there too:
#   .gpu-carry-smollm2/  smollm2, tiny_model.test (stripped) and run.sh
#   .gpu-model/          the GGUF in two parts (the device tool carries 64 MiB a call; the
#                        model is 94 MiB): part0 travels in one call, part1 in the next
# m40llm's GPU code: M40LLM_CUDA_ARCHS, default sm_90 (the H100's native code and tensor
# cores; cargo's default list would triple the binaries); compute_52 builds the M40's path.
# candle runs on the CPU (its `cuda` feature is not built here: see README.md).
# Usage: rust/smollm2/scripts/build_carry.sh [GGUF]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)   # rust/smollm2
root=$(cd "$here/../.." && pwd)
gguf=${1:-${M40LLM_CACHE:-$HOME/.cache/m40llm}/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -s "$gguf" ] || { echo "build_carry: no $gguf (bench/fidelity/fetch_model.sh)" >&2; exit 1; }
carry=$root/.gpu-carry-smollm2
models=$root/.gpu-model
rm -rf "$carry" "$models" && mkdir -p "$carry" "$models"

cd "$here"
export M40LLM_CUDA_ARCHS=${M40LLM_CUDA_ARCHS:-sm_90}
json=$(mktemp)
trap 'rm -f "$json"' EXIT
cargo build --release --locked --features m40llm/cuda --message-format=json > "$json"
cargo test --release --locked --features m40llm/cuda --test tiny_model --no-run \
  --message-format=json >> "$json"
python3 - "$json" "$carry" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name = m["target"]["name"] + (".test" if m["profile"]["test"] else "")
    if name in ("smollm2", "tiny_model.test"):
        shutil.copy(m["executable"], f"{sys.argv[2]}/{name}")
PY
strip "$carry/smollm2" "$carry/tiny_model.test"
split -n 2 -d -a 1 "$gguf" "$models/part"
sha256sum "$gguf" | cut -d' ' -f1 > "$carry/gguf.sha256"

cat > "$carry/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine, from the repository root, once .gpu-model/part0 and part1 are both there:
# joins the model, runs the tiny-model test on the GPU, then the example on the CUDA backend
# with each K/V format. Output (and the logs) in $OUT.
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gpu-out}; mkdir -p "$out"
model=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
for p in .gpu-model/part0 .gpu-model/part1; do
  [ -s "$p" ] || { echo "missing $p: carry part0 in one call and part1 in the next, 30 s apart at most"; exit 1; }
done
cat .gpu-model/part0 .gpu-model/part1 > "$model"
[ "$(sha256sum "$model" | cut -d' ' -f1)" = "$(cat "$dir/gguf.sha256")" ] || { echo "model checksum mismatch"; exit 1; }
nvidia-smi -L
rc=0
echo "=== tiny_model (m40llm on the GPU vs candle)"
"$dir/tiny_model.test" --nocapture --test-threads 1 2>&1 | grep -v '^step' | tee "$out/smollm2_tiny.log" || rc=1
for args in "--format f16" "--format q8" "--format q4" "--format q4 --sinks 0 --window 0" "--format q8 --sinks 0 --window 0"; do
  echo "=== smollm2 --backend cuda $args"
  "$dir/smollm2" "$model" --backend cuda $args --quiet 2>&1 | tee -a "$out/smollm2.log" || rc=1
done
echo "=== smollm2: $([ $rc = 0 ] && echo PASS || echo FAIL)"
exit $rc
RUN
chmod +x "$carry/run.sh"
du -sh "$carry" "$models"/*
