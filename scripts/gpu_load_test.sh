#!/usr/bin/env bash
# Server load tests on a GPU in one command, loopback only; logs and JSON reports go to $OUT (or ./out).
#   bash scripts/gpu_load_test.sh [load] [load-test flags]  # 64 streaming clients (8 processes), 1,000 greedy
#        requests of 128 prompt ids / 128 tokens on qwen3-0.6b (bf16, CUDA graphs), 10 % leaving mid-stream,
#        every 50th with an 8k-token prompt; fails (exit 1) if a request is lost, duplicated, failed or short,
#        or if the server still holds a request or KV block afterwards (/metrics); prints TTFT / ITL p50 / p99
#   bash scripts/gpu_load_test.sh throughput  # the serving shape (500 prompts x 512 ids in, 128 out, 256
#        streams from 8 raw-client processes): offline engine tok/s and server tok/s (the server as
#        python -m megatron_async.serve runs it), the server again with 16 client processes (unchanged tok/s:
#        the clients are not the bottleneck), where the engine thread spends its time and how busy the HTTP side
#        is (python -m benchmarks server-breakdown); with --api-server-count 0 (the event loop in the engine's
#        process), 1 and 2 (front-end processes; API_SERVER_COUNTS="0 2 4" picks others); a table last
#   bash scripts/gpu_load_test.sh throughput-raw  # throughput with the openai client, then with the raw one
#        (httpx2 + json.loads, less client CPU per chunk), each also with 16 processes; a table last
#   bash scripts/gpu_load_test.sh compare     # throughput with asyncio + h11 and Python's 5 ms GIL switch
#        interval, with uvloop + httptools at 5 ms, and as served by default; a table last
#   bash scripts/gpu_load_test.sh all         # load, then compare
#
# The GPU machine lacks fastapi / uvicorn / openai / uvloop / httptools: first, here,
# `bash scripts/serve_wheels.sh` (fills .whl), then carry ".whl" with the call.
# SERVER_FLAGS replaces the load mode's engine flags, e.g. SERVER_FLAGS="--serial" bash scripts/gpu_load_test.sh
# A CPU check of the script itself: MODEL_FLAGS="--default-model tiny --device cpu" bash scripts/gpu_load_test.sh \
#   --clients 8 --requests 24 --max-tokens 4 --warmup-requests 8 --long-prompt-words 200
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
mode=load
case "${1:-}" in load|throughput|throughput-raw|compare|all) mode="$1"; shift ;; esac
model="${MODEL_FLAGS:---default-model qwen3-0.6b --device cuda --dtype bfloat16}"

load() {
  # shellcheck disable=SC2086
  python -m benchmarks load-test --clients 64 --client-processes 8 --requests 1000 --max-tokens 128 --prompt-words 128 \
    --token-prompts --disconnect-fraction 0.1 --long-prompt-every 50 --long-prompt-words 8192 \
    --warmup-requests 128 --output-path "$out/load_test.json" "$@" \
    -- $model --max-requests 64 --max-sequence-length 8448 ${SERVER_FLAGS:---cuda-graphs} 2>&1 | tee "$out/load_test.log"
  return "${PIPESTATUS[0]}"
}

throughput() {  # NAME [server-breakdown flags] [-- extra server flags]
  local name="$1"; shift
  local flags=() extra=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift && extra=("$@")
  # shellcheck disable=SC2086
  python -m benchmarks server-breakdown --requests 500 --prompt-len 512 --max-tokens 128 --clients 256 \
    --client-processes 8 --output-path "$out/throughput_$name.json" "${flags[@]}" \
    -- $model --cuda-graphs --max-requests 256 "${extra[@]}" 2>&1 | tee "$out/throughput_$name.log"
  return "${PIPESTATUS[0]}"
}

table() {  # engine: the engine thread's CPU-busy share; HTTP: the event loop's (api-server-count 0) or the
  # busiest front-end process's; HTTP us/tok: their CPU time (all front-ends together) per streamed token
  python3 - "$out" "$@" <<'EOF'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
print(f"\n{'server configuration':<28} {'offline':>8} {'server':>8} {'share':>6} {'2x procs':>9} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'engine':>6} {'HTTP':>5} {'HTTP us/tok':>11} {'client CPU 1x/2x':>17} {'us/chunk':>8}")
for name in names:
    r = json.load(open(f"{out}/throughput_{name}.json"))
    s, m = r["server"], r.get("server_more_clients")
    fe = r.get("frontend_cpu_s") or []
    http_s = sum(fe) if fe else r["cpu_s"].get("loop", 0)
    http_busy = max(r.get("frontend_cpu_busy") or [r["cpu_busy"].get("loop", 0)])
    print(f"{name:<28} {r['offline_tok_s']:>8.0f} {s['output_tokens_per_s']:>8.0f} "
          f"{s['output_tokens_per_s'] / r['offline_tok_s']:>6.0%} {m['output_tokens_per_s'] if m else float('nan'):>9.0f} "
          f"{s['ttft_p50_ms']:>7.0f}/{s['ttft_p99_ms']:<8.0f} {s['itl_p50_ms']:>6.1f}/{s['itl_p99_ms']:<8.1f} "
          f"{r['cpu_busy'].get('engine', 0):>6.0%} {http_busy:>5.0%} {http_s / max(1, s['output_tokens']) * 1e6:>11.1f} "
          f"{s['client_cpu_busy']:>8.0%}/{m['client_cpu_busy'] if m else float('nan'):<8.0%} {s['client_cpu_us_per_chunk']:>8.0f}")
EOF
}

compare() {  # [server-breakdown flags]
  local s=0
  throughput asyncio-h11-gil5ms --skip-client-check --http h11 --loop asyncio "$@" -- --gil-switch-interval-ms 5 || s=$?
  throughput uvloop-httptools-gil5ms --skip-client-check "$@" -- --gil-switch-interval-ms 5 || s=$?
  throughput default "$@" || s=$?
  table asyncio-h11-gil5ms uvloop-httptools-gil5ms default
  return "$s"
}

status=0
case "$mode" in
  load) load "$@" || status=$? ;;
  throughput) names=()
    for n in ${API_SERVER_COUNTS:-0 1 2}; do
      throughput "api-server-count-$n" --client raw "$@" -- --api-server-count "$n" || status=$?
      names+=("api-server-count-$n")
    done
    table "${names[@]}" ;;
  throughput-raw) throughput openai-client --client openai "$@" || status=$?
    throughput raw-client --client raw "$@" || status=$?; table openai-client raw-client ;;
  compare) compare "$@" || status=$? ;;
  all) load "$@" || status=$?; compare || status=$? ;;
esac
exit "$status"
