"""Megatron-Core (0.16.x) on CPU for reference tests: tiny Qwen3-shaped GPTModels (dense, MoE) with
the local layer spec and CPU initialization, in a gloo world, and the engine checkpoint of the
same shape.

Megatron-Core assumes CUDA in three spots even with ``use_cpu_initialization=True``; they are
patched only inside ``cpu_patches()``: ``torch.cuda.current_device()`` is used as a device (rotary
table, router weights, MoE counters) and returns "cpu" there; attention enters the CUDA RNG
tracker's ``fork()``, a no-op there; without Transformer-Engine ``moe_utils.te_general_gemm`` is
left undefined (the router reads it), set to None. The default causal mask is built on "cuda":
``mcore_logits`` passes an explicit boolean mask instead. Not run here (no CPU build): the
Transformer-Engine modules and the grouped-GEMM experts; their names are renamed aliases
(``te_names``) of the local spec's, as their source documents."""
from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

warnings.filterwarnings("ignore")


@contextlib.contextmanager
def cpu_patches():
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    saved_dev, saved_fork = torch.cuda.current_device, mc_random.CudaRNGStatesTracker.fork
    torch.cuda.current_device = lambda: "cpu"
    mc_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device, mc_random.CudaRNGStatesTracker.fork = saved_dev, saved_fork


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
                   max_position_embeddings=128, dtype="float32")
        if self.num_experts:
            cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=self.num_experts,
                       moe_intermediate_size=self.moe_ffn_hidden_size, num_experts_per_tok=self.top_k,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return cfg


def build_mcore(s: TinyShape, seed: int = 0):
    """This rank's shard of a Megatron-Core GPTModel (local spec), seeded on the CPU: with one
    seed every TP size's shards are slices of the same full tensors."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
              num_attention_heads=s.num_heads, num_query_groups=s.num_query_groups, kv_channels=s.head_dim,
              normalization="RMSNorm", layernorm_epsilon=s.eps, qk_layernorm=True, gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, attention_dropout=0.0,
              hidden_dropout=0.0, init_method_std=0.2, use_cpu_initialization=True, params_dtype=torch.float32,
              pipeline_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False,
              masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
              tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    if s.num_experts:
        kw.update(num_moe_experts=s.num_experts, moe_ffn_hidden_size=s.moe_ffn_hidden_size, moe_router_topk=s.top_k,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
                  moe_router_pre_softmax=False, expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    spec = get_gpt_layer_local_spec(num_experts=s.num_experts, qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(seed)
    with cpu_patches():
        model = GPTModel(config=TransformerConfig(**kw), transformer_layer_spec=spec, vocab_size=s.vocab_size,
                         max_sequence_length=128, position_embedding_type="rope", rotary_base=int(s.rope_theta),
                         share_embeddings_and_output_weights=s.tied, parallel_output=False)
    g = torch.Generator().manual_seed(seed + 1)  # norms away from 1 (the same on every rank) so a mis-mapped one shows
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("layernorm.weight", "layer_norm_weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@torch.no_grad()
def mcore_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-vocabulary fp32 logits [s, vocab] of one sequence."""
    t = torch.tensor([ids])
    pos = torch.arange(len(ids)).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool), diagonal=1)
    with cpu_patches():
        return model(t, pos, mask)[0].float()


def te_names(items: list[tuple]) -> list[tuple]:
    """The names a Transformer-Engine-spec trainer gives the same tensors: norms fused into the
    next linear, grouped experts' ``experts.linear_fc1.weight{j}``."""
    out = []
    for name, *rest in items:
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            j, part = tail.split(".", 1)
            name = f"{head}.{part}{j}"
        out.append((name, *rest))
    return out


def write_engine_checkpoint(s: TinyShape, path: Path, seed: int = 99) -> Path:
    """An HF checkpoint of the same shape with unrelated random weights (config.json + safetensors)."""
    from megatron_async.models.default_model import random_hf_tensors
    from megatron_async.models.gpt import build_gpt

    path.mkdir(parents=True, exist_ok=True)
    cfg = s.hf_config()
    shapes = build_gpt(cfg, torch.float32, "meta").hf_shapes()
    tensors = dict(random_hf_tensors(shapes, torch.float32, torch.device("cpu"), 0.2, seed))
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path



def mcore_rank(rank: int, world: int, s: TinyShape, tp: int, ep: int, te: bool, prompt: list[int]):
    """One rank of a Megatron-Core job (run_ranks): its (name, array, Shard) items as
    ``megatron_async.weight_transfer.megatron_tensors`` reads them, and its gathered logits
    (numpy: they travel by value, the rank may exit before they are read)."""
    from megatron_async.weight_transfer import megatron_tensors

    init_world(rank, world, tp, ep)
    model = build_mcore(s, seed=3)
    items = [(n, t.numpy().copy(), shard) for n, t, shard in megatron_tensors(model)]
    return te_names(items) if te else items, mcore_logits(model, prompt).numpy()
