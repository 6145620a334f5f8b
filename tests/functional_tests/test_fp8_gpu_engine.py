"""The FP8 engine on the GPU: weights quantized at load on the GPU are the CPU's bits and its Triton
kernels give the CPU emulation's log-probs (float32, a tiny checkpoint); with FP8 weights (and the
e4m3 KV cache) launch-ahead == serial token for token with CUDA graphs on and off; in
batch-invariant mode eager, launch-ahead and graphs give the same bits, and a request alone those
it gets in a busy batch (built-in qwen3-0.6b shape, bf16).

    python -m pytest -q -m gpu tests/functional_tests/test_fp8_gpu_engine.py"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.hf_models import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 151936
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=512)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).cpu()


def test_gpu_kernels_match_the_cpu_emulation(tmp_path):
    ckpt = str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "m", **SHAPE))
    cfg = dict(block_size_tokens=16, num_kv_blocks=64, max_requests=4, max_tokens=256, max_sequence_length=256)
    prompts = [[random.Random(i).randrange(512) for _ in range(40 + 30 * i)] for i in range(4)]
    sp = SamplingParams(top_k=1, num_tokens_to_generate=16, ignore_eos=True, return_log_probs=True,
                        return_prompt_log_probs=True)
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(ckpt, device=device, dtype="float32", inference_config=InferenceConfig(**cfg), quantization="fp8")
        runs[device] = ({n: _bits(p) for n, p in llm.model.named_parameters()}, llm.generate(prompts, [sp] * 4))
        del llm
    for name, bits in runs["cpu"][0].items():
        assert torch.equal(runs["cuda"][0][name], bits), name
    for a, b in zip(runs["cpu"][1], runs["cuda"][1]):
        assert a.prompt_log_probs == pytest.approx(b.prompt_log_probs, abs=2e-3)
        same = next((i for i, (x, y) in enumerate(zip(a.generated_tokens, b.generated_tokens)) if x != y), 16)
        assert same >= 8 and a.generated_log_probs[:same] == pytest.approx(b.generated_log_probs[:same], abs=2e-3)


def _workload(n: int = 48):
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(100, 900))] for _ in range(n)]
    params = [SamplingParams(top_k=1, num_tokens_to_generate=rng.randint(8, 32), ignore_eos=True, return_log_probs=True)
              if i % 2 else SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, num_tokens_to_generate=24,
                                           ignore_eos=True, return_log_probs=True) for i in range(n)]
    return prompts, params


def _run(prompts, params, alone=(), **cfg):
    """Outputs (tokens, log-probs) of the batch, then of the ``alone`` requests re-run one by one on
    the same engine, and the engine's stats."""
    base = dict(max_requests=64, max_tokens=2048, max_sequence_length=1024, buffer_size_gb=8.0)
    llm = LLM(None, device="cuda", dtype="bfloat16", inference_config=InferenceConfig(**{**base, **cfg}),
              default_model="qwen3-0.6b", quantization="fp8")
    outs = [(o.generated_tokens, o.generated_log_probs) for o in llm.generate(prompts, params)]
    for i in alone:
        o = llm.generate([prompts[i]], params[i])[0]
        outs.append((o.generated_tokens, o.generated_log_probs))
    stats = llm.engine.stats
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs, stats


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_async_equals_serial_in_fp8(cuda_graphs):
    """FP8 weights and the e4m3 KV cache."""
    prompts, params = _workload()
    serial, _ = _run(prompts, params, async_scheduling=False, cuda_graphs=cuda_graphs, kv_cache_dtype="fp8_e4m3")
    launched, stats = _run(prompts, params, cuda_graphs=cuda_graphs, kv_cache_dtype="fp8_e4m3")
    assert stats.overlapped_decode_steps > 0
    assert [t for t, _ in launched] == [t for t, _ in serial]


def test_batch_invariant_fp8_graphs_eager_and_alone():
    prompts, params = _workload()
    inv = dict(batch_invariant=True, kv_cache_dtype="fp8_e4m3")
    reference, _ = _run(prompts, params, async_scheduling=False, cuda_graphs=False, **inv)
    alone = (0, 7, 30)
    for mode in (dict(cuda_graphs=True), dict(cuda_graphs=True, max_tokens=512)):
        got, _ = _run(prompts, params, alone=alone, **inv, **mode)
        assert got[:len(prompts)] == reference, mode
        assert got[len(prompts):] == [reference[i] for i in alone], mode
