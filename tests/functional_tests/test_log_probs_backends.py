"""The engine's log-probs with the Triton sampler backend (kernels/triton_log_probs.py, run by
the interpreter on CPU) equal the torch backend's: the same tokens, chosen log-probs to float32
rounding of the log-sum-exp, and the same top-n ids."""
import os

import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.testing.engine_harness import make_llm, random_prompts


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU engine with the interpreted Triton kernels (TRITON_INTERPRET=1, set by conftest)")
def test_triton_log_probs_in_the_engine_equal_torch(qwen3_ckpt, monkeypatch):
    from megatron_async.kernels import triton_log_probs

    calls = []
    kernel = triton_log_probs.log_probs
    monkeypatch.setattr(triton_log_probs, "log_probs", lambda *a, **k: calls.append(a[2]) or kernel(*a, **k))
    prompts = random_prompts(3, 3, 10, 256, seed=31)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=4, return_log_probs=True, top_n_logprobs=5),
              SamplingParams(temperature=0.9, seed=3, num_tokens_to_generate=4, return_log_probs=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=4, num_tokens_to_generate=4, top_n_logprobs=20)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(qwen3_ckpt, sampling_backend=backend)
        outs[backend] = llm.generate(prompts, params)
        assert llm.engine.controller.sampler.backend.value == backend
    assert calls and max(calls) == 20  # the kernel served every step asking for log-probs
    for ref, got, sp in zip(outs["torch"], outs["triton"], params):
        assert got.generated_tokens == ref.generated_tokens
        if sp.return_log_probs:
            torch.testing.assert_close(torch.tensor(got.generated_log_probs), torch.tensor(ref.generated_log_probs),
                                       atol=1e-5, rtol=0)
        if sp.top_n_logprobs:
            assert len(got.generated_top_n_logprobs) == len(ref.generated_top_n_logprobs) == 4
            for g, r in zip(got.generated_top_n_logprobs, ref.generated_top_n_logprobs):
                assert list(g) == list(r) and len(g) == sp.top_n_logprobs
                torch.testing.assert_close(torch.tensor(list(g.values())), torch.tensor(list(r.values())),
                                           atol=1e-5, rtol=0)
