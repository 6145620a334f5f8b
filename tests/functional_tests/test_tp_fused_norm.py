"""The fused TP all-reduce + residual add + RMSNorm wired end to end on CPU: 2 gloo ranks whose
reducer is the gathered-peers stand-in (tests/helpers/gathered_peers_reducer.py: the
real Triton kernel in the interpreter, peers' buffers = all-gathered partials). float32 greedy
tokens equal the single-process model's, the fused kernel really ran (attention, MLP and Mamba2
output projections), and ``tp_fused_norm=False`` never calls it. The GPU version (real P2P
buffers and barrier, CUDA graphs): tests/functional_tests/test_multigpu_p2p_all_reduce.py."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (the spawned ranks import this first)
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter test; on GPUs see *_multigpu_*")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402

CONFIG = dict(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=16, max_sequence_length=64)
PROMPTS = [[3, 17, 42, 9, 100, 7], [25, 1, 2], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=5, ignore_eos=True)


def _worker(rank: int, world: int, ckpt: str, fused: bool) -> dict:
    import megatron_async.llm as llm_module
    from tests.helpers.gathered_peers_reducer import attach_gathered_peers_reducer

    llm_module.with_p2p_all_reduce = attach_gathered_peers_reducer
    llm = LLM(ckpt, inference_config=InferenceConfig(**CONFIG, tp_fused_norm=fused), tensor_parallel_size=world)
    try:
        tokens = [o.generated_tokens for o in llm.generate(PROMPTS, GREEDY)]
        reducer = llm.parallel.tp_reducer
        return {"tokens": tokens, "fused_calls": reducer.calls["fused_norm"] if reducer else 0}
    finally:
        llm.close()


def _check(ckpt: str, row_parallel_outputs_per_forward: int, knobs: tuple[bool, ...] = (True,)) -> None:
    reference = LLM(ckpt, inference_config=InferenceConfig(**CONFIG))
    expected = [o.generated_tokens for o in reference.generate(PROMPTS, GREEDY)]
    for fused in knobs:
        ranks = run_ranks(_worker, 2, ckpt, fused, timeout_s=240)
        for rank, got in enumerate(ranks):
            assert got["tokens"] == expected, (fused, rank)
            if fused:  # every forward fuses every mixer's output all-reduce (>= 5 forwards: 1 prefill + 4 decodes)
                assert got["fused_calls"] >= 5 * row_parallel_outputs_per_forward
                assert got["fused_calls"] % row_parallel_outputs_per_forward == 0
            else:
                assert got["fused_calls"] == 0


def test_gpt_fused_norm_tokens_equal_tp1(tmp_path):
    ckpt = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt", num_attention_heads=4, num_key_value_heads=2)
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(ckpt).num_hidden_layers
    _check(str(ckpt), 2 * layers, knobs=(True, False))  # o_proj and down_proj of every layer


def test_hybrid_fused_norm_tokens_equal_tp1(tmp_path):
    """NemotronH "M*M-": Mamba2 out_proj, attention o_proj, MLP down_proj (float32 residual off)."""
    ckpt = make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "ckpt")
    _check(str(ckpt), 4)
