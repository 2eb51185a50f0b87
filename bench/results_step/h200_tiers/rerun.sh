#!/bin/bash
# One device call: examples/decode_loop's decode step (issue 22's shape: 32 layers, 8 sequences,
# 32/8 heads, head_dim 128, contexts 8K and 1K, prompts appended without attention) with an F16
# cache, with mixed-precision tiers placed by age (--tiers) and by importance (--tiers
# --importance: the cache's own observe call every 4th step), on the carried compute_52 PTX build
# (.ab/t/p52new.tar.xz: decode_loop, the M40's code) and on a native sm_90 build made here.
# Results in $OUT/r.tgz.
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296 CUDA_MODULE_LOADING=LAZY
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
t0=$SECONDS
R=$OUT/r; mkdir -p $R
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
mkdir -p /tmp/p52new && tar -C /tmp/p52new -xJf .ab/t/p52new.tar.xz
( cmake -S . -B /tmp/nat -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 > /tmp/nat.cfg.log 2>&1 &&
  cmake --build /tmp/nat -j12 --target decode_loop > /tmp/nat.log 2>&1; log "native build rc=$?" ) &
runs() { # $1 binary, $2 tag
  for ctx in 8192 1024; do
    for mode in "" "--tiers" "--tiers --importance"; do
      tag=$2_${ctx}_$(echo "f16 $mode" | tr -d ' -' | sed 's/^f16tiers/tiers/')
      timeout 80 $1 32 cuda --layers 32 --seqs 8 --heads 32 --kv-heads 8 --head-dim 128 \
        --context $ctx --no-prefill-attention $mode > $R/$tag.txt 2>&1
      log "$tag rc=$?"
    done
  done
}
runs /tmp/p52new/decode_loop ptx52
wait
runs /tmp/nat/examples/decode_loop native
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
tar czf $OUT/r.tgz -C $OUT r
