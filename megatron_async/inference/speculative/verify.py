"""The device side of a verify step: fix up the inputs before the forward, accept after sampling.

A decode row with k drafts is a (k + 1)-token row: its last token at position p, then the
drafts at p + 1 .. p + k. Every position is sampled with its own (seed, position) draws,
exactly as plain decoding would sample it, so draft j is accepted iff it equals the token
sampled at the position before it, and the row emits the accepted drafts' samples plus one
more (the bonus): output identical to plain decoding by construction.

Under launch-ahead the host launches a row before it knows how many drafts the request's
previous launch accepted, assuming all of them (``spec_inflight`` rows). ``prepare`` then
subtracts that launch's ``shortfall`` on the device from the row's positions, KV slots, KV
length and sample positions, and gathers its input token and drafts from ``SpecState``.
Nothing here reads a device value on the host."""
from __future__ import annotations

import torch

from megatron_async.forward_batch import ForwardBatch
from megatron_async.inference.contexts.spec_state import SpecState
from megatron_async.inference.speculative.drafter import VerifyOutputs


class SpecVerifier:
    def __init__(self, spec: SpecState, block_size: int):
        self.spec = spec
        self.block_size = block_size
        K = spec.num_speculative_tokens
        self._cols = torch.arange(K + 1, device=spec.device.device)
        self._no_drafts = torch.zeros(spec.num_slots, dtype=torch.int64, device=spec.device.device)

    def prepare(self, g, T: int, R: int, S: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Correct the step's positions in the GPU view (in place: the next H2D copy rewrites
        them) and return the input ids with last tokens and drafts gathered."""
        sp, bs = self.spec, self.block_size
        row_slot = g.spec_slot[:R]
        row_corr = torch.where(g.spec_inflight[:R], sp.shortfall[row_slot], torch.zeros_like(row_slot))
        tok_row = g.token_to_row[:T].long()
        pos = g.positions[:T] - row_corr[tok_row]
        g.positions[:T] = pos
        block = g.block_table[:R].long()[tok_row, pos // bs]
        src = g.spec_src[:T]
        # padding tokens of a uniform verify row (-2) keep writing to the dummy block
        g.slot_mapping[:T] = torch.where(src == -2, g.slot_mapping[:T], block * bs + pos % bs)
        g.kv_lens[:R] -= row_corr.to(g.kv_lens.dtype)
        g.sample_position[:S] -= row_corr[g.sample_to_row[:S]]
        tok_slot = row_slot[tok_row]
        drafts = sp.drafts[tok_slot, (src - 1).clamp(0, max(sp.num_speculative_tokens - 1, 0))] \
            if sp.num_speculative_tokens else input_ids
        gathered = torch.where(src == 0, sp.last_token[tok_slot], drafts)
        return torch.where(src < 0, input_ids, gathered)

    def verify(self, g, R: int, input_ids: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
               batch: ForwardBatch, accepted_out: torch.Tensor) -> VerifyOutputs:
        """Acceptance of every row from its samples ``tokens`` [S]; writes the rows' slot state
        and ``accepted_out[:R]``. Returns what the drafter reads."""
        sp = self.spec
        base, nd, slots = g.sample_base[:R], g.num_drafts[:R], g.spec_slot[:R]
        cols = self._cols
        idx = base[:, None] + torch.minimum(cols[None, :], nd[:, None])  # [R, K + 1], clamped to the row
        t = tokens[idx]
        K = sp.num_speculative_tokens
        # draft j (1-based) sits at token cu[r] + j of the row; it must equal sample j - 1
        first = g.cu_query_lens[:R].long()
        d = input_ids[(first[:, None] + 1 + cols[None, :K]).clamp(max=input_ids.shape[0] - 1)]
        match = (t[:, :K] == d) & (cols[None, :K] < nd[:, None])
        accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
        accepted_out[:R].copy_(accepted)
        last_idx = base + accepted
        last_token = tokens[last_idx]
        positions = g.sample_position[idx]
        last_pos = g.sample_position[last_idx]
        sp.last_token[slots] = last_token
        sp.last_pos[slots] = last_pos
        sp.shortfall[slots] = nd - accepted
        return VerifyOutputs(R, slots, t, positions, nd, accepted, last_token, last_pos, hidden,
                             g.sample_token_idx[last_idx], batch, row_slots=g.spec_owner_slot[:R])

    def store_drafts(self, out: VerifyOutputs, drafts: torch.Tensor) -> None:
        self.spec.drafts[out.slots] = drafts

    def plain_outputs(self, g, R: int, tokens: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> VerifyOutputs:
        """What a plain step (one token and one sample per row, no drafts: plain_steps.py) gives
        ``Drafter.track``; it writes no spec state."""
        zeros = self._no_drafts[:R]
        return VerifyOutputs(R, g.spec_slot[:R], tokens[:R, None], g.sample_position[:R, None], zeros, zeros,
                             tokens[:R], g.sample_position[:R], hidden, g.sample_token_idx[:R], batch,
                             row_slots=g.spec_owner_slot[:R])
