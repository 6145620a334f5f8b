"""Weights updated in place from full Hugging Face tensors (an RL trainer's named parameters, or
a checkpoint directory), through the same per-parameter loaders as loading.

Everything is checked before anything is copied (names, duplicates, shapes; a checkpoint's from
its safetensors headers), so a bad update changes nothing. Values are copied into the existing
parameter storage: device addresses stay, and captured CUDA graphs replay the new values."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from megatron_async.models.checkpoint import safetensors_files
from megatron_async.models.weight_loading import name_list
from megatron_async.parallel.sharding import default_weight_loader, full_shape


class WeightUpdateError(ValueError):
    """An update that cannot be applied; nothing was copied."""


@dataclass(frozen=True)
class _Staged:
    name: str
    param: nn.Parameter
    shard_id: Hashable


def _checkpoint_headers(path: Path) -> Iterator[tuple[str, tuple[int, ...], tuple[Path, str]]]:
    """(stored name, shape, (file, stored name)) of every tensor, read from the headers only."""
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, tuple(f.get_slice(name).get_shape()), (file, name)
        except SafetensorError as e:
            raise WeightUpdateError(f"{file} is not a readable safetensors file: {e}") from e


def _stage(model: nn.Module, named_shapes: Iterable[tuple[str, tuple[int, ...], object]]
           ) -> list[tuple[_Staged, object]]:
    """Match (HF name, full shape, source) to the model's parameters; raise on any problem."""
    targets = model.hf_targets()
    staged: list[tuple[_Staged, object]] = []
    seen: set[str] = set()
    unknown, duplicated, misshaped = [], [], []
    for name, shape, source in named_shapes:
        if model.skips_hf_name(name):
            continue
        canonical = model.canonical_name(name)
        target = targets.get(canonical)
        if target is None:
            unknown.append(name)
            continue
        if canonical in seen:
            duplicated.append(name)
            continue
        seen.add(canonical)
        param, shard_id = target
        expected = full_shape(param, shard_id)
        if shape != expected:
            misshaped.append(f"{name} {shape} (expected {expected})")
            continue
        staged.append((_Staged(canonical, param, shard_id), source))
    problems = []
    if unknown:
        problems.append(f"unknown tensors: {name_list(sorted(unknown))}")
    if duplicated:
        problems.append(f"tensors given twice: {name_list(sorted(duplicated))}")
    if misshaped:
        problems.append(f"wrong shapes: {name_list(misshaped)}")
    if problems:
        raise WeightUpdateError("weight update refused, nothing was changed: " + "; ".join(problems))
    return staged


@torch.no_grad()
def update_weights_in_place(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | str | Path) -> int:
    """Copy ``weights`` ((HF name, full tensor) pairs, or a checkpoint directory) into ``model``'s
    parameters, each rank keeping its shard. Partial updates are allowed (any subset of the
    model's tensors). Returns the number of tensors copied; raises ``WeightUpdateError`` (and
    copies nothing) on an unknown name, a duplicate, a wrong shape or a non-floating tensor."""
    if isinstance(weights, (str, Path)):
        try:
            headers = list(_checkpoint_headers(Path(weights)))
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None
        staged = _stage(model, headers)
        by_file: dict[Path, list[tuple[_Staged, str]]] = {}
        for entry, (file, stored) in staged:
            by_file.setdefault(file, []).append((entry, stored))
        for file, entries in by_file.items():  # one tensor in host memory at a time
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for entry, stored in entries:
                    _copy(entry, f.get_tensor(stored))
        return len(staged)
    pairs = list(weights)
    for name, tensor in pairs:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"weights must be (name, tensor) pairs, got ({type(name).__name__}, "
                                    f"{type(tensor).__name__})")
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"weight update refused, nothing was changed: {name} is {tensor.dtype}, "
                                    "not a floating-point tensor")
    staged = _stage(model, ((name, tuple(t.shape), t) for name, t in pairs))
    for entry, tensor in staged:
        _copy(entry, tensor)
    return len(staged)


def _copy(entry: _Staged, tensor: torch.Tensor) -> None:
    loader = getattr(entry.param, "weight_loader", default_weight_loader)
    loader(entry.param, tensor, entry.shard_id)
