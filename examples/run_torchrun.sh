#!/usr/bin/env bash
# One-node torchrun launch of the main job; extra arguments go to the script, e.g.
#   bash examples/run_torchrun.sh --num-requests 64 --output-path out.json
#   SCRIPT=examples/hybrid_dynamic_inference.py bash examples/run_torchrun.sh --model CKPT
# Tensor parallelism is not implemented yet, so this runs one process (world size 1): it
# shows the launch shape that TP will use, and refuses NPROC > 1 instead of running copies.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
SCRIPT="${SCRIPT:-examples/gpt_dynamic_inference.py}"
if [ "$NPROC" != "1" ]; then
  echo "run_torchrun.sh: tensor parallelism is not implemented yet; only NPROC=1 is supported" >&2
  exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nnodes=1 --nproc-per-node="$NPROC" "$SCRIPT" "$@"
