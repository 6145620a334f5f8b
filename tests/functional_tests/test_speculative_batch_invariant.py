"""With batch-invariant numerics a position's logits do not depend on whether it was computed
in a (k + 1)-token verify row or a 1-token decode row: speculative decoding's log-probs are
then bit-identical to plain decoding's (CPU, float32, Triton interpreter, tiny Qwen3)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter test")

from megatron_async import SamplingParams  # noqa: E402

from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals  # noqa: E402
from tests.helpers.spec_harness import oracle_for  # noqa: E402


def test_log_probs_bit_identical(qwen3_ckpt):
    params = [SamplingParams(top_k=1, num_tokens_to_generate=5, return_log_probs=True, top_n_logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, num_tokens_to_generate=5, return_log_probs=True)]
    arr = [Arrival(0, p, params[i]) for i, p in enumerate(random_prompts(2, 4, 9, 256, seed=41))]
    cfg = dict(batch_invariant=True, max_requests=4, num_kv_blocks=40)
    plain = run_arrivals(make_llm(qwen3_ckpt, **cfg), arr)
    llm = make_llm(qwen3_ckpt, oracle_for(plain, arr, 0.3), num_speculative_tokens=2,
                   speculative_min_acceptance=0.0, **cfg)
    spec = run_arrivals(llm, arr)
    for i in plain:
        assert spec[i].generated_tokens == plain[i].generated_tokens
        assert spec[i].generated_log_probs == plain[i].generated_log_probs  # bit for bit
        assert spec[i].generated_top_n_logprobs == plain[i].generated_top_n_logprobs
    st = llm.engine.stats
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st.as_dict()
