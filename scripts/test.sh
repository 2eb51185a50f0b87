#!/usr/bin/env bash
# Builds m40llm every way CI checks it and runs every test that this machine can run.
# GPU tests report a skip (ctest exit 77) on a machine without a GPU; set M40LLM_REQUIRE_GPU=1
# to make that a failure. Run scripts/setup.sh first on a fresh machine.
#   scripts/test.sh          all steps
#   scripts/test.sh c        the C/CUDA builds and the consumer projects only
#   scripts/test.sh rust     the Rust workspace (and the rust/smollm2 example) only
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
what=${1:-all}
jobs=$(nproc 2>/dev/null || echo 2)

configure_build_test() {  # name, cmake args...
  local name=$1; shift
  echo "== $name"
  cmake -S "$root" -B "$root/build-$name" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
  cmake --build "$root/build-$name" -j "$jobs"
  ctest --test-dir "$root/build-$name" --output-on-failure -j "$jobs"
}

if [ "$what" = all ] || [ "$what" = c ]; then
  # The M40 (sm_52 SASS + compute_52 PTX) and Hopper (sm_90) in one fat binary: needs CUDA 11.8.
  # The Rust tests below link this library.
  configure_build_test cuda -DCMAKE_CUDA_ARCHITECTURES="52-real;52-virtual;90-real"
  # m40llm as users take it (add_subdirectory, find_package, pkg-config, a shared object,
  # BUILD_SHARED_LIBS), each from scratch; the installed routes use the CUDA build above.
  echo "== consumers"
  bash "$root/tests/consumers/run.sh" "$root/build-cuda"
  # The tensor-core switch off: the library alone, sm_90 (where it would otherwise have them).
  echo "== cuda-no-tensor-cores"
  cmake -S "$root" -B "$root/build-notc" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90-real -DM40LLM_TENSOR_CORES=OFF >/dev/null
  cmake --build "$root/build-notc" -j "$jobs" --target m40llm
  configure_build_test cpu -DM40LLM_ENABLE_CUDA=OFF
  configure_build_test asan -DM40LLM_ENABLE_CUDA=OFF -DM40LLM_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
  # How gpu_check.sh's sanitize step reads racecheck's reports (the reading only: no GPU).
  echo "== racecheck reports"
  python3 "$root/scripts/racecheck/test_hazards.py"
  # The CPU API as call sequences against a model, libFuzzer + ASan + UBSan, FUZZ_SECONDS (60).
  echo "== fuzz"
  bash "$root/scripts/fuzz.sh"
fi

if [ "$what" = all ] || [ "$what" = rust ]; then
  echo "== rust"
  cd "$root/rust"
  cargo fmt --all -- --check
  # clippy and doc link nothing and no Rust code depends on how the native library was built:
  # they take the CPU-only build (seconds) instead of compiling the CUDA kernels again (each
  # cargo mode has its own build-script output, and the CUDA build takes minutes).
  export M40LLM_NO_CUDA=1
  cargo clippy --workspace --all-targets -- -D warnings
  # The interop features in one clippy and one doc run (candle's CPU side is only checked
  # here, not built: its tests run in rust/smollm2, which builds candle anyway; candle-cuda
  # needs candle's kernels built with nvcc and is left to the GPU build, see smollm2/README.md).
  cargo clippy --workspace --all-targets --features m40llm/cudarc,m40llm/candle -- -D warnings
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --features m40llm/cudarc,m40llm/candle
  unset M40LLM_NO_CUDA
  bash scripts/regen_bindings.sh --check
  # The packaged crate's own CUDA build: compute_52 PTX and sm_80 SASS (the tensor-core kernels
  # through build.rs's flags; nothing else here compiles sm_80).
  M40LLM_CUDA_ARCHS=${M40LLM_CUDA_ARCHS:-compute_52,sm_80} bash scripts/check_package.sh
  # The declared MSRV, proved with the committed lockfile (rustup installs the toolchain once,
  # ~20 s). Without rustup the check cannot run: say so.
  msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' m40llm/Cargo.toml)
  [ "$msrv" = "$(sed -n 's/^rust-version = "\(.*\)"/\1/p' m40llm-sys/Cargo.toml)" ] \
    || { echo "test.sh: the crates declare different rust-version" >&2; exit 1; }
  if command -v rustup >/dev/null; then
    echo "== rust MSRV $msrv"
    toolchain=$msrv
    case "$msrv" in *.*.*) ;; *) toolchain=$msrv.0 ;; esac   # 1.81 means 1.81.0
    rustup toolchain list | grep -q "^$toolchain-" \
      || rustup toolchain install "$toolchain" --profile minimal --no-self-update >/dev/null
    M40LLM_NO_CUDA=1 cargo "+$toolchain" check --workspace --all-targets --locked \
      --target-dir target/msrv
  else
    echo "test.sh: no rustup: the MSRV ($msrv) check is NOT run" >&2
  fi
  # The tests link the library the cuda step built (M40LLM_LIB_DIR) where this run built it:
  # compiling the same kernels again in build.rs took about 10 minutes on 2 cores, and
  # check_package.sh above runs build.rs's CUDA compile. Run alone (`test.sh rust`), build.rs
  # compiles the kernels, for M40LLM_CUDA_ARCHS (default 52 here: the tests run on the CPU
  # backend or skip without a GPU).
  lib_env=(M40LLM_CUDA_ARCHS="${M40LLM_CUDA_ARCHS:-52}")
  if [ "$what" = all ]; then lib_env=(M40LLM_LIB_DIR="$root/build-cuda"); fi
  env "${lib_env[@]}" cargo test --workspace
  env "${lib_env[@]}" cargo test --workspace --features m40llm/cudarc
  # The SmolLM2 example (candle + m40llm) is a workspace of its own: candle's dependencies need
  # Rust 1.89 to build (the library's MSRV check above never builds them). Its tests use a tiny
  # random-weight model (the real-model test is #[ignore]d: no download in CI) and hold the
  # tests of m40llm's candle interop (candle_interop_gpu reports skips without the cuda feature).
  # Building candle twice (clippy, test) takes about 3 minutes on 2 cores, from cold.
  echo "== rust smollm2"
  # Its clippy takes the CPU-only library (as above); its tests link the CUDA one, as the
  # workspace's did: they run on the CPU backend or skip.
  (cd smollm2 && cargo fmt -- --check &&
    M40LLM_NO_CUDA=1 cargo clippy --all-targets --locked -- -D warnings &&
    env "${lib_env[@]}" cargo test --locked)
fi
echo "test.sh: all steps passed"
