#!/usr/bin/env bash
# The server load test on a GPU in one command: starts `python -m megatron_async.serve` on the
# built-in qwen3-0.6b (bf16, CUDA graphs) on a loopback port, warms it up (Triton compiles, graph
# captures), then 64 concurrent streaming clients (the official openai client, spread over 8
# processes: one process alone saturates and distorts the latencies) send 500 greedy
# requests of 128 prompt ids and 128 output tokens; prints TTFT / inter-token p50 / p99 and fails
# (exit 1) if a request is lost, duplicated, failed or short. Log and JSON report go to $OUT (or ./out).
#
# The GPU machine lacks fastapi / uvicorn / openai: first, here, `bash scripts/serve_wheels.sh`
# (fills .whl), then carry ".whl" with the call. Extra load-test flags may be given, e.g.
#   bash scripts/gpu_load_test.sh --requests 200; SERVER_FLAGS="--serial" bash scripts/gpu_load_test.sh
# A CPU check of the script itself: MODEL_FLAGS="--default-model tiny --device cpu" bash scripts/gpu_load_test.sh \
#   --clients 8 --requests 24 --max-tokens 4 --warmup-requests 8
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import fastapi, uvicorn, openai, zmq, uvloop, httptools" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
out="${OUT:-out}"
mkdir -p "$out"
python3 -c "import fastapi, uvicorn, openai" || { echo "fastapi/uvicorn/openai missing: run scripts/serve_wheels.sh and carry .whl"; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# shellcheck disable=SC2086
python3 scripts/load_test.py --clients 64 --client-processes 8 --requests 500 --max-tokens 128 --prompt-words 128 --token-prompts \
  --warmup-requests 128 --output-path "$out/load_test.json" "$@" \
  -- ${MODEL_FLAGS:---default-model qwen3-0.6b --device cuda --dtype bfloat16} --max-requests 64 \
  --max-sequence-length 1024 ${SERVER_FLAGS:---cuda-graphs} 2>&1 | tee "$out/load_test.log"
exit "${PIPESTATUS[0]}"
