"""Pure-torch reference paged attention (CPU and CUDA): the ground truth for faster backends."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.inference.contexts.metadata import AttentionMetadata


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
    R = meta.num_rows
    return _single_query_rows(q, kv_cache, meta.block_table[:R], meta.kv_lens[:R], meta.max_kv_len,
                              meta.block_size, scale)


def _single_query_rows(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                       max_kv_len: int, block_size: int, scale: float) -> torch.Tensor:
    """Rows of one query each (q [R, H, D], the row's last position) over their whole paged KV."""
    R, H, D = q.shape
    kvh = kv_cache.shape[3]
    nblk = (max_kv_len + block_size - 1) // block_size
    blocks = block_table[:, :nblk].reshape(-1).long()
    kv = kv_cache.index_select(1, blocks).reshape(2, R, nblk * block_size, kvh, D).transpose(2, 3)  # [2, R, KVH, K, D]
    visible = torch.arange(nblk * block_size, device=q.device) < kv_lens[:, None]  # [R, K]
    qg = q.reshape(R, kvh, H // kvh, D).float()  # query head h reads KV head h // (H / KVH), as repeat_interleave
    out = F.scaled_dot_product_attention(qg, kv[0].float(), kv[1].float(), attn_mask=visible[:, None, None, :],
                                         scale=scale)
    return out.reshape(R, H, D).to(q.dtype)  # CUDA SDPA may return it non-contiguous


def mixed_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``paged_attention`` of a step with prefill rows (the KV already written), row by row with
    torch's fused attention instead of one padded [R, H, Q, K] score tensor (which on the CPU cost
    ~3x HF's forward: scores, mask, softmax and copies of the padding, every layer):

    - a fresh prefill row (its KV is exactly its new tokens) attends causally over this step's
      contiguous k / v: no gather at all;
    - a row with earlier context (a later chunk, a prefix hit) gathers its own blocks once (all
      heads), and its queries, the last ones of its KV, see keys up to their own position;
    - the one-query rows (decode) go together through the decode path.

    Query head h reads KV head h // (H / KVH) (``enable_gqa``: no repeated K/V). Float32, like the
    reference; equal to it up to float32 rounding. CPU only: the row bounds are read on the host
    (on CUDA that would sync every layer and break graph capture, so CUDA keeps the reference)."""
    if not q.is_cpu:
        return paged_attention(q, kv_cache, meta, scale)
    R, bs = meta.num_rows, meta.block_size
    T, H, D = q.shape
    kvh = kv_cache.shape[3]
    cu = meta.cu_query_lens[: R + 1].tolist()
    kv_lens = meta.kv_lens[:R].tolist()
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    single = [r for r in range(R) if cu[r + 1] - cu[r] == 1]
    if single:
        rows = torch.tensor(single, device=q.device)
        tokens = meta.cu_query_lens[rows].long()
        out[tokens] = _single_query_rows(q[tokens], kv_cache, meta.block_table[rows], meta.kv_lens[rows],
                                         max(kv_lens[r] for r in single), bs, scale)
    for r in range(R):
        start, end, kv_len = cu[r], cu[r + 1], kv_lens[r]
        n = end - start
        if n <= 1:
            continue
        qr = q[None, start:end].transpose(1, 2).float()  # [1, H, n, D]: CPU's fused kernel wants 4-d
        if kv_len == n and k is not None:  # fresh prefill: its KV is this step's k / v
            kr = k[None, start:end].to(kv_cache.dtype).transpose(1, 2).float()
            vr = v[None, start:end].to(kv_cache.dtype).transpose(1, 2).float()
            o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=kvh != H)
        else:
            nblk = (kv_len + bs - 1) // bs
            kv = kv_cache.index_select(1, meta.block_table[r, :nblk].long()).reshape(2, nblk * bs, kvh, D)
            kr, vr = kv[:, None, :kv_len].transpose(2, 3).float()  # [1, KVH, K, D] each
            # queries are the last n positions of the KV: query i sees keys 0 .. kv_len - n + i
            visible = (torch.arange(kv_len, device=q.device)[None, :]
                       <= torch.arange(kv_len - n, kv_len, device=q.device)[:, None])
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=visible, scale=scale, enable_gqa=kvh != H)
        out[start:end] = o[0].transpose(0, 1)
    return out
