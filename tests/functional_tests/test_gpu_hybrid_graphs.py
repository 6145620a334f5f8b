"""CUDA: mixed-step graphs of a hybrid model (tiny NemotronH, float32, Triton attention and Mamba
kernels) under staggered arrivals with chunked prefill: tokens equal eager (serial and
launch-ahead), mixed graphs replay, 0 builds / captures after the startup warm-up. The timing
table is scripts/gpu_check.py hybrid-graphs (this test runs its functions). Skipped without a GPU."""
import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
SCRIPT = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks" / "hybrid_graphs.py"))


def test_hybrid_mixed_graphs_equal_eager_without_captures_after_warmup(tmp_path):
    from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

    path = str(make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "nh"))
    work = SCRIPT["arrivals"](24, 128)
    eager = SCRIPT["run_mode"](path, work, graphs=False, mixed=False, async_scheduling=False, max_tokens=64)
    for async_scheduling in (False, True):
        got = SCRIPT["run_mode"](path, work, graphs=True, mixed=True, async_scheduling=async_scheduling, max_tokens=64)
        st = got["stats"]
        assert got["tokens"] == eager["tokens"]
        assert st.mixed_graph_replays > 0 and got["mixed_keys"] > 0, st.as_dict()
        assert st.graph_captures_after_warmup == 0 and st.triton_builds_after_warmup == 0, st.as_dict()
