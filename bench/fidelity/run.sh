#!/usr/bin/env bash
# The one command: fetch the model (cached), run the fidelity harness, write results/.
#   bash bench/fidelity/run.sh                      # 2048 tokens, every format
#   LONG=1 bash bench/fidelity/run.sh               # plus 8192 tokens (reduced format set)
#   LIBRARY=/tmp/m40so/libm40llm.so bash bench/fidelity/run.sh   # plus the library's CPU path
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
GGUF="$(bash "$HERE/fetch_model.sh")"
LIBARGS=()
if [ -n "${LIBRARY:-}" ]; then LIBARGS=(--library "$LIBRARY"); fi
python3 "$HERE/fidelity.py" --gguf "$GGUF" --tokens 2048 "${LIBARGS[@]}" "$@"
if [ -n "${LONG:-}" ]; then
  python3 "$HERE/fidelity.py" --gguf "$GGUF" --tokens 8192 --specs quick --no-synthetic "$@"
fi
