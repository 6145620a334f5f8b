"""Grammar token masks on the device: a step's logits with the tokens each sample's grammar
forbids set to -inf, out of place (the raw logits stay for the log-probs).

``bitmask`` [G, W] int32 holds one row per constrained sample (bit ``t % 32`` of word ``t // 32``
set: token t allowed); ``row_map`` [S] int32 maps sample s to its bitmask row, or -1 for a
sample without a grammar (copied as it is). Two backends of one function: the torch reference
(any device) and a Triton kernel (CUDA, or CPU tensors with TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def allowed_reference(bitmask: torch.Tensor, row_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] bool: token t of sample s is allowed (every token of a sample without a grammar)."""
    words = bitmask[row_map.long().clamp(min=0)]  # [S, W]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 of a negative word still reads 1
    allowed = bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()
    return allowed | (row_map < 0)[:, None]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_map: torch.Tensor,
                        triton: bool = False) -> torch.Tensor:
    """A copy of ``logits`` [S, V] with the forbidden tokens of every constrained sample at -inf."""
    if triton:
        from megatron_async.kernels.triton_token_mask import apply_token_bitmask as masked

        return masked(logits, bitmask, row_map)
    return logits.masked_fill(~allowed_reference(bitmask, row_map, logits.shape[-1]), NEG_INF)
