#!/usr/bin/env bash
# The one command: fetch the model (cached), run the fidelity harness, write results/.
#   bash bench/fidelity/run.sh                      # 2048 tokens, every format (numpy reference)
#   LIBRARY=/tmp/m40so/libm40llm.so bash bench/fidelity/run.sh   # plus the library's CPU path
#                                                   # (every format it has, end to end: slow)
#   LONG=1 bash bench/fidelity/run.sh               # plus 8192 tokens (reduced format set; with
#                                                   # LIBRARY, LONG_LIB_SPECS through the library)
# Extra arguments go to both fidelity.py runs (e.g. --lib-specs 'Q8 +rot +prot;Q4 +rot +prot').
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
GGUF="$(bash "$HERE/fetch_model.sh")"
LIBARGS=()
if [ -n "${LIBRARY:-}" ]; then LIBARGS=(--library "$LIBRARY"); fi
if [ -z "${SKIP_2K:-}" ]; then
  python3 "$HERE/fidelity.py" --gguf "$GGUF" --tokens 2048 "${LIBARGS[@]}" "$@"
fi
if [ -n "${LONG:-}" ]; then
  LONGLIB=()
  if [ -n "${LIBRARY:-}" ]; then
    LONGLIB=(--library "$LIBRARY" --lib-specs "${LONG_LIB_SPECS:-Q8 +rot +prot;Q4 +rot +prot}")
  fi
  python3 "$HERE/fidelity.py" --gguf "$GGUF" --tokens 8192 --specs quick --no-synthetic \
    "${LONGLIB[@]}" "$@"
fi
