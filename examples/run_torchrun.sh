#!/usr/bin/env bash
# One-node torchrun launch of the main job with NPROC tensor-parallel ranks (default 1);
# extra arguments go to the script, e.g.
#   bash examples/run_torchrun.sh --num-requests 64 --output-path out.json
#   NPROC=2 bash examples/run_torchrun.sh --model CKPT   # TP=2: heads, MLP and vocab split over 2 ranks
#   SCRIPT=examples/hybrid_dynamic_inference.py bash examples/run_torchrun.sh --model CKPT   # NPROC=1 only
# Only rank 0 prints the summary and writes --output-path.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
SCRIPT="${SCRIPT:-examples/gpt_dynamic_inference.py}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC" "$SCRIPT" --tensor-parallel-size "$NPROC" "$@"
