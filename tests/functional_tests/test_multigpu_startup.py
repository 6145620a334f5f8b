"""Start-up of two ranks on 2 GPUs (``pytest -m multigpu``), data-parallel engines under expert
parallelism and TP=2: each rank captures its shapes dry (EP: the collective graph plan, the
exchange stood in for; TP: the memory profile's and the warm-up's shapes, TP collectives inside
captures that are thrown away), the two ranks split the recorded Triton builds (fresh cache
directory: every kernel compiled here), and the real graph captures after it build nothing (the
dry pass met every specialization they launch) and run no step eagerly first. The engines then
serve the tokens one engine serves (fp32), with no build or capture while serving. The build
rows of the start-up report name the split."""
from __future__ import annotations

import pytest
import torch

from megatron_async import LLM, InferenceConfig
from tests.functional_tests.test_data_parallel_engines import CONFIG, GREEDY, PROMPTS
from tests.helpers.multiprocess import run_ranks

pytestmark = pytest.mark.multigpu

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "LOCAL_WORLD_SIZE": "2"}


def _worker(rank: int, world: int, layout: str) -> dict:
    """``layout``: "ep" (data-parallel engines, the tiny MoE) or "tp" (TP=world, the tiny GPT, build threads asked)."""
    if layout == "ep":
        llm = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model="tiny-moe",
                  expert_parallel_size=world, device="cuda")
    else:
        llm = LLM(None, inference_config=InferenceConfig(**CONFIG, startup_build_threads=4), default_model="tiny",
                  tensor_parallel_size=world, device="cuda")
    try:
        phases = llm.startup.phases
        out = [o.generated_tokens for o in llm.generate(PROMPTS[:4], GREEDY[:4])]  # every rank serves; rank 0 reports
        st, graphs = llm.engine.stats, llm.runner.graphs
        return {"graphs": (len(graphs.graphs), graphs.captures_without_eager_run, graphs.capture_retries),
                "prebuild": vars(phases["kernel builds"]) if "kernel builds" in phases else None,
                "eager": vars(phases["eager steps"]), "captures": vars(phases["graph captures"]), "out": out,
                "late": (st.triton_builds_after_warmup, st.graph_captures_after_warmup)}
    finally:
        llm.close()


@pytest.mark.parametrize("layout,model", [("ep", "tiny-moe"), ("tp", "tiny")])
def test_two_ranks_build_once_per_host_and_capture_without_eager_runs(tmp_path, layout, model):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    ranks = run_ranks(_worker, 2, layout, timeout_s=400, env={**NCCL_ENV, "TRITON_CACHE_DIR": str(tmp_path)})
    for rank, r in enumerate(ranks):
        pre = r["prebuild"]
        assert pre is not None and pre["builds"] > 0 and f"rank {rank} of 2 on this host built" in pre["note"], pre
        assert "0 steps" in r["eager"]["note"], r["eager"]
        assert r["captures"]["builds"] == 0, f"rank {rank}: the graph captures met kernels the dry pass did not"
        assert r["late"] == (0, 0)
        # after the whole dry pass every graph but the first sampling tail and its forward (they
        # make the pool) captured without its eager run, and none had to be captured again
        n = r["graphs"][0]
        assert n > 2 and r["graphs"] == (n, n - 2, 0), r["graphs"]
    assert ranks[0]["out"] == ranks[1]["out"]
    one = LLM(None, inference_config=InferenceConfig(**CONFIG), default_model=model, device="cuda")
    try:
        assert ranks[0]["out"] == [o.generated_tokens for o in one.generate(PROMPTS[:4], GREEDY[:4])]
    finally:
        one.close()
