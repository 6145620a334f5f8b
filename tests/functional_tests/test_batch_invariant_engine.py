"""Batch-invariant mode end to end (CPU, float32, Triton interpreter, tiny Qwen3): two probe
requests (one greedy, one sampled with top-p) give bit-identical tokens and log-probs
(chosen and top-2) alone and inside busy batches, across per-step token budgets 16 / 64 /
256 (so different prompt chunkings), prefix caching on / off, serial and launch-ahead. The
counters show the chunking, the prefix hit and the overlap really happened, and a control
run in the default mode shows the same schedule does change bits there."""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter test; on a GPU see *_gpu.py")

from megatron_async import SamplingParams  # noqa: E402

from tests.helpers.engine_harness import Arrival, make_llm, run_arrivals  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

VOCAB = 256
rng = random.Random(5)
SHARED = [rng.randrange(VOCAB) for _ in range(24)]
PROBES = [SHARED + [rng.randrange(VOCAB) for _ in range(17)], [rng.randrange(VOCAB) for _ in range(19)]]
PROBE_PARAMS = [
    SamplingParams(top_k=1, num_tokens_to_generate=5, return_log_probs=True, top_n_logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=17, num_tokens_to_generate=5, return_log_probs=True,
                   top_n_logprobs=2),
]


def _fillers(n: int, seed: int) -> list[Arrival]:
    r = random.Random(seed)
    out = [Arrival(0, SHARED + [r.randrange(VOCAB) for _ in range(3)], SamplingParams(top_k=1, num_tokens_to_generate=3))]
    for i in range(n - 1):
        prompt = [r.randrange(VOCAB) for _ in range(r.randint(5, 14))]
        out.append(Arrival(r.randint(0, 5), prompt, SamplingParams(temperature=0.7, seed=i, num_tokens_to_generate=r.randint(2, 7))))
    return out


def _run(ckpt, arrivals: list[Arrival], **cfg):
    llm = make_llm(ckpt, max_requests=8, num_kv_blocks=160, **cfg)
    outs = run_arrivals(llm, arrivals)
    return outs, llm.engine.stats


def _probe_results(outs, indices) -> list[tuple]:
    return [(o.generated_tokens, o.generated_log_probs, o.generated_top_n_logprobs)
            for o in (outs[i] for i in indices)]


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    """The suite's tiny Qwen3 with 2 query heads on 1 KV head (the same group of 2; half the
    interpreted attention programs, which scale with KV heads) and one layer (every kernel of a
    layer runs once per step; a second layer runs the same ones again)."""
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3_narrow"), num_attention_heads=2,
                                num_key_value_heads=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def alone(qwen3_ckpt):
    """Each probe alone (batch 1), serial, no prefix caching, 64 tokens per step."""
    res = []
    for prompt, sp in zip(PROBES, PROBE_PARAMS):
        outs, _ = _run(qwen3_ckpt, [Arrival(0, prompt, sp)], max_tokens=64, async_scheduling=False,
                       batch_invariant=True)
        res += _probe_results(outs, [0])
    return res


def _busy(probe_step: int, seed: int) -> tuple[list[Arrival], list[int]]:
    arrivals = _fillers(4, seed)
    probes = [Arrival(probe_step, p, sp) for p, sp in zip(PROBES, PROBE_PARAMS)]
    return arrivals + probes, [len(arrivals), len(arrivals) + 1]


@pytest.mark.parametrize("max_tokens,prefix_caching,async_scheduling", [
    (16, False, True),  # the 41-token probe is cut into >= 3 chunks, decode steps overlap
    (64, True, True),  # the first probe starts with 24 cached tokens (a filler's prefix)
    (256, True, False),  # a whole prompt per step, serial
])
def test_probe_bits_equal_alone_and_in_busy_batches(qwen3_ckpt, alone, max_tokens, prefix_caching, async_scheduling):
    arrivals, probe_idx = _busy(probe_step=3, seed=max_tokens)
    outs, stats = _run(qwen3_ckpt, arrivals, max_tokens=max_tokens, enable_prefix_caching=prefix_caching,
                       async_scheduling=async_scheduling, batch_invariant=True)
    assert _probe_results(outs, probe_idx) == alone
    assert stats.finished_requests == len(arrivals)
    if async_scheduling:
        assert stats.overlapped_steps > 0
    if max_tokens == 16:
        assert stats.prefill_steps >= len(PROBES[0]) // 16 + 1
    if prefix_caching:
        assert stats.prefix_hit_tokens >= 24  # the shared prefix: 6 whole blocks of 4


def test_default_mode_control_changes_bits(qwen3_ckpt):
    """The same kind of schedule in the default mode (torch kernels) does move the bits:
    the comparison above is not vacuous."""
    ref = []
    for prompt, sp in zip(PROBES, PROBE_PARAMS):
        outs, _ = _run(qwen3_ckpt, [Arrival(0, prompt, sp)], max_tokens=64, async_scheduling=False)
        ref += _probe_results(outs, [0])
    arrivals, probe_idx = _busy(probe_step=3, seed=16)
    outs, _ = _run(qwen3_ckpt, arrivals, max_tokens=16)
    assert _probe_results(outs, probe_idx) != ref


def test_unsupported_setups_are_rejected(monkeypatch):
    from megatron_async import LLM, InferenceConfig
    from megatron_async.model_loading import check_batch_invariant

    with pytest.raises(ValueError, match="attention \\+ MLP models only"):  # e.g. hybrid models
        check_batch_invariant(torch.nn.Linear(2, 2), torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        LLM(None, inference_config=InferenceConfig(batch_invariant=True))
