"""A minimal stand-alone driver for model tests: runs packed steps of several sequences
against a paged KV cache (and Mamba state slots) without the engine's context.

Each sequence gets its own contiguous run of blocks and its own state slot; a step is a
list of (sequence id, new token ids). It exercises the same ForwardBatch contract the
engine uses, so model and kernel tests need no scheduler."""
from __future__ import annotations

import torch

from megatron_async.forward_batch import AttentionMetadata, ForwardBatch, MambaMetadata
from megatron_async.models.base import CausalLM


class SimpleSession:
    def __init__(self, model: CausalLM, max_seqs: int = 8, max_len: int = 256, block_size: int = 4):
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.block_size = block_size
        self.blocks_per_seq = (max_len + block_size - 1) // block_size
        num_blocks = 1 + max_seqs * self.blocks_per_seq  # block 0 = dummy
        spec = model.kv_cache_spec()
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, device=self.device, dtype=self.dtype)
            for _ in range(spec.num_layers)
        ]
        mspec = model.mamba_state_spec()
        self.conv_states, self.ssm_states = [], []
        if mspec is not None:
            self.conv_states = [torch.zeros(max_seqs, *mspec.conv_shape, device=self.device, dtype=self.dtype) for _ in range(mspec.num_layers)]
            self.ssm_states = [torch.zeros(max_seqs, *mspec.ssm_shape, device=self.device, dtype=torch.float32) for _ in range(mspec.num_layers)]
        self.lengths = [0] * max_seqs

    def _blocks(self, seq: int) -> list[int]:
        return [1 + seq * self.blocks_per_seq + i for i in range(self.blocks_per_seq)]

    @torch.no_grad()
    def step(self, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one packed step; returns logits [T, vocab] for every new token."""
        return self.model.compute_logits(self.forward(rows)[0])

    @torch.no_grad()
    def forward(self, rows: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, ForwardBatch]:
        """Run one packed step; returns the final hidden states [T, H] and the step's batch."""
        ids, pos, slots, tok_row, cu, kv_lens, table, has_init = [], [], [], [], [0], [], [], []
        for r, (seq, toks) in enumerate(rows):
            start = self.lengths[seq]
            blocks = self._blocks(seq)
            for i, t in enumerate(toks):
                p = start + i
                ids.append(t)
                pos.append(p)
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                tok_row.append(r)
            cu.append(cu[-1] + len(toks))
            kv_lens.append(start + len(toks))
            table.append(blocks)
            has_init.append(start > 0)
            self.lengths[seq] = start + len(toks)
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=len(ids), num_rows=len(rows),
            max_query_len=max(len(t) for _, t in rows), max_kv_len=max(kv_lens),
            is_decode_only=all(len(t) == 1 for _, t in rows),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            token_to_row=torch.tensor(tok_row, dtype=torch.int32, device=dev),
            cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=dev),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            block_size=self.block_size,
        )
        mamba = None
        if self.conv_states:
            lengths = [len(t) for _, t in rows]
            order = [r for r, n in enumerate(lengths) if n > 1] + [r for r, n in enumerate(lengths) if n == 1]
            mamba = MambaMetadata(
                state_slots=torch.tensor([s for s, _ in rows], dtype=torch.long, device=dev),
                has_initial_state=torch.tensor(has_init, dtype=torch.bool, device=dev),
                cu_query_lens=meta.cu_query_lens, num_rows=len(rows),
                is_decode_only=meta.is_decode_only, max_query_len=meta.max_query_len,
                token_to_row=meta.token_to_row, row_order=torch.tensor(order, dtype=torch.long, device=dev),
                num_scan_rows=sum(n > 1 for n in lengths),
            )
        batch = ForwardBatch(attn=meta, kv_caches=self.kv_caches, mamba=mamba,
                             conv_states=self.conv_states, ssm_states=self.ssm_states)
        return self.model(torch.tensor(ids, dtype=torch.long, device=dev), batch), batch
