"""Vocabulary-parallel input embedding and LM head: each TP rank owns a contiguous range of
vocabulary rows. The head gathers full float32 logits on every rank, so every rank samples
the same tokens with no token traffic."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_async.kernels.linear_op import linear
from megatron_async.parallel.communication import tp_all_gather_last_dim, tp_all_reduce
from megatron_async.parallel.sharding import Sharding, sharded_param
from megatron_async.parallel.state import ParallelState


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.parallel = parallel
        self.local_vocab = parallel.tp_divide(vocab_size, "vocab_size")
        self.vocab_start = parallel.tp_rank * self.local_vocab
        self.weight = sharded_param((self.local_vocab, hidden), Sharding.split(0, vocab_size, parallel, "vocab_size"),
                                    dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # ids owned by other ranks look up zeros here; the all-reduce fills them in from their owner
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.parallel)


class ParallelLMHead(nn.Module):
    """[N, hidden] -> [N, vocab] float32 logits on every rank. ``tied``: reuse the embedding's
    weight (same vocabulary rows per rank), so the head has no parameter of its own."""

    def __init__(self, vocab_size: int, hidden: int, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device | str, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.parallel = parallel
        self._tied = [tied]  # a list: not registered as a submodule (its weight is the embedding's)
        self.weight = None
        if tied is None:
            self.weight = sharded_param((parallel.tp_divide(vocab_size, "vocab_size"), hidden),
                                        Sharding.split(0, vocab_size, parallel, "vocab_size"), dtype, device)

    @property
    def is_tied(self) -> bool:
        return self.weight is None

    def forward(self, hidden: torch.Tensor, batch_invariant: bool = False, float32: bool = True) -> torch.Tensor:
        """Logits [N, vocab], computed in the model dtype as HF does; ``float32=False`` keeps
        that dtype (consumers that read them as float32 skip a full-vocabulary cast)."""
        weight = self._tied[0].weight if self.weight is None else self.weight
        local = linear(hidden, weight, None, batch_invariant)
        logits = tp_all_gather_last_dim(local, self.parallel)
        return logits.float() if float32 else logits
