"""MTP drafter: drafts from the checkpoint's multi-token-prediction heads, on the device.

Every launch (prefill chunks, plain decode and verify rows alike) runs MTP depth 0 teacher
forced over all of the step's tokens: at position i, the main model's hidden state h_i and
the token at i + 1. That fills depth 0's KV layer for every position the main model
processes, and at the row's newest emitted token (``VerifyOutputs.hidden_idx``: the position
before the bonus token) its logits give draft 1. Drafts 2..K chain one token per row: the
previous MTP output and the previous draft, one position further, depth ``min(j, depths - 1)``
(k > depths reuses the last depth, as vLLM does). Drafts are greedy; they never change a
token, only how many are accepted.

The token at i + 1 comes from a per-slot token history on the device (the prompt and
generated tokens from ``on_admit``, then every step's samples): for a verify row, the token
after position i is the sample at i (equal to the draft where accepted; past the accepted
run the KV is garbage that later steps overwrite); for a prefill chunk that is not the last,
it is the next prompt token."""
from __future__ import annotations

import torch

from megatron_async.forward_batch import AttentionMetadata, ForwardBatch
from megatron_async.inference.contexts.spec_state import SpecState
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.speculative.drafter import Drafter, TokenHistory, VerifyOutputs


class MTPDrafter(Drafter):
    name = "mtp"
    tracks_plain_steps = True

    def __init__(self, model, max_sequence_length: int):
        """``model``: a DecoderModel with MTP heads (``mtp_forward``, ``compute_logits``)."""
        self.model = model
        self.num_depths = model.num_mtp_depths
        self.max_sequence_length = max_sequence_length

    def bind(self, spec: SpecState) -> None:
        super().bind(spec)
        self.history = TokenHistory(spec, self.max_sequence_length)

    def on_admit(self, req: DynamicInferenceRequest, slot: int) -> None:
        self.history.fill(req, slot)

    def track(self, out: VerifyOutputs) -> None:
        """A step without the drafter: depth 0's KV at its positions still gets filled (later
        drafts attend over it); no logits, no drafts."""
        self._depth0(out)

    def _depth0(self, out: VerifyOutputs) -> torch.Tensor:
        """Record the step's samples, run depth 0 teacher forced over all its tokens: [T, H]."""
        attn, L = out.batch.attn, self.history.length
        T = attn.num_tokens
        self.history.record(out)
        owner = out.row_slots[attn.token_to_row[:T].long()]
        next_ids = self.history.tokens[owner, (attn.positions[:T] + 1).clamp(0, L - 1)]
        return self.model.mtp_forward(0, next_ids, out.hidden[:T], out.batch)

    def propose(self, out: VerifyOutputs) -> torch.Tensor:
        K, R = self.spec.num_speculative_tokens, out.num_rows
        hidden = self._depth0(out)[out.hidden_idx]
        inv = out.batch.batch_invariant
        drafts = [self.model.compute_logits(hidden, inv).argmax(dim=-1)]
        for j in range(1, K):
            batch = self._chain_batch(out, out.last_pos + (j - 1))
            depth = min(j, self.num_depths - 1)
            hidden = self.model.mtp_forward(depth, drafts[-1], hidden, batch)
            drafts.append(self.model.compute_logits(hidden, inv).argmax(dim=-1))
        return torch.stack(drafts, dim=1)[:R]

    def match_collectives(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> None:
        """``propose`` runs the heads K times (depth 0, then K - 1 chained drafts), each with the
        MoE exchanges of a MoE head layer: the same K passes over the dummy's padding rows
        (their KV goes to the dummy block)."""
        for j in range(self.spec.num_speculative_tokens):
            hidden = self.model.mtp_forward(min(j, self.num_depths - 1), input_ids, hidden, batch)

    def _chain_batch(self, out: VerifyOutputs, pos: torch.Tensor) -> ForwardBatch:
        """One token per row at positions ``pos`` [R], attending over each row's KV before it.
        Positions past the row's reserved blocks write (and read) the dummy block: such drafts
        are garbage, which only costs acceptance."""
        a, R = out.batch.attn, out.num_rows
        bs = a.block_size
        limit = min(a.block_table.shape[1] * bs, self.max_sequence_length)  # rope tables are sized to it
        pos = pos.clamp(0, limit - 1)
        table = a.block_table[:R].long()
        block = table.gather(1, (pos // bs)[:, None])[:, 0]
        rows = torch.arange(R, device=pos.device)
        max_kv_len = min(a.max_kv_len + self.spec.num_speculative_tokens, limit)  # an upper bound, on the host
        meta = AttentionMetadata(
            num_tokens=R, num_rows=R, max_query_len=1, max_kv_len=max_kv_len, is_decode_only=True,
            positions=pos, slot_mapping=block * bs + pos % bs,
            token_to_row=rows.to(torch.int32), cu_query_lens=torch.arange(R + 1, device=pos.device, dtype=torch.int32),
            kv_lens=(pos + 1).to(torch.int32), block_table=a.block_table[:R], block_size=bs,
        )
        # expert parallelism: the chain's MoE exchanges pad to the step's agreed count (>= T >= R)
        return ForwardBatch(attn=meta, kv_caches=out.batch.kv_caches, ep_num_tokens=out.batch.ep_num_tokens,
                            batch_invariant=out.batch.batch_invariant)
