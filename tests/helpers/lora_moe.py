"""Random PEFT-named adapters of the built-in ``tiny-moe`` model (routed experts named per expert,
``model.layers.0.mlp.experts.5.gate_proj``, as PEFT saves them for Qwen3-MoE / Mixtral), and the
reference they are checked against: the same engine model with the adapter merged into its weights."""
from __future__ import annotations

import torch

from megatron_async import LLM, InferenceConfig

CONFIG = dict(block_size_tokens=4, num_kv_blocks=256, max_requests=16, max_tokens=64, max_sequence_length=256)


def tiny_moe(device: str = "cpu", dtype: str = "float32", expert_parallel_size: int = 1, **cfg) -> LLM:
    return LLM(None, device=device, dtype=dtype, default_model="tiny-moe", expert_parallel_size=expert_parallel_size,
               inference_config=InferenceConfig(**{**CONFIG, **cfg}))


def expert_adapter(llm: LLM, r: int, alpha: float, seed: int, include, use_rslora: bool = False,
                   std: float = 0.5) -> tuple[dict, dict]:
    """(PEFT config, PEFT-named tensors) of rank ``r`` on the modules of ``llm``'s adapter targets
    for which ``include(module)`` holds."""
    gen = torch.Generator().manual_seed(seed)
    tensors, modules = {}, set()
    for module, target in sorted(llm.engine.context.lora.targets.items()):
        if include(module):
            modules.add(module.rsplit(".", 1)[-1])
            shape_a, shape_b = target.slots.full_shapes(target.part, r)
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(shape_a, generator=gen) * std
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(shape_b, generator=gen) * std
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": use_rslora,
           "target_modules": sorted(modules)}
    return cfg, tensors


@torch.no_grad()
def merge_into(llm: LLM, adapter: tuple[dict, dict]) -> LLM:
    """``llm``'s model with ``adapter`` merged into its weights (W += scale * B @ A), cut into the
    stacked and per-expert parameters as the checkpoint loader cuts the HF tensors."""
    from megatron_async.models.lora.peft_format import AdapterConfig, pair_tensors

    cfg, tensors = adapter
    weights = pair_tensors(tensors, AdapterConfig.from_dict(cfg))
    targets = llm.model.hf_targets()
    for module, (a, b) in weights.modules.items():
        param, shard_id = targets[f"{module}.weight"]
        delta = (weights.config.scaling * (b.double() @ a.double())).to(param.dtype)
        for dest in param.sharding.destinations(param.data, shard_id):
            dest.view.add_(delta[tuple(slice(lo, hi) for lo, hi in zip(dest.box.lo, dest.box.hi))].to(dest.view.device))
    return llm
