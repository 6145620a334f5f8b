"""Structured outputs on CUDA: the token-mask kernel at Qwen3's vocabulary equals the torch
reference; the built-in tiny model with its tokenizer, CUDA graphs on (the default, warm-up
included): steps with grammar rows replay logits-only graphs captured at warm-up, outputs match
their specs, launch-ahead == serial == eager token for token. Skipped without a GPU."""
import pytest
import torch

from megatron_async import LLM, InferenceConfig
from megatron_async.inference.structured.request_grammar import bitmask_words
from megatron_async.kernels.token_mask import apply_token_bitmask
from tests.functional_tests.test_structured_engine import arrivals, check_output
from tests.helpers.engine_harness import count_replays_by_variant, run_arrivals, tokens_of

pytestmark = pytest.mark.gpu
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mask_kernel_equals_reference_at_qwen_vocab(dtype):
    V, S = 151_936, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (S, bitmask_words(V)), generator=g, device="cuda",
                            dtype=torch.int64).to(torch.int32)
    row_map = torch.arange(S, device="cuda", dtype=torch.int32)
    row_map[::3] = -1
    logits = torch.randn(S, V, generator=g, device="cuda").to(dtype)
    assert torch.equal(apply_token_bitmask(logits, bitmask, row_map, triton=True),
                       apply_token_bitmask(logits, bitmask, row_map))


def _run(async_scheduling: bool, graphs: bool, every: int):
    cfg = InferenceConfig(block_size_tokens=16, max_requests=16, max_tokens=256, max_sequence_length=512,
                          num_kv_blocks=200, async_scheduling=async_scheduling, cuda_graphs=graphs)
    llm = LLM(None, device="cuda", inference_config=cfg)
    replays = count_replays_by_variant(llm.runner.graphs) if graphs else None
    arr = arrivals(llm, 16, constrained_every=every)
    return arr, run_arrivals(llm, arr), llm, replays


@pytest.mark.parametrize("every", [1, 4])
def test_constrained_launch_ahead_equals_serial_and_eager_on_cuda(every):
    arr, graph_async, llm, replays = _run(True, True, every)
    for i, a in enumerate(arr):
        if a.params.structured_outputs is not None:
            check_output(a.params.structured_outputs, graph_async[i])
    st = llm.engine.stats
    assert replays["logits"] > 0 and st.graph_captures_after_warmup == 0, (replays, st.as_dict())
    assert st.overlapped_decode_steps > 0.8 * st.decode_steps and st.grammar_steps > 0, st.as_dict()
    _, graph_serial, _, _ = _run(False, True, every)
    _, eager_async, _, _ = _run(True, False, every)
    assert tokens_of(graph_async) == tokens_of(graph_serial) == tokens_of(eager_async)
