#!/usr/bin/env bash
# Validation on one GPU in one command: the GPU-marked tests and every kernel test (their CUDA
# branches run only here), the kernel checks of scripts/gpu_check.py, and the side-by-side
# benchmark. Logs go to ${OUT:-gpu_out}.
# Usage: bash scripts/gpu_validation.sh [tests|tests-functional|tests-unit|kernels|bench|bench-poisson|bench-long|main-job|diagnose|warmup-graphs ...]
# (default: tests kernels bench)
set -uo pipefail
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-gpu_out}"; mkdir -p "$out"
stages="${*:-tests kernels bench}"
for stage in $stages; do
  case "$stage" in
    # the GPU-marked tests in two commands (on a fresh machine, Triton builds included, they outgrow
    # one timeout); tests-functional and tests-unit run one part each, so each fits a 10-minute call
    tests|tests-functional)
      timeout 590 python -m pytest -q -p no:cacheprovider -m gpu tests/functional_tests 2>&1 | tail -40 \
        > "$out/gpu_functional_tests.log"
      tail -3 "$out/gpu_functional_tests.log" ;;&
    tests|tests-unit)
      timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/unit_tests 2>&1 | tail -40 \
        > "$out/gpu_unit_tests.log"
      tail -3 "$out/gpu_unit_tests.log"
      # the unmarked kernel tests: their CUDA branches (bf16 bit-exact checks) are skipped on CPU
      timeout 300 python -m pytest -q -p no:cacheprovider -m "not gpu and not multigpu" tests/unit_tests/kernels 2>&1 \
        | tail -40 > "$out/kernel_tests.log"
      tail -3 "$out/kernel_tests.log" ;;
    kernels)
      for c in paged-attention mamba-kernels fused-elementwise sampler-kernels fused-moe; do
        timeout 120 python scripts/gpu_check.py "$c" > "$out/$c.log" 2>&1
        tail -25 "$out/$c.log"
      done ;;
    bench)  # the NOTES.md reference workload: 128 requests, prompts 100-1024, 128 output tokens; greedy
            # and sampled, every engine mode and HF peer (batch = max_requests), twin warm-up for all
      timeout 560 python -m benchmarks side-by-side --num-requests 128 --output-len-min 128 --output-len-max 128 \
        --max-requests 128 --max-minutes 8.5 --output-dir "$out/bench128" > "$out/bench128.log" 2>&1
      tail -32 "$out/bench128.log" ;;
    bench-poisson)  # the same workload arriving as a Poisson process (requests per second): TTFT / ITL under load
      timeout 300 python -m benchmarks side-by-side --modes serial_graphs,async_graphs --num-requests 128 \
        --output-len-min 128 --output-len-max 128 --max-requests 128 --request-rate 80 --no-idle-profile \
        --max-minutes 4 --output-dir "$out/poisson" > "$out/poisson.log" 2>&1
      tail -14 "$out/poisson.log" ;;
    warmup-graphs)  # timed right after the startup warm-up (no twin run): builds /
                    # captures while serving, mixed steps in graphs (async_graphs) vs eager (async_graphs_decode),
                    # all at once and as Poisson arrivals; then what the nested sampling variants cost
      timeout 110 python -m benchmarks side-by-side --modes async_graphs,async_graphs_decode --num-requests 128 \
        --output-len-min 128 --output-len-max 128 --max-requests 128 --no-twin-warmup --no-idle-profile \
        --max-minutes 1.6 --output-dir "$out/wg_all" > "$out/wg_all.log" 2>&1
      tail -14 "$out/wg_all.log"
      timeout 60 python -m benchmarks side-by-side --modes async_graphs --num-requests 128 --output-len-min 128 \
        --output-len-max 128 --max-requests 128 --request-rate 80 --no-twin-warmup --no-idle-profile \
        --max-minutes 0.9 --output-dir "$out/wg_poisson" > "$out/wg_poisson.log" 2>&1
      tail -10 "$out/wg_poisson.log"
      timeout 30 python scripts/gpu_check.py graph-variants > "$out/variants.log" 2>&1
      tail -8 "$out/variants.log" ;;
    main-job)  # the main job as a user runs it (fresh process, own startup warm-up) against the
               # benchmark's async_graphs mode on workload A, greedy and sampled (~3 min on an H100)
      timeout 420 python -m benchmarks main-job-vs-benchmark --out "$out/main_job" > "$out/main_job.log" 2>&1
      tail -6 "$out/main_job.log" ;;
    diagnose)  # async vs serial at long context (16k-token prompts)
      timeout 300 python -m benchmarks async-vs-serial --device cuda --num-requests 32 --prompt-len-min 8192 \
        --prompt-len-max 16384 --output-len 64 --max-sequence-length 16500 --output "$out/diag.json" > "$out/diag.log" 2>&1
      cut -c1-600 "$out/diag.log" ;;
    bench-long)  # workload B (256 requests, outputs 100-1024): engine modes only
      timeout 540 python -m benchmarks side-by-side --modes serial,async,serial_graphs,async_graphs \
        --max-requests 256 --max-minutes 8 --output-dir "$out/bench256" > "$out/bench256.log" 2>&1
      tail -20 "$out/bench256.log" ;;
  esac
done
