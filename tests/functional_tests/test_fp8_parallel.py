"""FP8 weights under tensor and expert parallelism on CPU (gloo): every rank keeps its slice of the
e4m3 weights and of their block scales (the slices of the single-process model's, where blocks
align), and 2 ranks generate the tokens of the single-process FP8 model. Their float32 sums differ
in order (other batch shapes per rank, partial sums all-reduced), and quantizing an activation to
e4m3 can turn a one-ulp difference into a step of 1/16: a greedy token may then flip where the
single process's top two are within NEAR_TIE of each other, and nowhere else."""
from __future__ import annotations

import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.engine_harness import assert_equal_up_to_near_ties
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.multiprocess import run_ranks

CONFIG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=16, max_sequence_length=96)
PROMPTS = [[3, 17, 42, 9, 100, 7], [250, 1, 2], [5] * 11, [60, 61, 62, 63, 64, 65, 66, 67, 68]]
GREEDY = [SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True, top_n_logprobs=4) for n in (6, 9, 4, 7)]
NEAR_TIE = 0.1
"""Log-prob gap (nats) under which two tokens count as tied: one e4m3 step moved a logit by 0.04
in the runs seen (a planted bug moves them by far more, from the first token on)."""
# hidden 256, heads 4 x 64, intermediate 512: every TP-2 K range starts on a 128 block, so a rank's
# activation groups are the single process's
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _worker(rank: int, world: int, ckpt: str | None, kind: str) -> dict:
    parallel = {"tensor_parallel_size": world} if kind == "tp" else {"expert_parallel_size": world}
    model = {"model": ckpt} if ckpt else {"default_model": "tiny-moe"}
    llm = LLM(**model, inference_config=InferenceConfig(**CONFIG), quantization="fp8", **parallel)
    try:
        vocab = llm.model.vocab_size
        tokens = [o.generated_tokens for o in llm.generate([[t % vocab for t in p] for p in PROMPTS], GREEDY)]
        params = {n: _bits(p).tolist() for n, p in llm.model.named_parameters() if p.dtype == torch.float8_e4m3fn
                  or n.endswith("weight_scale_inv")}  # plain lists: tensors would travel through shared memory
        return {"tokens": tokens, "params": params}
    finally:
        llm.close()


def _single(ckpt: str | None) -> tuple[list, dict]:
    """The single process's outputs (tokens and top-n log-probs) and parameters."""
    model = {"model": ckpt} if ckpt else {"default_model": "tiny-moe"}
    llm = LLM(**model, inference_config=InferenceConfig(**CONFIG), quantization="fp8")
    vocab = llm.model.vocab_size
    outs = llm.generate([[t % vocab for t in p] for p in PROMPTS], GREEDY)
    return outs, {n: _bits(p) for n, p in llm.model.named_parameters()}


def _ranks(ckpt: str | None, kind: str) -> list[dict]:
    out = run_ranks(_worker, 2, ckpt, kind, timeout_s=180)
    for got in out:
        got["params"] = {n: torch.tensor(v) for n, v in got["params"].items()}
    return out


def test_tp2_fp8_matches_single_process(tmp_path):
    ckpt = str(make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt", **SHAPE))
    outs, full = _single(ckpt)
    ranks = _ranks(ckpt, "tp")
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # replicas agree exactly
    for rank, got in enumerate(ranks):
        assert_equal_up_to_near_ties(outs, got["tokens"], NEAR_TIE)
        o_proj = "blocks.0.mixer.o_proj"
        assert torch.equal(got["params"][f"{o_proj}.weight"], full[f"{o_proj}.weight"][:, rank * 128:(rank + 1) * 128])
        assert torch.equal(got["params"][f"{o_proj}.weight_scale_inv"], full[f"{o_proj}.weight_scale_inv"][:, rank:rank + 1])
        gate_up = "blocks.1.mixer.gate_up_proj.weight_scale_inv"  # [gate_r | up_r]: 2 block rows each
        want = torch.cat([full[gate_up][2 * rank:2 * rank + 2], full[gate_up][4 + 2 * rank:6 + 2 * rank]])
        assert torch.equal(got["params"][gate_up], want)


def test_ep2_fp8_experts_match_single_process():
    outs, full = _single(None)
    ranks = _ranks(None, "ep")
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # every rank returns all outputs
    for rank, got in enumerate(ranks):
        assert_equal_up_to_near_ties(outs, got["tokens"], NEAR_TIE)
        for suffix in ("weight", "weight_scale_inv"):
            name = f"blocks.1.mixer.experts.gate_up_proj.{suffix}"
            assert torch.equal(got["params"][name], full[name][rank * 4:(rank + 1) * 4])  # this rank's 4 of 8 experts
