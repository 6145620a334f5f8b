#!/usr/bin/env bash
# Batch-invariant mode under tensor parallelism (2 GPUs, e.g. nvidia-h200-x2): the main job
# under torchrun, TP=2, built-in qwen3-0.6b bf16, sampled with log-probs, run twice with
# different schedules (serial, 512-token steps, up to 64 requests per step; launch-ahead,
# 8192-token steps, up to 16: other chunkings and batch mixes). Every request's
# tokens and log-probs must be identical. Same TP size only: no promise across TP sizes.
#   bash scripts/check_batch_invariance_tp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-tp_invariance_out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
COMMON=(--batch-invariant --num-requests 64 --prompt-len-min 100 --prompt-len-max 4000 --output-len-min 16
        --output-len-max 64 --max-sequence-length 4200 --temperature 0.8 --top-p 0.95 --return-log-probs --quiet)
NPROC=2 bash examples/run_torchrun.sh "${COMMON[@]}" --serial --max-tokens 512 --max-requests 64 --output-path "$OUT/serial_512.json"
NPROC=2 bash examples/run_torchrun.sh "${COMMON[@]}" --max-tokens 8192 --max-requests 16 --output-path "$OUT/async_8192.json"
python - "$OUT/serial_512.json" "$OUT/async_8192.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["requests"] for p in sys.argv[1:])
same = sum((x["generated_tokens"], x["generated_log_probs"]) == (y["generated_tokens"], y["generated_log_probs"])
           for x, y in zip(a, b))
print(f"TP=2 batch-invariant: {same}/{len(a)} requests identical (tokens and log-probs)")
sys.exit(0 if same == len(a) else 1)
PY
