#!/bin/bash
# Q8 codes widened by an I2F with a byte select on sm_5x/6x (i2f.patch, beside this file, on
# cuda/kv_format.cuh's KvQ8::widen; it did not land) against main ab948e1: the compute_52 PTX
# builds of CUDA 11.8 of both (the M40's code), carried in .ab/t (bench_new, bench_old:
# bench_attention; test_gpu: the patched tree's) and JIT-compiled here. STEPS (default "tests formats tiers"):
#   tests    the compute_52 test_gpu, small mode, every group
#   formats  bench/ab.sh (2 rounds, alternating) over bench/formats_shapes.sh and four 8-head
#            shapes for FORMATS (default: F16, whose code is unchanged, the control; Q8 with the
#            library's defaults; Q8 plain, no rotation or protected tokens; Q8Q4)
#   tiers    the same over bench/tiers.sh's shapes for its four tiers (K8V8 and K8V4 among them)
# Make .ab/t here with scripts/build_carry.sh (ab948e1 with the patch) and the same build of
# ab948e1's bench_attention (packed into .ab/t/bins.tar.xz to carry). Results in $OUT/r (r.tgz).
cd "$(dirname "$0")/../../.."
export CUDA_CACHE_MAXSIZE=4294967296
R=$OUT/r; mkdir -p $R
t0=$SECONDS
log() { echo "$* $((SECONDS-t0)) s" >> $R/log.txt; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
[ -f .ab/t/bins.tar.xz ] && tar -C .ab/t -xJf .ab/t/bins.tar.xz  # as carried (under 64 MiB)
B=/tmp/i2f_bins; mkdir -p $B/base $B/new
cp .ab/t/bench_old $B/base/bench_attention && cp .ab/t/bench_new $B/new/bench_attention
for step in ${STEPS:-tests formats tiers}; do
  case $step in
    tests)
      M40LLM_REQUIRE_GPU=1 M40LLM_TEST_SMALL=1 timeout ${TEST_TIMEOUT:-330} stdbuf -oL -eL \
        .ab/t/test_gpu > $R/test_gpu_ptx52.txt 2>&1
      log "test_gpu compute_52 rc=$? $(tail -1 $R/test_gpu_ptx52.txt)" ;;
    formats)
      source bench/formats_shapes.sh
      shapes=()
      for s in "${FORMAT_SHAPES[@]}" 1,64,8,128,32768 64,64,8,128,2048 32,8,1,256,32768 \
               8,64,8,128,8192; do shapes+=(--shape "$s"); done
      for spec in ${FORMATS:-F16 Q8 Q8-plain Q8Q4}; do
        args=(--format "${spec%-plain}")
        [ "$spec" != "${spec%-plain}" ] && args+=(--kv-rotation none --kv-protect 0,0)
        AB_BINS=$B AB_BUILD=/tmp/i2f_ab bash bench/ab.sh . $R/$spec 2 -- "${args[@]}" \
          "${shapes[@]}" > $R/$spec.log 2>&1
        log "ab $spec rc=$?"
      done ;;
    tiers)
      tshapes=(); for s in $(bash bench/tiers.sh --shapes); do tshapes+=(--shape "$s"); done
      AB_BINS=$B AB_BUILD=/tmp/i2f_ab bash bench/ab.sh . $R/tiers-4 2 -- \
        --tiers Q8Q8:0.25,Q8Q4:0.25,Q4Q3:0.25,Q4Q2:0.25 "${tshapes[@]}" > $R/tiers-4.log 2>&1
      log "ab tiers-4 rc=$?" ;;
  esac
done
tar czf $OUT/r.tgz -C $OUT r
