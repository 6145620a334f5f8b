#!/usr/bin/env bash
# The multi-GPU checks of one host (nvidia-h100-x4 / -x2: tests that need 4 GPUs skip on 2). Logs go to
# ${OUT:-gpu_out}.
#   bash scripts/multigpu_validation.sh [1|2] [PYTEST ARGS]   # the whole `pytest -m multigpu` suite, in two
#       halves that each fit a 10-minute device call (1: the tests that use more than two GPUs, `gpus(4)` /
#       `gpus(2, up_to=4)`, on all of them; 2: the two-GPU tests, on a host of 4+ GPUs as two pytest
#       processes at once, one per GPU pair, the files split by their test counts); no half: both, one
#       after the other. Each prints one table, a row per test file: passed / failed / skipped, seconds,
#       and the GPUs the host has. Each test spawns its ranks and compiles its kernels (~30-130 s).
#   bash scripts/multigpu_validation.sh fused-norm [WORLD]   # the TP all-reduce fused with the residual
#       add + RMSNorm: its checks and us per decoder layer against the unfused P2P path
#       (python -m benchmarks all-reduce), then the Qwen3-8B-shape decode step at TP=WORLD, async +
#       graphs, P2P unfused vs fused (python -m benchmarks tp-scaling); < 4 minutes on 2 GPUs.
#   bash scripts/multigpu_validation.sh ep-exchange [EP ...]  # the EP MoE layer (Qwen3-30B-A3B shape) timed
#       with the all-gather (eager, graph) and all-to-all exchange against EP=1 on the same global batch
#       (python -m benchmarks kernel-times ep-exchange; default EP 2 4); < 3 minutes.
#   bash scripts/multigpu_validation.sh tp-invariance        # batch-invariant mode under TP=2: the main
#       job (torchrun, built-in qwen3-0.6b bf16, sampled with log-probs) twice with different schedules
#       (serial, 512-token steps, 64 requests per step; launch-ahead, 8192-token steps, 16): every
#       request's tokens and log-probs identical. Same TP size only: no promise across TP sizes.
# pyzmq is not installed on the GPU machines: fetch its wheel here with `bash scripts/serve_wheels.sh`
# (writes ./.whl) and carry ".whl" with the run.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# No NVLink multicast in any process (it can take the shared host down); children inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
out="${OUT:-gpu_out}"; mkdir -p "$out"
if ! python -c "import zmq" 2>/dev/null; then
  if ! ls "$root"/.whl/*.whl > /dev/null 2>&1; then
    echo "pyzmq is missing and $root/.whl has no wheels (run serve_wheels.sh and carry .whl)" | tee "$out/multigpu_tests.log"
    exit 2
  fi
  python -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# prepend (never overwrite) so the wheel dir stays visible to the spawned ranks
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L > "$out/gpus.txt" 2>&1
cd "$root"

fused_norm() {
  local world="${1:-$(python -c 'import torch; print(min(4, torch.cuda.device_count()))')}"
  timeout 100 python -m benchmarks all-reduce --world "$world" --groups "$world" --sizes-kb 8 1024 --iters 20 \
    --fused-rows 1 16 64 128 > "$out/fused_all_reduce.log" 2>&1
  local rc1=$?
  timeout 200 python -m benchmarks tp-scaling --tp "$world" --batches 1 64 128 --backends p2p p2p+fused \
    --output-len 24 --modes async --launch-timeout 190 > "$out/fused_tp_scaling.log" 2>&1
  local rc2=$?
  grep -E "^group|^\| GPUs|^\|---|^\| [0-9]|CHECKS" "$out/fused_all_reduce.log"
  echo
  grep -E "^requests|^TP=|^\| TP|^\|---|^\| [0-9]|^async|^no result" "$out/fused_tp_scaling.log"
  echo "VERDICT: checks rc=$rc1 (0 = all fused checks passed), scaling rc=$rc2"
  return $(( rc1 || rc2 ))
}

tp_invariance() {
  local common=(--batch-invariant --num-requests 64 --prompt-len-min 100 --prompt-len-max 4000 --output-len-min 16
    --output-len-max 64 --max-sequence-length 4200 --temperature 0.8 --top-p 0.95 --return-log-probs --quiet)
  NPROC=2 bash examples/run_torchrun.sh "${common[@]}" --serial --max-tokens 512 --max-requests 64 \
    --output-path "$out/serial_512.json" || return 1
  NPROC=2 bash examples/run_torchrun.sh "${common[@]}" --max-tokens 8192 --max-requests 16 \
    --output-path "$out/async_8192.json" || return 1
  python - "$out/serial_512.json" "$out/async_8192.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["requests"] for p in sys.argv[1:])
same = sum((x["generated_tokens"], x["generated_log_probs"]) == (y["generated_tokens"], y["generated_log_probs"])
           for x, y in zip(a, b))
print(f"TP=2 batch-invariant: {same}/{len(a)} requests identical (tokens and log-probs)")
sys.exit(0 if same == len(a) else 1)
PY
}

MULTIGPU_FILES=($(grep -rl "mark.multigpu" tests | sort))

pair_groups() {  # the pair-width files in two groups of about as many tests each (one line per group)
  python -m pytest --collect-only -q -p no:cacheprovider -m multigpu --multigpu-width pair "${MULTIGPU_FILES[@]}" \
    2>/dev/null | python -c '
import collections, sys
count = collections.Counter(line.split("::")[0] for line in sys.stdin if "::" in line)
groups = [[0, []], [0, []]]
for f, n in count.most_common():
    g = min(groups, key=lambda g: g[0]); g[0] += n; g[1].append(f)
print("\n".join(" ".join(g[1]) for g in groups))'
}

run_pytest() {  # TAG WIDTH FILES... (PYTEST ARGS in EXTRA)
  local tag="$1" width="$2"; shift 2
  timeout 560 python -m pytest -q -p no:cacheprovider -m multigpu --multigpu-width "$width" -rs \
    --junitxml "$out/multigpu_$tag.xml" "$@" "${EXTRA[@]}" > "$out/multigpu_tests_$tag.log" 2>&1
}

suite_half() {
  local half="$1"; shift
  EXTRA=("$@")
  local gpus rc=0 tags=()
  gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
  if [ "$half" = 1 ]; then
    run_pytest 1 wide "${MULTIGPU_FILES[@]}" || rc=$?
    tags=(1)
  elif [ "$gpus" -ge 4 ]; then
    mapfile -t groups < <(pair_groups)
    # shellcheck disable=SC2086  # a group is a space-separated file list
    CUDA_VISIBLE_DEVICES=0,1 run_pytest 2a pair ${groups[0]} & local a=$!
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=2,3 run_pytest 2b pair ${groups[1]} & local b=$!
    wait $a || rc=$?
    wait $b || rc=$?
    tags=(2a 2b)
  else
    run_pytest 2 pair "${MULTIGPU_FILES[@]}" || rc=$?
    tags=(2)
  fi
  local tag reports=()
  for tag in "${tags[@]}"; do
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/multigpu_tests_$tag.log" 2>/dev/null | tail -8
    reports+=("$out/multigpu_$tag.xml")
  done
  python scripts/junit_table.py "${reports[@]}" --gpus "$gpus" || rc=1
  return $rc
}

case "${1:-}" in
  fused-norm) shift; fused_norm "$@" ;;
  ep-exchange) shift
    [ $# -gt 0 ] || set -- 2 4
    timeout 500 python -m benchmarks kernel-times ep-exchange --ep "$@" > "$out/ep_exchange.log" 2>&1
    rc=$?
    tail -12 "$out/ep_exchange.log"
    exit $rc ;;
  tp-invariance) tp_invariance ;;
  1|2) half="$1"; shift; suite_half "$half" "$@" ;;
  *) suite_half 1 "$@"; rc1=$?; suite_half 2 "$@"; rc2=$?; exit $(( rc1 || rc2 )) ;;
esac
