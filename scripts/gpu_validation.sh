#!/usr/bin/env bash
# Validation on one GPU in one command: the GPU-marked tests and every kernel test (their CUDA
# branches run only here), the kernel timings (python -m benchmarks kernel-times), and the
# side-by-side benchmark. Logs go to ${OUT:-gpu_out}.
# Usage: bash scripts/gpu_validation.sh [tests|tests-functional|tests-engine|tests-invariance|tests-rl|tests-unit|tests-kernels|
#                                        kernels|bench|bench-poisson|bench-long|main-job|diagnose|warmup-graphs ...]
# (default: tests kernels bench)
set -uo pipefail
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out="${OUT:-gpu_out}"; mkdir -p "$out"
root="$(cd "$(dirname "$0")/.." && pwd)"
# torch-memory-saver (engine.suspend on CUDA) from the carried wheels (bash scripts/serve_wheels.sh, then
# carry .whl): here the suspend tests must run, so a missing package fails them instead of skipping them
if ! python -c "import torch_memory_saver" 2>/dev/null; then
  tms=$(ls "$root"/.whl/torch_memory_saver-*.whl 2>/dev/null | head -1)
  if [ -n "$tms" ]; then python -m pip install -q --no-deps "$tms"
  else echo "gpu_validation: no torch-memory-saver wheel under .whl: the suspend tests will fail"; fi
fi
export MEGATRON_ASYNC_TEST_REQUIRES=torch_memory_saver
report() {  # a test stage's counts (passed, failed, skipped) and why each skipped test skipped
  echo "$1: $(grep -E '^[0-9]+ (passed|failed|skipped|error|deselected)' "$out/$1.log" | tail -1)"
  grep '^SKIPPED' "$out/$1.log"
}
stages="${*:-tests kernels bench}"
# the engine-level GPU tests at real sizes, a stage of their own (tests-engine), and batch invariance
# on the qwen3-0.6b shape (tests-invariance), refit / Megatron-Core reference / request surface / coordinator /
# structured outputs (tests-rl); tests-functional runs the other functional GPU tests
engine_tests=(tests/functional_tests/test_gpu_speculative.py tests/functional_tests/test_spec_mtp.py
              tests/functional_tests/test_gpu_hybrid_graphs.py)
invariance_tests=(tests/functional_tests/test_batch_invariant_gpu.py)
rl_tests=(tests/functional_tests/test_gpu_weight_ipc.py tests/functional_tests/test_megatron_reference_gpu.py
          tests/functional_tests/test_gpu_surface.py tests/functional_tests/test_gpu_coordinator.py
          tests/functional_tests/test_gpu_structured.py)
ignored=()
for f in "${engine_tests[@]}" "${invariance_tests[@]}" "${rl_tests[@]}"; do ignored+=(--ignore="$f"); done
for stage in $stages; do
  case "$stage" in
    # the tests in six commands (on a fresh machine, Triton builds included, they outgrow one
    # timeout); tests-functional, tests-engine, tests-invariance, tests-rl, tests-unit and tests-kernels
    # run one part each, so each fits a 10-minute call
    tests|tests-functional)
      timeout 590 python -m pytest -q -rs -p no:cacheprovider -m gpu tests/functional_tests "${ignored[@]}" \
        > "$out/gpu_functional_tests.log" 2>&1
      report gpu_functional_tests ;;&
    tests|tests-engine)  # speculative == plain, MTP, hybrid graph modes
      timeout 590 python -m pytest -q -rs -p no:cacheprovider -m gpu "${engine_tests[@]}" \
        > "$out/gpu_engine_tests.log" 2>&1
      report gpu_engine_tests ;;&
    tests|tests-rl)  # ~265 s on a fresh H100
      timeout 590 python -m pytest -q -rs -p no:cacheprovider -m gpu "${rl_tests[@]}" > "$out/gpu_rl_tests.log" 2>&1
      report gpu_rl_tests ;;&
    tests|tests-invariance)
      timeout 590 python -m pytest -q -rs -p no:cacheprovider -m gpu "${invariance_tests[@]}" \
        > "$out/gpu_invariance_tests.log" 2>&1
      report gpu_invariance_tests ;;&
    tests|tests-unit)  # the kernels against their references at real shapes, and the other GPU unit tests
      timeout 560 python -m pytest -q -rs -p no:cacheprovider -m gpu tests/unit_tests > "$out/gpu_unit_tests.log" 2>&1
      report gpu_unit_tests ;;&
    tests|tests-kernels)  # the unmarked kernel tests: their CUDA branches (bf16 bit-exact checks) skip on CPU
      timeout 560 python -m pytest -q -rs -p no:cacheprovider --durations=15 -m "not gpu and not multigpu" tests/unit_tests/kernels \
        > "$out/kernel_tests.log" 2>&1
      report kernel_tests ;;
    kernels)  # times only: the kernels' assertions are tests-unit's
      for k in paged-attention mamba-kernels mamba-mixed fused-elementwise sampler-kernels fused-moe; do
        timeout 120 python -m benchmarks kernel-times "$k" > "$out/$k.log" 2>&1
        tail -25 "$out/$k.log"
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
      timeout 30 python -m benchmarks kernel-times graph-variants > "$out/variants.log" 2>&1
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
