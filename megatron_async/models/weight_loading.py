"""The Hugging Face name mapping of every model: each HF tensor name -> (parameter, shard_id),
declared by the model's module paths (``hf_prefixes``) and ``STACKED_PARAMS``; checkpoints load
through the one slab loader (``slab_loading.py``), which cuts this rank's boxes out of each full
tensor. Errors name every missing, unexpected, duplicated or mis-shaped tensor. The Megatron-Core
names of the same tensors are declared beside this, per architecture (``megatron_tables.py``)."""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch
from torch import nn

from megatron_async.models.slab_loading import Slab, WeightPlan

HFTarget = tuple[nn.Parameter, Hashable]
"""(parameter, shard_id): where one HF tensor goes."""

STACKED_PARAMS: dict[str, tuple[tuple[str, Hashable], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}
"""Our fused module name -> the HF modules stacked into it, with their shard ids (nano-vllm's
``packed_modules_mapping``). Every other module keeps its HF name."""


def hf_targets(model: nn.Module, hf_prefixes: dict[str, str]) -> dict[str, HFTarget]:
    """Every HF tensor name the model needs -> (parameter, shard_id). ``hf_prefixes`` maps our
    module paths (``"blocks.3.mixer"``) to the HF module path they stand for
    (``"model.layers.1.self_attn"``); below that, names follow HF except ``STACKED_PARAMS`` and
    parameters that list their own ``hf_names`` (relative to their module's parent: expert
    weights, ``experts.gate_up_proj.weight`` -> ``experts.<e>.gate_proj.weight`` ...)."""
    targets: dict[str, HFTarget] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            ours = ".".join(parts[:cut])
            if ours in hf_prefixes:
                break
        else:
            raise KeyError(f"parameter {name!r} has no Hugging Face name")
        rest = parts[cut:]
        hf = [p for p in (hf_prefixes[ours],) if p]
        hf_names = getattr(param, "hf_names", None)
        if hf_names is not None:  # e.g. expert weights: one HF tensor per (expert, part)
            for suffix, shard_id in hf_names:
                targets[".".join(hf + rest[:-2] + [suffix])] = (param, shard_id)
        elif rest[0] in STACKED_PARAMS:
            for hf_module, shard_id in STACKED_PARAMS[rest[0]]:
                targets[".".join(hf + [hf_module, *rest[1:]])] = (param, shard_id)
        else:
            targets[".".join(hf + rest)] = (param, None)
    return targets


@torch.no_grad()
def load_hf_weights(
    targets: dict[str, HFTarget],
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: Callable[[str], bool],
    canonical: Callable[[str], str] = lambda name: name,
    what: str = "checkpoint",
    model: nn.Module | None = None,
) -> None:
    """Fill ``targets`` from (HF name, full tensor) pairs, one at a time, through the slab
    loader (``slab_loading.WeightPlan.stream``). ``skip(name)`` drops tensors the model does
    not need (checked on the stored name); ``canonical`` maps accepted spellings onto the
    target names. ``model``: for the loader's hooks (``check_weight_names``, ``finalize_weights``).
    Raises ValueError naming every missing, unexpected, duplicated or mis-shaped tensor."""
    plan = WeightPlan(model, require_all=True, what=what, targets=targets, skip=skip, canonical=canonical)
    copied = plan.stream(Slab.full(name, tensor) for name, tensor in weights)
    plan.finish(copied)
