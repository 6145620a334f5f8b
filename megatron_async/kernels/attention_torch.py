"""Pure-torch reference paged attention (CPU and CUDA): the ground truth for faster backends."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.forward_batch import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys/values ([T, KVH, D]) at their flat slots of one layer's cache."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    kv_cache[0].view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_blocks(kv_cache: torch.Tensor, meta: AttentionMetadata, num_rows: int, num_blocks: int) -> torch.Tensor:
    """K and V of the first ``num_blocks`` blocks of each row's table: [2, R * num_blocks, block, KVH, D]
    (``index_select`` copies whole blocks; advanced indexing is ~5x slower on the CPU)."""
    return kv_cache.index_select(1, meta.block_table[:num_rows, :num_blocks].reshape(-1).long())


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
    k, v = gather_blocks(kv_cache, meta, R, nblk).view(2, R, nblk * bs, kvh, D)
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


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``paged_attention`` of a decode-only step (one query per row: token r is row r), lean: the
    query heads that share a KV head form one group of queries over that head's keys (no
    repeated K/V), the gathered blocks are read in place through strides (no padded query
    copy), and one row's query sees its whole KV, so the only mask is the row's length. Torch's
    fused attention (float32, like the reference) does the rest: equal to ``paged_attention`` up
    to float32 rounding (its softmax is computed block by block)."""
    R, H, D = q.shape
    bs, kvh = meta.block_size, kv_cache.shape[3]
    nblk = (meta.max_kv_len + bs - 1) // bs
    kv = gather_blocks(kv_cache, meta, R, nblk).reshape(2, R, nblk * bs, kvh, D).transpose(2, 3)  # [2, R, KVH, K, D]
    visible = torch.arange(nblk * bs, device=q.device) < meta.kv_lens[:R, None]  # [R, K]
    qg = q.reshape(R, kvh, H // kvh, D).float()  # query head h reads KV head h // (H / KVH), as repeat_interleave
    out = F.scaled_dot_product_attention(qg, kv[0].float(), kv[1].float(), attn_mask=visible[:, None, None, :],
                                         scale=scale)
    return out.reshape(R, H, D).to(q.dtype)  # CUDA SDPA may return it non-contiguous
