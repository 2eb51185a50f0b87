#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build and test m40llm:
# cmake, ninja, and a CUDA toolkit that can still target sm_52 (CUDA 11.8 from
# Debian's non-free component) with a host compiler it supports (g++-11).
# Idempotent: an existing toolkit (CUDACXX, CUDA_PATH/CUDA_HOME, /usr/local/cuda,
# nvcc on PATH) is used as is. Set M40LLM_SKIP_CUDA=1 for a CPU-only setup.
set -euo pipefail

log() { printf 'setup: %s\n' "$*"; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

find_nvcc() {
  local c
  for c in "${CUDACXX:-}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" \
           /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  return 1
}

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v python3 >/dev/null || need+=(python3)
# bindgen (only for the Rust stale-bindings check) needs libclang itself: libclang-cpp, which
# other packages pull in, is a different library that bindgen cannot load.
have_libclang() {
  [ -n "${LIBCLANG_PATH:-}" ] || compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null ||
    compgen -G '/usr/lib/*-linux-gnu/libclang-[0-9]*.so*' >/dev/null
}
have_libclang || need+=(libclang-dev)
# The fuzz target (scripts/fuzz.sh): clang with its libFuzzer and sanitizer runtimes.
command -v clang >/dev/null || need+=(clang)
compgen -G '/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a' >/dev/null ||
  need+=(libclang-rt-dev)

nvcc=""
if [ "${M40LLM_SKIP_CUDA:-0}" != 1 ]; then
  if nvcc=$(find_nvcc); then
    log "using CUDA toolkit at $nvcc ($("$nvcc" --version | tail -n 2 | head -n 1))"
  else
    . /etc/os-release
    if [ "${ID:-}" = debian ]; then
      # nvidia-cuda-toolkit lives in non-free; enable it (and contrib) once.
      if ! grep -rqsE '^(Components:.*non-free|deb .* non-free)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        if [ -f /etc/apt/sources.list.d/debian.sources ]; then
          log "enabling contrib and non-free in /etc/apt/sources.list.d/debian.sources"
          $SUDO sed -i -E 's/^Components: main$/Components: main contrib non-free non-free-firmware/' \
            /etc/apt/sources.list.d/debian.sources
        else
          log "enabling contrib and non-free in /etc/apt/sources.list"
          $SUDO sed -i -E 's/^(deb .* main)$/\1 contrib non-free non-free-firmware/' /etc/apt/sources.list
        fi
      fi
    elif [ "${ID:-}" = ubuntu ]; then
      $SUDO add-apt-repository -y multiverse >/dev/null 2>&1 || true
    fi
    need+=(nvidia-cuda-toolkit g++-11)
  fi
fi

if [ "${#need[@]}" -gt 0 ]; then
  log "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ "${M40LLM_SKIP_CUDA:-0}" != 1 ]; then
  nvcc=$(find_nvcc) || { log "no nvcc after install"; exit 1; }
  log "nvcc: $nvcc"
fi
if command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi
log "done"
