"""Exact rollout log-probs on the GPU (bf16, built-in qwen3-0.6b shape, CUDA graphs, launch-ahead):
in batch-invariant mode the log-probs of every generated token equal, bit for bit, the prompt
log-probs of scoring the request's full sequence afterwards; the default mode's largest
difference is printed.

    python -m pytest -q -s -m gpu tests/functional_tests/test_rollout_log_probs_gpu.py"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams

pytestmark = pytest.mark.gpu

VOCAB = 151936
NUM = 32


def _llm(**cfg) -> LLM:
    base = dict(max_requests=NUM, max_tokens=1024, max_sequence_length=2048, buffer_size_gb=8.0,
                async_scheduling=True, cuda_graphs=True)
    base.update(cfg)
    return LLM(None, device="cuda", dtype="bfloat16", inference_config=InferenceConfig(**base),
               default_model="qwen3-0.6b")


def _rollouts_and_rescores(llm: LLM):
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(50, 700))] for _ in range(NUM)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, num_tokens_to_generate=rng.randint(8, 40),
                             ignore_eos=True, return_log_probs=True) if i % 2 else
              SamplingParams(top_k=1, num_tokens_to_generate=rng.randint(8, 40), ignore_eos=True,
                             return_log_probs=True) for i in range(NUM)]
    outs = llm.generate(prompts, params)
    seqs = [o.prompt_tokens + o.generated_tokens for o in outs]
    scores = llm.generate(seqs, SamplingParams(num_tokens_to_generate=0, return_prompt_log_probs=True))
    return [(o.generated_log_probs, s.prompt_log_probs[len(o.prompt_tokens) - 1:]) for o, s in zip(outs, scores)]


def _release(llm: LLM) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_batch_invariant_rollouts_equal_rescoring_bit_for_bit():
    llm = _llm(batch_invariant=True)
    pairs = _rollouts_and_rescores(llm)
    st = llm.engine.stats
    assert llm.runner.graphs.num_replays > 0 and st.overlapped_steps > 0
    same = sum(g == r for g, r in pairs)
    diff = max(abs(a - b) for g, r in pairs for a, b in zip(g, r))
    print(f"batch-invariant: {same}/{NUM} requests bit-identical, largest difference {diff:.3e}")
    _release(llm)
    assert same == NUM


def _mean_gap(pairs, shift: int) -> float:
    """Mean |generated[k] - rescored[k + shift]| over every request's positions that both have."""
    gaps = [abs(g[k] - r[k + shift]) for g, r in pairs for k in range(len(g)) if 0 <= k + shift < len(r)]
    return sum(gaps) / len(gaps)


def test_default_mode_largest_difference():
    """Without batch invariance the two differ by the rounding of bf16 GEMMs of other shapes:
    compared position by position, each generated token's log-prob is far closer to its own
    rescored position than to a neighbour's (a one-position shift moves greedy rows by
    0.26-0.32), and no difference reaches the smallest such move."""
    llm = _llm()
    pairs = _rollouts_and_rescores(llm)
    diff = max(abs(a - b) for g, r in pairs for a, b in zip(g, r))
    same = sum(g == r for g, r in pairs)
    own, shifted = _mean_gap(pairs, 0), min(_mean_gap(pairs, -1), _mean_gap(pairs, 1))
    print(f"default mode (bf16, graphs, launch-ahead): {same}/{NUM} requests bit-identical, "
          f"largest |generated - rescored| {diff:.3e}, mean {own:.3e} (one position off: {shifted:.3e})")
    _release(llm)
    assert all(len(g) == len(r) for g, r in pairs)
    assert own < shifted / 4, (own, shifted)
    assert diff < 0.25, diff


def test_bf16_prompt_log_probs_against_hf_float32(tmp_path):
    """The bf16 engine's prompt log-probs against HF's float32 teacher-forced log_softmax of the
    same (tiny, random) checkpoint: prints the largest difference."""
    from tests.helpers.hf_models import hf_logits, load_hf_reference, make_tiny_checkpoint

    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt")
    ref = load_hf_reference(path)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    llm = LLM(str(path), device="cuda", dtype="bfloat16", inference_config=InferenceConfig(
        max_requests=8, max_tokens=128, max_sequence_length=512, num_kv_blocks=1024, async_scheduling=True,
        cuda_graphs=True))
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=4, return_prompt_log_probs=True))
    diff = 0.0
    for p, o in zip(prompts, outs):
        lp = torch.log_softmax(hf_logits(ref, p), dim=-1)[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0]
        diff = max(diff, (torch.tensor(o.prompt_log_probs) - lp).abs().max().item())
    print(f"bf16 prompt log-probs vs HF float32: largest difference {diff:.3e}")
    _release(llm)
    assert diff < 0.25  # measured 0.118 on an H100: bf16 weights and GEMMs against float32, not a wrong position
