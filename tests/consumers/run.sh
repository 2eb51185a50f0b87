#!/usr/bin/env bash
# Builds and runs the consumer projects: m40llm used from scratch in each way the README documents.
# Each program runs a CPU-backend check (check.c; no GPU needed) and exits non-zero on failure.
#   1. add_subdirectory: a C-only project builds m40llm as a subproject (subdirectory/).
#   2. find_package(m40llm CONFIG) from a `cmake --install` prefix, with the static archive: a
#      program, and a shared object (MODULE) that links the archive, dlopen()ed by a program
#      (find_package/).
#   3. pkg-config: `cc main.c check.c $(pkg-config --cflags --libs --static m40llm)`.
#   4. BUILD_SHARED_LIBS=ON: libm40llm.so exports only m40llm_*, carries the CUDA runtime inside,
#      and is used through find_package and plain `pkg-config --libs`.
# Usage: tests/consumers/run.sh [BUILD_DIR]
#   BUILD_DIR: a built top-level m40llm build (scripts/test.sh passes build-cuda, the CUDA build)
#   whose install routes 2 and 3 use, so the CUDA archive's link line is what they prove. Without
#   it a library is built here (compute_52 PTX only when nvcc is found). Work goes to
#   build-consumers/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=$root/build-consumers
jobs=$(nproc 2>/dev/null || echo 2)
cc=${CC:-cc}
log() { printf 'consumers: %s\n' "$*"; }
die() { printf 'consumers: FAIL: %s\n' "$*" >&2; exit 1; }

# cuda/ uses no C++ runtime: the add_subdirectory route is built with CUDA, and the CUDA archive
# must need no -lstdc++.
c_only_archive=1

rm -rf "$work"
mkdir -p "$work"
have_nvcc=0
for c in "${CUDACXX:-}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" \
         /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null || true)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then have_nvcc=1; break; fi
done
# The cheapest architecture, compute_52 PTX (no ptxas: a quarter less compile time than sm_52
# SASS): the link is the point.
cuda_flags=(-DCMAKE_CUDA_ARCHITECTURES=52-virtual)
[ "$have_nvcc" = 1 ] || cuda_flags=(-DM40LLM_ENABLE_CUDA=OFF)
lib_only=(-DM40LLM_BUILD_TESTS=OFF -DM40LLM_BUILD_EXAMPLES=OFF -DM40LLM_BUILD_BENCH=OFF)

# Installs a build into $2 through a staging prefix that is then moved: the installed CMake
# package and m40llm.pc must be relocatable.
install_moved() {
  cmake --install "$1" --prefix "$work/stage" >/dev/null
  mv "$work/stage" "$2"
}
built_with_cuda() { grep -q 'set(m40llm_WITH_CUDA ON)' "$1"/lib*/cmake/m40llm/m40llmConfig.cmake; }

# --- the static library (the given build, else one built here) ------------------------------------
build=${1:-}
if [ -z "$build" ]; then
  build=$work/lib-static
  log "building the static library (${cuda_flags[*]})"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${lib_only[@]}" \
    "${cuda_flags[@]}" >/dev/null
  cmake --build "$build" -j "$jobs" >/dev/null
fi
install_moved "$build" "$work/prefix-static"
static=$work/prefix-static
expect=0
built_with_cuda "$static" && expect=1
log "static prefix: $(cd "$static" && find . -type f | sort | tr '\n' ' ')"
deps=$(sed -n 's/^set(M40LLM_CXX_RUNTIME_LIBS "\(.*\)")$/\1/p' "$static"/lib*/cmake/m40llm/m40llmLinkDeps.cmake)
log "built_with_cuda=$expect, C++ runtime needed by the archive: '${deps}'"
if [ "$c_only_archive" = 1 ] && [ -n "$deps" ]; then
  die "the archive needs the C++ runtime ($deps): it must be C-only"
fi

# --- 1. add_subdirectory from a C-only project ---------------------------------------------------
sub_flags=(-DM40LLM_ENABLE_CUDA=OFF)
sub_expect=0
if [ "$c_only_archive" = 1 ] && [ "$have_nvcc" = 1 ]; then sub_flags=("${cuda_flags[@]}"); sub_expect=1; fi
log "1. add_subdirectory (${sub_flags[*]})"
cmake -S "$here/subdirectory" -B "$work/subdirectory" -G Ninja -DM40LLM_SOURCE_DIR="$root" \
  -DEXPECT_CUDA=$sub_expect "${sub_flags[@]}" >/dev/null
cmake --build "$work/subdirectory" -j "$jobs" >/dev/null
"$work/subdirectory/app"

# --- 2. find_package from the installed prefix; a shared object linking the static archive ------
log "2. find_package(m40llm CONFIG), static archive, program and shared object"
cmake -S "$here/find_package" -B "$work/find_package" -G Ninja -DCMAKE_PREFIX_PATH="$static" \
  -DEXPECT_CUDA=$expect >/dev/null
cmake --build "$work/find_package" -j "$jobs" >/dev/null
"$work/find_package/app"
"$work/find_package/plugin_main" "$work/find_package/consumer_plugin.so"

# --- 3. pkg-config, plain compiler ---------------------------------------------------------------
log "3. pkg-config --static"
export PKG_CONFIG_PATH="$static/lib/pkgconfig"
[ "$(pkg-config --modversion m40llm)" = 0.1.0 ] || die "pkg-config --modversion m40llm"
flags=$(pkg-config --cflags --libs --static m40llm)
log "   $cc main.c check.c $flags"
# shellcheck disable=SC2086  # the flags are words
"$cc" -std=c11 -Wall -Werror -DEXPECT_CUDA=$expect -o "$work/pkgconfig_app" \
  "$here/main.c" "$here/check.c" $flags
"$work/pkgconfig_app"

# --- 4. BUILD_SHARED_LIBS=ON ------------------------------------------------------------------
log "4. BUILD_SHARED_LIBS=ON (${cuda_flags[*]})"
cmake -S "$root" -B "$work/lib-shared" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DM40LLM_INSTALL=ON "${lib_only[@]}" "${cuda_flags[@]}" >/dev/null
cmake --build "$work/lib-shared" -j "$jobs" >/dev/null
install_moved "$work/lib-shared" "$work/prefix-shared"
shared=$work/prefix-shared
so=$(ls "$shared"/lib*/libm40llm.so)
sexpect=0
built_with_cuda "$shared" && sexpect=1
others=$(nm -D --defined-only "$so" | awk '$3 !~ /^m40llm_/ {print $3}')
[ -z "$others" ] || die "libm40llm.so exports more than m40llm_*: $others"
if readelf -d "$so" | grep -q 'NEEDED.*libcudart'; then die "libm40llm.so needs libcudart.so"; fi
cmake -S "$here/find_package" -B "$work/find_package_shared" -G Ninja \
  -DCMAKE_PREFIX_PATH="$shared" -DEXPECT_CUDA=$sexpect >/dev/null
cmake --build "$work/find_package_shared" -j "$jobs" >/dev/null
"$work/find_package_shared/app"
export PKG_CONFIG_PATH="$shared/lib/pkgconfig"
flags=$(pkg-config --cflags --libs m40llm)
# shellcheck disable=SC2086
"$cc" -std=c11 -Wall -Werror -DEXPECT_CUDA=$sexpect -o "$work/pkgconfig_shared_app" \
  "$here/main.c" "$here/check.c" $flags -lm -Wl,-rpath,"$(dirname "$so")"
"$work/pkgconfig_shared_app"
log "all routes passed"
