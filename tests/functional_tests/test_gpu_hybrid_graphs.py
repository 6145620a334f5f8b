"""CUDA: CUDA graphs of a hybrid model (NemotronH-shaped, float32, Triton attention and Mamba
kernels) under staggered arrivals with chunked prefill, in every graph mode (decode graphs only,
mixed-step graphs serial and launch-ahead, and eager launch-ahead): tokens equal eager serial's,
mixed graphs replay, 0 builds / captures after the startup warm-up. The tiny CPU-test model, and
the 8-layer launch-bound one at 48 requests and 256-token steps. The timing table is ``python -m
benchmarks engine-times hybrid-graphs``. Skipped without a GPU."""
import pytest

from tests.helpers.hybrid_graph_runs import MODES, REFERENCE, arrivals, checkpoint, failures, run_mode, vocab_size

pytestmark = pytest.mark.gpu
SIZES = {"tiny": dict(requests=24, max_tokens=64), "small": dict(requests=48, max_tokens=256)}


@pytest.fixture(scope="module", params=list(SIZES))
def eager(request, tmp_path_factory):
    """(checkpoint, workload, step budget, the eager serial run)."""
    size = request.param
    path = checkpoint(size, tmp_path_factory.mktemp(f"nh_{size}"))
    work = arrivals(SIZES[size]["requests"], vocab_size(size))
    max_tokens = SIZES[size]["max_tokens"]
    return path, work, max_tokens, run_mode(path, work, *MODES[REFERENCE], max_tokens=max_tokens)


@pytest.mark.parametrize("mode", [m for m in MODES if m != REFERENCE])
def test_graph_modes_equal_eager_without_captures_after_warmup(eager, mode):
    path, work, max_tokens, reference = eager
    got = run_mode(path, work, *MODES[mode], max_tokens=max_tokens)
    assert not failures(mode, got, reference), got["stats"].as_dict()
