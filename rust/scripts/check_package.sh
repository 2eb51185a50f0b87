#!/usr/bin/env bash
# Verifies that both crates are ready for crates.io and that the packaged m40llm-sys crate is
# self-contained:
#   0. `cargo package --workspace` packages both crates and verifies them (each .crate built on its
#      own, m40llm against the packaged m40llm-sys, CPU-only), with no cargo warning; each .crate
#      holds README.md, LICENSE-MIT and LICENSE-APACHE, and its manifest the fields crates.io
#      needs (license, description, repository);
#   1. the m40llm-sys .crate is small (< 10 MB) and holds every file
#      of c/sources.txt, the header, sources.txt and the private headers, as regular files
#      (rust/m40llm-sys/c and rust/m40llm-sys/cuda are symlinks that cargo must follow);
#   2. the unpacked crate, copied outside the repository, builds and runs from a scratch crate
#      that depends on it by path: CPU-only (M40LLM_NO_CUDA=1) always, and with CUDA when nvcc
#      is available, for compute_52 PTX unless M40LLM_CUDA_ARCHS is set (M40LLM_CHECK_CUDA=0
#      skips that; =1 makes a missing nvcc an error); M40LLM_LIB_DIR is ignored: the packaged
#      sources are what is built;
#   3. those builds write nothing into the unpacked crate (only into OUT_DIR).
# Usage: rust/scripts/check_package.sh   (from anywhere; needs cargo and network for crates.io)
set -euo pipefail
unset M40LLM_LIB_DIR

here=$(cd "$(dirname "$0")/.." && pwd)   # rust/
repo=$(cd "$here/.." && pwd)
log() { printf 'check_package: %s\n' "$*"; }
die() { printf 'check_package: FAIL: %s\n' "$*" >&2; exit 1; }

work=$(mktemp -d /tmp/m40llm-pkg.XXXXXX)
trap 'rm -rf "$work"' EXIT

cd "$here"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' m40llm-sys/Cargo.toml | head -n 1)
log "packaging and verifying the workspace (m40llm-sys, m40llm $version; CPU-only)"
pkg_out=$(M40LLM_NO_CUDA=1 cargo package --workspace --allow-dirty --target-dir "$work/target" 2>&1) \
  || die "cargo package --workspace failed:"$'\n'"$pkg_out"
if printf '%s\n' "$pkg_out" | grep -q '^warning'; then
  die "cargo package warns:"$'\n'"$(printf '%s\n' "$pkg_out" | grep -A3 '^warning')"
fi
for name in m40llm-sys m40llm; do
  c="$work/target/package/$name-$version.crate"
  [ -f "$c" ] || die "no $c"
  files=$(tar tzf "$c")
  for f in README.md LICENSE-MIT LICENSE-APACHE; do
    printf '%s\n' "$files" | grep -qx "$name-$version/$f" || die "$name: $f missing from the crate"
  done
  manifest=$(tar xzf "$c" -O "$name-$version/Cargo.toml")
  for key in license description repository rust-version; do
    printf '%s\n' "$manifest" | grep -q "^$key = " || die "$name: no $key in the packaged manifest"
  done
done
log "both crates packaged and verified, licenses and manifest fields present"
crate="$work/target/package/m40llm-sys-$version.crate"
size=$(stat -c %s "$crate")
log "crate size: $size bytes"
[ "$size" -lt $((10 * 1024 * 1024)) ] || die "crate is $size bytes (limit 10 MB)"

# Every listed source, the header and the private headers must be in the crate as regular files.
listing="$work/listing.txt"
tar tvzf "$crate" > "$listing"
if grep -q '^l' "$listing"; then die "the crate contains symlinks:"$'\n'"$(grep '^l' "$listing")"; fi
need=(c/sources.txt c/include/m40llm.h src/bindings.rs build.rs)
while read -r group path; do
  case "$group" in ''|\#*) continue ;; esac
  need+=("$path")
done < "$repo/c/sources.txt"
for f in "$repo"/c/src/*.h "$repo"/cuda/*.cuh "$repo"/cuda/*.h; do
  [ -e "$f" ] && need+=("${f#"$repo"/}")
done
for p in "${need[@]}"; do
  grep -q " m40llm-sys-$version/$p\$" "$listing" || die "missing from the crate: $p"
done
log "crate holds all ${#need[@]} required files"

# Unpack outside the repository and build a scratch crate against it.
mkdir -p "$work/unpacked" "$work/scratch/src"
tar xzf "$crate" -C "$work/unpacked"
sys="$work/unpacked/m40llm-sys-$version"
(cd "$sys" && find . -type f | sort) > "$work/before.txt"

cat > "$work/scratch/Cargo.toml" <<EOF
[package]
name = "m40llm-pkg-check"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
m40llm-sys = { path = "$sys" }

[workspace]
EOF
cat > "$work/scratch/src/main.rs" <<'EOF'
use m40llm_sys as sys;
use std::ffi::CStr;
use std::ptr;

fn main() {
    unsafe {
        let v = CStr::from_ptr(sys::m40llm_version_string()).to_str().unwrap();
        assert_eq!(sys::m40llm_version_number(), sys::M40LLM_VERSION_NUMBER);
        let mut n = -1;
        assert_eq!(sys::m40llm_cuda_device_count(&mut n), sys::M40LLM_OK);
        let mut opts = sys::m40llm_context_options::default();
        assert_eq!(sys::m40llm_context_options_init(&mut opts, sys::M40LLM_CONTEXT_OPTIONS_VERSION), 0);
        opts.backend = sys::M40LLM_BACKEND_CPU as i32;
        let mut ctx = ptr::null_mut();
        assert_eq!(sys::m40llm_context_create(&mut ctx, &opts), sys::M40LLM_OK);
        let mut kopts = sys::m40llm_kvcache_options::default();
        sys::m40llm_kvcache_options_init(&mut kopts, sys::M40LLM_KVCACHE_OPTIONS_VERSION);
        kopts.n_layers = 1;
        kopts.n_heads = 2;
        kopts.n_kv_heads = 1;
        kopts.head_dim = 8;
        kopts.max_seqs = 1;
        kopts.max_seq_len = 4;
        let mut cache = ptr::null_mut();
        assert_eq!(sys::m40llm_kvcache_create(&mut cache, ctx, &kopts), sys::M40LLM_OK);
        let kv = [1.0f32; 8];
        assert_eq!(sys::m40llm_kvcache_append_f32(cache, 0, 0, kv.as_ptr(), kv.as_ptr(), 1), 0);
        let q = [0.5f32; 16];
        let mut out = [0.0f32; 16];
        assert_eq!(sys::m40llm_kvcache_attn_last_token_f32q(out.as_mut_ptr(), cache, 0, 0, q.as_ptr(), 0.0), 0);
        assert!(out.iter().all(|&x| x == 1.0));
        sys::m40llm_kvcache_destroy(cache);
        sys::m40llm_context_destroy(ctx);
        println!("m40llm {v}: built_with_cuda={} cuda_devices={n}: OK", sys::m40llm_built_with_cuda());
    }
}
EOF
[ -f "$here/Cargo.lock" ] && cp "$here/Cargo.lock" "$work/scratch/Cargo.lock"

build_and_run() { # label, expected built_with_cuda, env...
  local label=$1 want=$2; shift 2
  log "building the unpacked crate ($label)"
  local out
  out=$(cd "$work/scratch" && env "$@" CARGO_TARGET_DIR="$work/scratch-target-$label" cargo run -q 2>&1) \
    || die "$label build/run failed:"$'\n'"$out"
  printf '%s\n' "$out" | sed 's/^/    /'
  printf '%s\n' "$out" | grep -q "built_with_cuda=$want" || die "$label: expected built_with_cuda=$want"
}

build_and_run cpu 0 M40LLM_NO_CUDA=1
have_nvcc=0
for c in "${NVCC:-}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" \
         /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null || true)"; do
  if [ -n "$c" ] && [ -x "$c" ]; then have_nvcc=1; break; fi
done
# What is checked is that the crate holds every file the CUDA build needs and links: one
# architecture proves that, PTX alone the cheapest (M40LLM_CUDA_ARCHS overrides it).
archs=${M40LLM_CUDA_ARCHS:-compute_52}
case "${M40LLM_CHECK_CUDA:-auto}" in
  0) log "CUDA build skipped (M40LLM_CHECK_CUDA=0)" ;;
  1) [ "$have_nvcc" = 1 ] || die "M40LLM_CHECK_CUDA=1 but no nvcc found"
     build_and_run cuda 1 M40LLM_NO_CUDA= M40LLM_CUDA_ARCHS="$archs" ;;
  *) if [ "$have_nvcc" = 1 ]; then build_and_run cuda 1 M40LLM_NO_CUDA= M40LLM_CUDA_ARCHS="$archs"
     else log "no nvcc: CUDA build not checked"; fi ;;
esac

(cd "$sys" && find . -type f | sort) > "$work/after.txt"
diff -u "$work/before.txt" "$work/after.txt" >/dev/null \
  || die "the build wrote into the package directory:"$'\n'"$(diff "$work/before.txt" "$work/after.txt")"
log "OK: the packaged crate is self-contained and builds outside the repository"
