#!/usr/bin/env bash
# Regenerates rust/m40llm-sys/src/bindings.rs from c/include/m40llm.h with bindgen (needs libclang:
# apt-get install libclang-dev). With --check, fails instead when the committed file is stale.
# Users of the crates never need this: the bindings are committed.
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
[ "${1:-}" = "--check" ] && check=1
# DOCS_RS=1 makes build.rs skip the native build: only bindgen runs. The crate itself may fail
# to compile (stale or missing bindings); the build script's output is all that is needed here.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
DOCS_RS=1 cargo build -q -p m40llm-sys --features regenerate-bindings --message-format=json \
  >"$log" 2>&1 || true
out_dir=$(grep '"reason":"build-script-executed"' "$log" | grep '"package_id":"[^"]*m40llm-sys' \
  | sed -E 's/.*"out_dir":"([^"]*)".*/\1/' | tail -n 1 || true)
fresh="$out_dir/bindings.rs"
if [ -z "$out_dir" ] || [ ! -f "$fresh" ]; then
  echo "regen_bindings: bindgen produced no bindings.rs (no libclang? scripts/setup.sh installs it)" >&2
  grep -v '^{' "$log" | grep -E -A1 '^error|panicked|not found' | head -n 12 >&2 || true
  exit 1
fi
committed=m40llm-sys/src/bindings.rs
if [ "$check" = 1 ]; then
  if diff -u "$committed" "$fresh"; then
    echo "regen_bindings: $committed is up to date"
  else
    echo "regen_bindings: $committed is stale; run rust/scripts/regen_bindings.sh" >&2
    exit 1
  fi
else
  cp "$fresh" "$committed"
  echo "regen_bindings: wrote $committed"
fi
