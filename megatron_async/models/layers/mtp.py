"""Multi-token-prediction heads (DeepSeek-V3 / Megatron / Qwen3-Next style).

Depth d at position i reads the previous hidden state (the main model's final-normed output
h_i for the first depth, the previous depth's output when chaining) and the embedding of
the token at i + 1, and predicts the token at i + 2:

    x = fc([norm_e(embed(t_{i+1})) | norm_h(h_i)])      # 2H -> H
    x = decoder_layer_d(x)                               # attention + MLP blocks
    out = norm(x)                                        # -> the shared LM head

The attention of each depth has its own KV cache: an extra layer of the paged pool, under the
same block tables and slot mapping as the main model (index ``first_kv_index + d``), written
at position i. Like Qwen3-Next, ``fc`` and the three norms are shared by all depths (which
coincides with DeepSeek-V3's per-depth ones for a single depth)."""
from __future__ import annotations

import torch
from torch import nn

from megatron_async.models.layers.block import Block, StepInputs
from megatron_async.models.layers.norm import RMSNorm
from megatron_async.parallel.linear import ReplicatedLinear
from megatron_async.parallel.state import ParallelState


class MTPHeads(nn.Module):
    def __init__(self, hidden: int, make_norm, layers: list[list[Block]], parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device | str):
        """``make_norm()``: a new norm of the host model's kind; ``layers[d]``: the blocks of
        depth d's decoder layer. ``fc`` is replicated on every TP rank (it is small, and the
        concatenated input is replicated too), so TP adds no collective here."""
        super().__init__()
        self.pre_fc_norm_embedding: RMSNorm = make_norm()
        self.pre_fc_norm_hidden: RMSNorm = make_norm()
        self.fc = ReplicatedLinear(2 * hidden, hidden, False, parallel, dtype, device)
        self.layers = nn.ModuleList(nn.ModuleList(blocks) for blocks in layers)
        self.norm: RMSNorm = make_norm()

    @property
    def num_depths(self) -> int:
        return len(self.layers)

    def forward(self, depth: int, embeds: torch.Tensor, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """embeds [T, H] (of the next tokens), hidden [T, H] -> normed output [T, H] (feed it to
        the LM head, or as ``hidden`` of the next chained step)."""
        inv, fused = step.batch.batch_invariant, step.kernels.fused
        e = self.pre_fc_norm_embedding(self.pre_fc_norm_embedding.in_dtype(embeds), inv, fused)
        h = self.pre_fc_norm_hidden(self.pre_fc_norm_hidden.in_dtype(hidden), inv, fused)
        x, residual = self.fc(torch.cat([e, h], dim=-1), inv), None
        for block in self.layers[depth]:
            x, residual = block(x, residual, step)
        return self.norm.add_and_norm(x, residual, inv, fused)[0]
