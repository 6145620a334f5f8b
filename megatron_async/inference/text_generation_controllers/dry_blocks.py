"""Which of a model's blocks a dry capture must run to meet every Triton specialization its
step launches (kernel_prebuild.py).

A block's kernels are specialized on what it holds (parameter shapes, dtypes, strides, their
addresses' 16-byte alignment, its settings) and on what the block before it hands over (a
residual or not, a deferred MoE sum, quantized rows): never on which layer it is. So a dry pass
may run the shortest prefix of the blocks that holds every (block before, block) pair the model
has and ends with a block like the last one (what the final norm is handed): the prefix runs each
pair with its real predecessor. A stack of 28 layers (attention and MLP blocks, 56) runs 4
blocks; a hybrid whose pattern does not repeat runs most of its blocks."""
from __future__ import annotations

import torch

PER_LAYER = frozenset({"kv_index", "state_index", "moe_layer"})
"""Attributes that only say which layer a mixer is (its KV pool, its Mamba state, its routing
record's column): equal blocks differ in them and nothing else."""

_PLAIN = (bool, int, float, str, type(None))


def _setting(value):
    """A non-tensor attribute as the signature holds it (None: not part of it)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if hasattr(value, "__dataclass_fields__"):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def _tensor(t: torch.Tensor) -> tuple:
    return tuple(t.shape), str(t.dtype), t.stride(), t.data_ptr() % 16


def block_signature(block: torch.nn.Module) -> tuple:
    """What a block's kernels can be specialized on: for each of its modules, its type, its
    settings (``PER_LAYER`` left out), its parameters' and buffers' shapes, dtypes, strides and
    alignment."""
    out = []
    for name, module in block.named_modules():
        settings = tuple(sorted((k, s) for k, v in vars(module).items()
                                if not k.startswith("_") and k not in PER_LAYER and (s := _setting(v)) is not None))
        tensors = tuple((k, _tensor(t)) for k, t in (*module.named_parameters(recurse=False),
                                                      *module.named_buffers(recurse=False)) if t is not None)
        out.append((name, type(module).__qualname__, settings, tensors))
    return tuple(out)


def blocks_to_run(blocks) -> list[int]:
    """Indices of the blocks a dry capture runs: a prefix (see the module doc)."""
    sigs = [block_signature(b) for b in blocks]
    pairs = [(sigs[i - 1] if i else None, sigs[i]) for i in range(len(sigs))]
    want, got = set(pairs), set()
    for i, pair in enumerate(pairs):
        got.add(pair)
        if got == want and sigs[i] == sigs[-1]:
            return list(range(i + 1))
    return list(range(len(sigs)))
