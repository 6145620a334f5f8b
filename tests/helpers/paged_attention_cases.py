"""Random paged-attention problems for comparing attention backends (the kernel tests and
``python -m benchmarks kernel-times paged-attention``).

Each row has ``cached`` tokens already in the cache and ``new`` query tokens this step.
Rows get shuffled block ids, so tiles gather from scattered blocks. Every cache slot that
does not hold a cached token is filled with ``unused`` (NaN by default): a kernel that
reads a slot it must not read produces NaN. The reference runs on a NaN-free copy."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import attention_torch


QWEN3_06B_HEADS = dict(num_heads=16, num_kv_heads=8, head_dim=128)
"""Qwen3-0.6B's attention shape per rank: the real shape of the GPU tests and timings."""

MIXED_PREFILL = [(0, 512), (1024, 512), (300, 256), (0, 128)]
"""A mixed step's prefill chunks: fresh prompts and chunks continuing a cached prefix."""


def decode_rows(batch: int, max_len: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """A decode step: one new token per row, KV lengths uniform in [max_len / 2, max_len] (a
    single row gets max_len)."""
    if batch == 1:
        return [(max_len - 1, 1)]
    lens = torch.randint(max_len // 2, max_len + 1, (batch,), generator=gen).tolist()
    return [(n - 1, 1) for n in lens]


def mixed_rows(max_len: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """A mixed step: ``MIXED_PREFILL``'s chunks plus 64 decode rows."""
    return MIXED_PREFILL + decode_rows(64, max_len, gen)


@dataclass
class PagedCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch-backend (output, cache after append), on a NaN-free copy of the cache."""
        cache = torch.nan_to_num(self.kv_cache, nan=0.0)
        attention_torch.write_kv(cache, self.k, self.v, self.meta.slot_mapping[: self.meta.num_tokens])
        return attention_torch.paged_attention(self.q, cache, self.meta, self.scale), cache


def make_case(
    rows: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    table_width: int | None = None,
    num_blocks: int | None = None,
    seed: int = 0,
    unused: float = float("nan"),
) -> PagedCase:
    """``rows``: (cached, new) token counts per row. ``table_width``: block-table columns
    (default: just enough for the longest row). ``num_blocks``: cache size (default: what
    the rows need, plus the dummy block 0 and 2 spare blocks)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in rows]
    width = table_width or max(need)
    assert width >= max(need)
    num_blocks = num_blocks or 1 + sum(need) + 2
    assert num_blocks > sum(need)
    perm = (torch.randperm(num_blocks - 1, generator=gen, device=device) + 1).to(torch.int32)
    table = torch.zeros(len(rows), width, dtype=torch.int32, device=device)

    cached_slots, pos, new_rows, cu = [], [], [], [0]
    used = 0
    for r, ((cached, new), nb) in enumerate(zip(rows, need)):
        table[r, :nb] = perm[used : used + nb]
        used += nb
        prefix = torch.arange(cached, device=device)
        cached_slots.append(table[r].long()[prefix // block_size] * block_size + prefix % block_size)
        pos.append(torch.arange(cached, cached + new, device=device))
        new_rows.append(torch.full((new,), r, dtype=torch.int32, device=device))
        cu.append(cu[-1] + new)
    positions = torch.cat(pos)
    token_to_row = torch.cat(new_rows)
    slot_mapping = table.long()[token_to_row.long(), positions // block_size] * block_size + positions % block_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    keep = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    keep[torch.cat(cached_slots)] = True
    kv_cache.view(2, -1, num_kv_heads, head_dim)[:, ~keep] = unused

    num_tokens = cu[-1]
    kv_lens = [c + n for c, n in rows]
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_rows=len(rows),
        max_query_len=max(n for _, n in rows),
        max_kv_len=max(kv_lens),
        is_decode_only=all(n == 1 for _, n in rows),
        positions=positions,
        slot_mapping=slot_mapping,
        token_to_row=token_to_row,
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_table=table,
        block_size=block_size,
    )
    return PagedCase(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache,
        meta=meta,
        scale=head_dim**-0.5,
    )

