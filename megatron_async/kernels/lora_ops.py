"""The batched LoRA op every adapted linear calls after its base product:

    y[t, slice j] += scale[l, j] * (x[t] @ A[l, jR:(j+1)R].T) @ B[l, slice j].T,   l = slots[t]

for each token t with an adapter slot l >= 0; a token of slot -1 (the base model) is left as it
is. A fused projection (q/k/v, gate/up) has one slice per part, each with its own A rows and its
own B rows (its own columns of y); a plain linear has one slice.

Two implementations of the same arithmetic (PEFT's order: the rank-space product rounded to the
model dtype, then the expanded product, then the scale, then the add): the Triton split-K shrink
/ expand pair (``triton_lora``) on CUDA and in batch-invariant mode (interpreted on CPU, as the
batch-invariant matmul is), and a torch reference elsewhere, which groups the rows by slot on
the host (CPU only: it reads the slots). They differ only in float32 sum orders."""
from __future__ import annotations

import functools

import torch

from megatron_async.forward_batch import LoRAGroups


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
             slots: torch.Tensor, starts: torch.Tensor, slices: tuple[tuple[int, int], ...],
             batch_invariant: bool = False, groups: LoRAGroups | None = None) -> None:
    """In place on ``y`` [T, N] (the layer's output or, row-parallel, its partial sum); ``x`` [T, K];
    ``a`` [L, S*R, K]; ``b`` [L, N, R]; ``scale`` [L, S] float32; ``slots`` [>= T] int32;
    ``starts`` [S + 1] int32 on the device and ``slices`` the same (start, end) columns on the host.
    ``groups``: these T rows grouped by slot (``lora_groups.group_lora_rows``): the Triton op runs
    tiles of one slot each (``triton_lora_grouped``); None: tiles of any rows (``triton_lora``)."""
    if runs_triton(x, batch_invariant):
        if groups is not None:
            _grouped()(y, x, a, b, scale, groups, starts, batch_invariant)
        else:
            _triton()(y, x, a, b, scale, slots, starts, batch_invariant)
    else:
        lora_add_reference(y, x, a, b, scale, slots, slices)


def runs_triton(x: torch.Tensor, batch_invariant: bool) -> bool:
    """Whether ``lora_add`` on ``x``'s device runs the Triton op (which alone reads ``groups``)."""
    return x.is_cuda or batch_invariant


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                       slots: torch.Tensor, slices: tuple[tuple[int, int], ...]) -> None:
    """``lora_add`` in torch: the rows of each slot in one product (reads the slots on the host)."""
    T = x.shape[0]
    R = b.shape[2]
    token_slots = slots[:T].long()
    for lora in torch.unique(token_slots).tolist():
        if lora < 0:
            continue
        rows = (token_slots == lora).nonzero().squeeze(1)
        s = x[rows] @ a[lora].T
        for j, (lo, hi) in enumerate(slices):
            part = (s[:, j * R:(j + 1) * R] @ b[lora, lo:hi].T) * scale[lora, j].to(y.dtype)
            y[rows, lo:hi] += part


@functools.cache
def _triton():
    # imported on first use: tests set TRITON_INTERPRET before the kernels are decorated
    from megatron_async.kernels.triton_lora import lora_add_triton

    return lora_add_triton


@functools.cache
def _grouped():
    from megatron_async.kernels.triton_lora_grouped import lora_add_grouped

    return lora_add_grouped
