#!/usr/bin/env bash
# The fused TP all-reduce + residual add + RMSNorm on 2 (or 4) GPUs of one host, one device call
# (nvidia-h200-x2 / -x4, < 4 minutes on 2): first the checks and per-layer timings of the fused
# kernel against the unfused P2P path (scripts/bench_all_reduce.py: values vs unfused, every
# rank's bits, CUDA-graph replays; us per decoder layer at 1 / 16 / 64 / 128 rows), then the
# Qwen3-8B-shape decode step at TP=world, async + graphs, P2P unfused vs fused
# (scripts/bench_tp_scaling.py). Logs in ${OUT:-gpu_out}; the two tables are printed last.
# pyzmq (the engine's consensus) is not installed on the GPU machines: carry ".whl" (see
# scripts/multigpu_validation.sh). Usage: bash scripts/check_tp_fused_norm.sh [world]
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
out="${OUT:-gpu_out}"; mkdir -p "$out"
world="${1:-$(python -c 'import torch; print(min(4, torch.cuda.device_count()))')}"
if ! python -c "import zmq" 2>/dev/null && ls "$root"/.whl/*.whl > /dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
timeout 100 python scripts/bench_all_reduce.py --world "$world" --groups "$world" --sizes-kb 8 1024 --iters 20 \
  --fused-rows 1 16 64 128 > "$out/fused_all_reduce.log" 2>&1
rc1=$?
timeout 200 python scripts/bench_tp_scaling.py --tp "$world" --batches 1 64 128 --backends p2p p2p+fused --output-len 24 \
  --modes async --launch-timeout 190 > "$out/fused_tp_scaling.log" 2>&1
rc2=$?
grep -E "^group|^\| GPUs|^\|---|^\| [0-9]|CHECKS" "$out/fused_all_reduce.log"
echo
grep -E "^requests|^TP=|^\| TP|^\|---|^\| [0-9]|^async|^no result" "$out/fused_tp_scaling.log"
echo "VERDICT: checks rc=$rc1 (0 = all fused checks passed), scaling rc=$rc2"
exit $(( rc1 || rc2 ))
