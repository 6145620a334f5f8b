"""Kernel backends belong to a model, not to the process: two LLMs built in one process with
different attention / Mamba backends each run their own kernels (counted at the kernel entry
points), also after the other one was built, and give the same tokens."""
from __future__ import annotations

import collections
import os

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the engines run on the CPU: the Triton backends need the interpreter (tests/conftest.py sets it "
           "without CUDA; on a CUDA box the GPU tests cover the compiled kernels)")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.config import AttentionBackend, MambaBackend  # noqa: E402
from megatron_async.kernels import (  # noqa: E402
    attention_torch,
    attention_triton,
    ssd_torch,
    triton_mamba_decode,
    triton_ssd_varlen,
)
from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint  # noqa: E402

CFG = dict(max_requests=4, max_tokens=32, num_kv_blocks=32, max_sequence_length=64, async_scheduling=False)
PARAMS = SamplingParams(top_k=1, num_tokens_to_generate=3, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [3, 4]]


def _count_calls(monkeypatch, functions) -> collections.Counter:
    calls = collections.Counter()
    for module, name in functions:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **kw: calls.update([_name]) or _real(*a, **kw))
    return calls


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.generated_tokens for o in llm.generate(PROMPTS, PARAMS)]


def test_two_llms_run_their_own_attention_kernels(monkeypatch):
    calls = _count_calls(monkeypatch, [(attention_torch, "mixed_attention"), (attention_torch, "decode_attention"),
                                       (attention_triton, "attend")])
    torch_llm = LLM(inference_config=InferenceConfig(attention_backend="torch", **CFG))
    triton_llm = LLM(inference_config=InferenceConfig(attention_backend="triton", **CFG))  # built last
    assert torch_llm.model.kernels.attention == AttentionBackend.TORCH
    assert triton_llm.model.kernels.attention == AttentionBackend.TRITON
    ref = _tokens(torch_llm)
    assert calls["attend"] == 0 and calls["mixed_attention"] > 0 and calls["decode_attention"] > 0
    calls.clear()
    assert _tokens(triton_llm) == ref
    assert calls["attend"] > 0 and calls["mixed_attention"] == calls["decode_attention"] == 0
    calls.clear()
    assert _tokens(torch_llm) == ref  # the model built first still runs its own kernels
    assert calls["attend"] == 0 and calls["mixed_attention"] > 0


def test_two_hybrid_llms_run_their_own_mamba_kernels(monkeypatch, tmp_path):
    path = str(make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "nh"))
    calls = _count_calls(monkeypatch, [(ssd_torch, "ssd_step"), (ssd_torch, "ssd_chunked"),
                                       (triton_mamba_decode, "selective_state_update"),
                                       (triton_ssd_varlen, "ssd_scan_varlen")])
    torch_llm = LLM(path, inference_config=InferenceConfig(mamba_backend="torch", **CFG))
    triton_llm = LLM(path, inference_config=InferenceConfig(mamba_backend="triton", **CFG))
    assert torch_llm.model.kernels.mamba == MambaBackend.TORCH
    assert triton_llm.model.kernels.mamba == MambaBackend.TRITON
    reference = ("ssd_step", "ssd_chunked")
    kernels = ("selective_state_update", "ssd_scan_varlen")
    ref = _tokens(torch_llm)
    assert all(calls[n] > 0 for n in reference) and not any(calls[n] for n in kernels)
    calls.clear()
    assert _tokens(triton_llm) == ref
    assert all(calls[n] > 0 for n in kernels) and not any(calls[n] for n in reference)
    calls.clear()
    _tokens(torch_llm)
    assert all(calls[n] > 0 for n in reference) and not any(calls[n] for n in kernels)
