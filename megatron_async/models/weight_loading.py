"""Copy Hugging Face-named tensors into a model's parameters, with errors that name every
missing, unexpected, duplicated or mis-shaped tensor."""
from __future__ import annotations

from typing import Callable, Iterable, Union

import torch

Target = Union[torch.Tensor, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]
"""A parameter (slice) to fill, or (parameter slice, function taking this tensor-parallel
rank's share of the full HF tensor)."""


def name_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


@torch.no_grad()
def copy_hf_weights(
    targets: dict[str, Target],
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: Callable[[str], bool],
    canonical: Callable[[str], str] = lambda name: name,
    what: str = "checkpoint",
) -> None:
    """``targets``: HF name -> the parameter (slice) it fills. ``skip(name)`` drops tensors the
    model does not need (checked on the stored name); ``canonical`` maps accepted spellings
    onto the target names."""
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        name = canonical(name)
        target = targets.get(name)
        if target is None:
            unexpected.append(name)
            continue
        if isinstance(target, tuple):
            target, take = target
            tensor = take(tensor)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        if name in loaded:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        target.copy_(tensor)
        loaded.add(name)
    problems = []
    missing = sorted(set(targets) - loaded)
    if missing:
        problems.append(f"missing tensors: {name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {name_list(sorted(unexpected))}")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
