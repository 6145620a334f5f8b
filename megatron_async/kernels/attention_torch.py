"""Pure-torch reference paged attention (CPU and CUDA): the ground truth for faster backends."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys/values ([T, KVH, D]) at their flat slots of one layer's cache."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    kv_cache[0].view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of packed queries [T, H, D] over each row's paged KV (already written).

    Rows are padded to the step's longest query / KV length; key j is visible to a
    query at position p when j <= p (the KV of a row starts at position 0)."""
    T, H, D = q.shape
    R = meta.num_rows
    bs = meta.block_size
    kvh = kv_cache.shape[3]
    nblk = (meta.max_kv_len + bs - 1) // bs
    blocks = meta.block_table[:R, :nblk].long()  # [R, nblk]
    k = kv_cache[0][blocks].reshape(R, nblk * bs, kvh, D)
    v = kv_cache[1][blocks].reshape(R, nblk * bs, kvh, D)
    if kvh != H:
        k = k.repeat_interleave(H // kvh, dim=2)
        v = v.repeat_interleave(H // kvh, dim=2)

    rows = meta.token_to_row[:T].long()
    within = torch.arange(T, device=q.device) - meta.cu_query_lens[:R].long()[rows]
    qp = q.new_zeros(R, meta.max_query_len, H, D)
    qp[rows, within] = q
    pos = torch.full((R, meta.max_query_len), -1, dtype=torch.long, device=q.device)
    pos[rows, within] = meta.positions[:T]

    key_pos = torch.arange(nblk * bs, device=q.device)
    visible = (key_pos[None, None, :] <= pos[:, :, None]) & (
        key_pos[None, None, :] < meta.kv_lens[:R].long()[:, None, None]
    )  # [R, Q, K]
    scores = torch.einsum("rqhd,rkhd->rhqk", qp.float(), k.float()) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded queries see nothing
    out = torch.einsum("rhqk,rkhd->rqhd", probs, v.float())
    return out[rows, within].to(q.dtype)
