#!/usr/bin/env bash
# Issue 15's bucket study, the one command: fetch the model (cached), run buckets.py at 2048
# tokens (every uniform format and bucket policy) and, with LONG=1, the 8192-token subset;
# writes results/buckets_<N>.json, results/buckets_tables.md, results/buckets_curve.png.
#   bash bench/fidelity/run_buckets.sh            # 2K: ~100 runs, 30-50 min on one core
#   LONG=1 bash bench/fidelity/run_buckets.sh     # + the 8K subset (26 runs, ~1-1.5 h more)
# Runs already in the JSON are skipped (--redo reruns them). One thread per process: the
# numbers do not depend on it, and the machine it was written on is shared.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
GGUF="$(bash "$HERE/fetch_model.sh")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
if [ -z "${SKIP_2K:-}" ]; then
  python3 "$HERE/buckets.py" --gguf "$GGUF" --tokens 2048 --runs uniform,buckets,mixes,knobs,best,default,kfix "$@"
fi
if [ -n "${LONG:-}" ]; then
  python3 "$HERE/buckets.py" --gguf "$GGUF" --tokens 8192 --runs long-uniform,long,long-default "$@"
fi
