#!/usr/bin/env bash
# torchrun launch of the main job with NPROC ranks per node (default 1) on NNODES nodes (default 1);
# every rank is one tensor-parallel rank (TP = NPROC x NNODES), or with EP=1 one data-parallel
# engine (--expert-parallel-size NPROC x NNODES). Extra arguments go to the script, e.g.
#   bash examples/run_torchrun.sh --num-requests 64 --output-path out.json
#   NPROC=2 bash examples/run_torchrun.sh --model CKPT   # TP=2: heads, MLP and vocab split over 2 ranks
#   NPROC=2 EP=1 bash examples/run_torchrun.sh --model CKPT   # 2 data-parallel engines (MoE: experts split)
#   NPROC=4 EP=1 TP=2 bash examples/run_torchrun.sh --model CKPT   # 2 engines, each a TP=2 group
#   SCRIPT=examples/hybrid_dynamic_inference.py bash examples/run_torchrun.sh --model CKPT   # NPROC=1 only
# Several nodes: run on each node with the same MASTER_ADDR (node 0's address) / MASTER_PORT, e.g.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash examples/run_torchrun.sh ...   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 bash examples/run_torchrun.sh ...   # node 1
# The ranks' ZMQ endpoint comes from that rendezvous (rank 0 publishes it in the torch store).
# Only rank 0 prints the summary and writes --output-path.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
NNODES="${NNODES:-1}"
SCRIPT="${SCRIPT:-examples/gpt_dynamic_inference.py}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
SIZE=$((NPROC * NNODES))
if [ -n "${EP:-}" ]; then  # TP x EP: SIZE / TP data-parallel engines, each a TP group of TP ranks
  TP="${TP:-1}"; PARALLEL=(--tensor-parallel-size "$TP" --expert-parallel-size "$((SIZE / TP))")
else PARALLEL=(--tensor-parallel-size "$SIZE"); fi
if [ "$NNODES" -gt 1 ]; then
  LAUNCH=(--nnodes="$NNODES" --node-rank="${NODE_RANK:?set NODE_RANK}" --master-addr="${MASTER_ADDR:?set MASTER_ADDR}"
          --master-port="${MASTER_PORT:?set MASTER_PORT}")
else
  LAUNCH=(--standalone --nnodes=1)
fi
exec torchrun "${LAUNCH[@]}" --nproc-per-node="$NPROC" "$SCRIPT" "${PARALLEL[@]}" "$@"
