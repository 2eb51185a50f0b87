#!/usr/bin/env bash
# On a machine with CUDA 11.8 (no GPU needed): builds the binaries that scripts/gpu_check.sh runs
# on the GPU machine but cannot build there (its CUDA 13 has no sm_52; it has no Rust):
#   .gpu-carry/ptx52/  C tests and example carrying only compute_52 PTX: the M40's code path,
#                      JIT-compiled by the driver on the newer GPU
#   .gpu-carry/rust/   the Rust test binaries (same compute_52 PTX)
#   .gpu-carry/bench52/bench_attention  the benchmark, same PTX (bench/formats.sh, bench/ab.sh)
#   .gpu-carry/bench52/bench_append     the append benchmark, same PTX (gpu_check.sh append)
#   .gpu-carry/bench52/bench_causal     the causal-attention benchmark (gpu_check.sh causal)
# Pass it to the device run as carry: [".gpu-carry"].
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
carry="$root/.gpu-carry"
rm -rf "$carry" && mkdir -p "$carry/ptx52" "$carry/rust" "$carry/bench52"
cmake -S "$root" -B "$root/build-ptx52" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES=52-virtual -DM40LLM_BUILD_BENCH=ON >/dev/null
cmake --build "$root/build-ptx52"
cp "$root/build-ptx52/bench/bench_attention" "$root/build-ptx52/bench/bench_append" \
  "$root/build-ptx52/bench/bench_causal" "$carry/bench52/"
for f in "$root"/build-ptx52/ffi_tests/test_* "$root/build-ptx52/examples/decode_loop"; do
  [ -x "$f" ] && [ -f "$f" ] && cp "$f" "$carry/ptx52/"
done
if [ "${SKIP_RUST:-0}" != 1 ]; then
  M40LLM_CUDA_ARCHS=compute_52 bash "$root/rust/scripts/build_gpu_tests.sh" "$carry/rust"
fi
du -sh "$carry"
