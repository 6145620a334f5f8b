"""Exact rollout log-probs (CPU, Triton interpreter, tiny Qwen3): in batch-invariant mode the
log-probs of a request's generated tokens equal, bit for bit, the prompt log-probs of scoring its
full sequence (prompt + output) afterwards, in a busy launch-ahead batch with chunked prefill.
In the default mode they differ by float32 rounding only (the bound below)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter test; on a GPU see *_gpu.py")

from megatron_async import SamplingParams  # noqa: E402

from tests.helpers.engine_harness import make_llm, random_prompts  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

VOCAB = 256


def rollouts_and_rescores(llm, prompts):
    """Sampled / greedy rollouts with log-probs, then their full sequences scored in one batch:
    (generated log-probs, the scores of the same positions) per request."""
    params = [SamplingParams(temperature=0.9, seed=i, num_tokens_to_generate=3, ignore_eos=True, return_log_probs=True)
              if i % 2 else SamplingParams(top_k=1, num_tokens_to_generate=3, ignore_eos=True, return_log_probs=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    seqs = [o.prompt_tokens + o.generated_tokens for o in outs]
    scores = llm.generate(seqs, SamplingParams(num_tokens_to_generate=0, return_prompt_log_probs=True))
    return [(o.generated_log_probs, s.prompt_log_probs[len(o.prompt_tokens) - 1:]) for o, s in zip(outs, scores)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """2 query heads on 1 KV head: fewer interpreted attention programs than the suite's 4 on 2."""
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"), num_attention_heads=2,
                                num_key_value_heads=1)


def test_batch_invariant_rollout_log_probs_equal_rescoring_bit_for_bit(ckpt):
    prompts = random_prompts(2, 5, 8, VOCAB, seed=11)
    llm = make_llm(ckpt, batch_invariant=True, max_tokens=8, max_requests=4, async_scheduling=True)
    pairs = rollouts_and_rescores(llm, prompts)
    for generated, rescored in pairs:
        assert len(generated) == len(rescored) == 3
        assert generated == rescored  # bit for bit
    st = llm.engine.stats
    assert st.overlapped_steps > 0 and st.prefill_steps >= 3  # launch-ahead, rescoring chunked


def test_default_mode_difference_is_rounding(ckpt):
    prompts = random_prompts(4, 6, 30, VOCAB, seed=11)
    pairs = rollouts_and_rescores(make_llm(ckpt, max_tokens=16, async_scheduling=True), prompts)
    diff = max(abs(a - b) for g, r in pairs for a, b in zip(g, r))
    print(f"default mode: largest |generated - rescored| log-prob difference {diff:.3e}")
    assert diff < 1e-5, diff
