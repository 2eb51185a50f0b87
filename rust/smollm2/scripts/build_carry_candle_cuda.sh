#!/usr/bin/env bash
# On this machine (Rust, CUDA 11.8, no GPU): builds the candle interop's GPU test
# (tests/candle_interop_gpu.rs: candle's CUDA device, m40llm's candle-cuda feature) for a GPU
# machine without Rust, into .gpu-carry-candle/ (~50 MB: carry it in one call):
#   candle_interop_gpu.test  the test binary, stripped (debug profile: candle's release build
#                            with CUDA costs another ~10 minutes here)
#   libcublas.so.11          a shim: candle's cudarc links cuBLAS of this toolkit (11.8), and
#                            the test calls three of its functions (handle create/destroy/set
#                            stream, when candle opens the device); the shim forwards them to
#                            the GPU machine's libcublas.so.13 or .12
#   run.sh                   runs it there (exit 0 and "N passed, 0 failed" is a pass)
# candle's kernels are built as compute_80 PTX (CUDA_COMPUTE_CAP=80; 11.8 cannot build 90,
# whose PTX target is compute_90a), which the H100's driver JIT-compiles; m40llm's code is
# M40LLM_CUDA_ARCHS, default sm_90 (compute_52: the M40's path).
# Usage: rust/smollm2/scripts/build_carry_candle_cuda.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)   # rust/smollm2
root=$(cd "$here/../.." && pwd)
carry=$root/.gpu-carry-candle
rm -rf "$carry" && mkdir -p "$carry"

cd "$here"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}
export M40LLM_CUDA_ARCHS=${M40LLM_CUDA_ARCHS:-sm_90}
exe=$(cargo test --locked --features cuda --test candle_interop_gpu --no-run \
  --target-dir target/cuda --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])')
cp "$exe" "$carry/candle_interop_gpu.test"
strip "$carry/candle_interop_gpu.test"

# The shim forwards exactly the cuBLAS functions the binary imports; each takes at most two
# pointer-sized arguments and returns cublasStatus_t, so one forwarder shape fits them all.
known="cublasCreate_v2 cublasDestroy_v2 cublasSetStream_v2"
syms=$(objdump -T "$carry/candle_interop_gpu.test" | awk '/\(libcublas\.so\.11\)/ {print $NF}' | sort -u)
for s in $syms; do
  case " $known " in *" $s "*) ;; *) echo "build_carry: the binary imports $s from cuBLAS: extend the shim" >&2; exit 1 ;; esac
done
if objdump -T "$carry/candle_interop_gpu.test" | grep -q '(libcublasLt'; then
  echo "build_carry: the binary imports cublasLt: extend the shim" >&2; exit 1
fi
{
  echo '#include <dlfcn.h>'
  echo 'static void *lib(void) {'
  echo '  static void *h;'
  echo '  const char *names[] = {"libcublas.so.13", "libcublas.so.12", "/usr/local/cuda/lib64/libcublas.so.13", "/usr/local/cuda/lib64/libcublas.so.12"};'
  echo '  for (unsigned i = 0; !h && i < sizeof names / sizeof *names; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);'
  echo '  return h;'
  echo '}'
  echo 'typedef int (*fn2)(void *, void *);'
  for s in $syms; do
    echo "int $s(void *a, void *b) {"
    echo "  void *h = lib(); fn2 f = h ? (fn2)dlsym(h, \"$s\") : 0;"
    echo "  return f ? f(a, b) : 3; /* CUBLAS_STATUS_ALLOC_FAILED */"
    echo '}'
  done
} > "$carry/shim.c"
printf 'libcublas.so.11 { global: %s; local: *; };\n' "$(echo $syms | sed 's/ /; /g')" > "$carry/shim.map"
cc -shared -fPIC -O2 -o "$carry/libcublas.so.11" -Wl,-soname,libcublas.so.11 \
  -Wl,--version-script="$carry/shim.map" "$carry/shim.c" -ldl
rm "$carry/shim.c" "$carry/shim.map"

cat > "$carry/run.sh" <<'RUN'
#!/usr/bin/env bash
# On the GPU machine: the candle interop's checks on candle's CUDA device 0. Needs the driver,
# and libcurand.so.10 and libcublas.so.13 (or .12) of the machine's CUDA toolkit.
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$dir:${CUDA_PATH:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi -L
M40LLM_REQUIRE_GPU=1 "$dir/candle_interop_gpu.test"
RUN
chmod +x "$carry/run.sh"
du -sh "$carry"
