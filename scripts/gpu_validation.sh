#!/usr/bin/env bash
# One GPU session's validation in one command (what the device runs): the GPU-marked tests,
# the kernel check scripts, and the side-by-side benchmark. Logs go to ${OUT:-gpu_out}.
# Usage: bash scripts/gpu_validation.sh [tests|kernels|bench|bench-long ...] (default: all but bench-long)
set -uo pipefail
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-gpu_out}"; mkdir -p "$out"
stages="${*:-tests kernels bench}"
for stage in $stages; do
  case "$stage" in
    tests)
      timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -40 > "$out/gpu_tests.log"
      tail -3 "$out/gpu_tests.log" ;;
    kernels)
      for s in check_triton_attention check_mamba_kernels check_fused_ops check_sampling; do
        [ -f "scripts/$s.py" ] && timeout 120 python "scripts/$s.py" > "$out/$s.log" 2>&1
        tail -25 "$out/$s.log"
      done ;;
    bench)  # the NOTES.md reference workload: 128 requests, prompts 100-1024, 128 output tokens
      timeout 540 python scripts/benchmark.py --num-requests 128 --output-len-min 128 --output-len-max 128 \
        --max-requests 128 --max-minutes 8 --output-dir "$out/bench128" > "$out/bench128.log" 2>&1
      tail -20 "$out/bench128.log" ;;
    bench-long)  # the issue's workload (256 requests, outputs 100-1024): engine modes only
      timeout 540 python scripts/benchmark.py --modes serial,async,serial_graphs,async_graphs \
        --max-requests 256 --max-minutes 8 --output-dir "$out/bench256" > "$out/bench256.log" 2>&1
      tail -20 "$out/bench256.log" ;;
  esac
done
