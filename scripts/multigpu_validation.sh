#!/usr/bin/env bash
# The multi-GPU suite in one device call (nvidia-h200-x4, or -x2: the TP=4 cases then skip):
# `pytest -m multigpu` (fp32 TP=2/4 tokens == TP=1 on NCCL for GPT and hybrid checkpoints,
# speculative decoding under TP=2 / EP=2: `-k multigpu_speculative -s` prints VERDICT lines,
# bf16 TP runs finish like TP=1). Logs go to ${OUT:-gpu_out}.
# pyzmq is not installed on the GPU machines: fetch its wheel here with
# `bash /work/shared/tools/device_wheels.sh` (writes ./.whl) and carry ".whl" with the run.
# Usage: bash scripts/multigpu_validation.sh [extra pytest args]
# Each test spawns its ranks and compiles its kernels (~30-130 s): the whole suite takes longer
# than one 10-minute device call, so pass a file or -k selection per call.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# No NVLink multicast in any process (it can take the shared host down); children inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
out="${OUT:-gpu_out}"; mkdir -p "$out"
if ! python -c "import zmq" 2>/dev/null; then
  if ! ls "$root"/.whl/*.whl > /dev/null 2>&1; then
    echo "pyzmq is missing and $root/.whl has no wheels (run device_wheels.sh and carry .whl)" | tee "$out/multigpu_tests.log"
    exit 2
  fi
  python -m pip install -q --no-index --no-deps --target /tmp/site "$root"/.whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# prepend (never overwrite) so the wheel dir stays visible to the spawned ranks
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L > "$out/gpus.txt" 2>&1
cd "$root"
timeout 560 python -m pytest -q -p no:cacheprovider -m multigpu tests -rs "$@" > "$out/multigpu_tests.log" 2>&1
rc=$?
tail -30 "$out/multigpu_tests.log"
exit $rc
