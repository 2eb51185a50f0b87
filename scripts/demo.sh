#!/usr/bin/env bash
# Builds the library and runs the decode-loop example (GPU if present, else the CPU backend).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cmake -S "$root" -B "$root/build-demo" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$root/build-demo" --target decode_loop
"$root/build-demo/examples/decode_loop" "$@"
