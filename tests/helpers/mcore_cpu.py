"""Megatron-Core (0.16.x) on CPU for the reference tests: tiny Qwen3-shaped GPTModels (dense, MoE;
the builder and its CPU workarounds are examples/megatron_gpt.py's) in a gloo world, and an engine
checkpoint of the same shape. Not run here (no CPU build): the Transformer-Engine modules and the
grouped-GEMM experts; their names are renamed aliases (``mcore_reference.te_names``) of the local
spec's, as their source documents. The comparison itself is ``mcore_reference``'s, shared with the
GPU tests (``mcore_gpu``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from examples import megatron_gpt
from tests.helpers.mcore_reference import hf_tensors, sent_items


def init_world(rank: int, world_size: int, tp: int = 1, ep: int = 1) -> None:
    """This process as ``rank`` of a gloo world (MASTER_ADDR / MASTER_PORT set by run_ranks)."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int = 256
    hidden_size: int = 64
    ffn_hidden_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 32
    eps: float = 1e-6
    rope_theta: float = 1e6
    tied: bool = False
    num_experts: int | None = None
    moe_ffn_hidden_size: int = 48
    top_k: int = 2

    def hf_config(self) -> dict:
        cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=self.vocab_size,
                   hidden_size=self.hidden_size, intermediate_size=self.ffn_hidden_size, num_hidden_layers=self.num_layers,
                   num_attention_heads=self.num_heads, num_key_value_heads=self.num_query_groups, head_dim=self.head_dim,
                   rms_norm_eps=self.eps, rope_theta=self.rope_theta, tie_word_embeddings=self.tied,
                   max_position_embeddings=128, initializer_range=0.2, dtype="float32")
        if self.num_experts:
            cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=self.num_experts,
                       moe_intermediate_size=self.moe_ffn_hidden_size, num_experts_per_tok=self.top_k,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return cfg


def build_mcore(s: TinyShape, seed: int = 0):
    """This rank's shard of a Megatron-Core GPTModel of ``s`` (see examples/megatron_gpt.py)."""
    return megatron_gpt.build_gpt(s.hf_config(), seed).eval()


def mcore_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return megatron_gpt.logits(model, ids)


def write_engine_checkpoint(s: TinyShape, path: Path, seed: int = 99, tensors: dict | None = None) -> Path:
    """An HF checkpoint of the same shape (config.json + safetensors): ``tensors`` (HF name ->
    tensor or array, any device), or unrelated random weights."""
    from megatron_async.models.default_model import random_hf_tensors
    from megatron_async.models.gpt import build_gpt

    path.mkdir(parents=True, exist_ok=True)
    cfg = s.hf_config()
    if tensors is None:
        shapes = build_gpt(cfg, torch.float32, "meta").hf_shapes()
        tensors = dict(random_hf_tensors(shapes, torch.float32, torch.device("cpu"), 0.2, seed))
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in tensors.items()},
              str(path / "model.safetensors"))
    return path


def mcore_rank(rank: int, world: int, shapes: list[TinyShape], tp: int, ep: int, prompt: list[int]) -> list[tuple]:
    """One rank of a Megatron-Core job (run_ranks) building a model of each of ``shapes`` in turn (one
    process imports Megatron-Core once: seconds). Per shape: its (name, array, Shard) items as
    ``mcore_reference.sent_items`` reads them, its gathered logits and, in a world of one, the
    equivalent HF tensors (numpy: they travel by value, the rank may exit before they are read)."""
    init_world(rank, world, tp, ep)
    return _build_each(world, shapes, prompt)


def mcore_rank_jobs(rank: int, world: int, jobs: list[tuple[list[TinyShape], int, int]],
                    prompt: list[int]) -> list[list[tuple]]:
    """``mcore_rank`` for each (shapes, tp, ep) of ``jobs`` in turn in one gloo world, Megatron-Core's
    parallel state rebuilt for each: one process start and Megatron-Core import for them all."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = []
    for shapes, tp, ep in jobs:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        out.append(_build_each(world, shapes, prompt))
        parallel_state.destroy_model_parallel()
    return out


def _build_each(world: int, shapes: list[TinyShape], prompt: list[int]) -> list[tuple]:
    out = []
    for s in shapes:
        model = build_mcore(s, seed=3)
        items = [(n, t.numpy().copy(), shard) for n, t, shard in sent_items(model)]
        hf = {n: t.numpy().copy() for n, t in hf_tensors(model).items()} if world == 1 else None
        out.append((items, mcore_logits(model, prompt).numpy(), hf))
    return out
