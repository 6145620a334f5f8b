"""Pure-torch paged attention (CPU and CUDA): ``paged_attention``, the padded reference and ground
truth for faster backends, and the paths the torch backend runs on torch's fused attention
(``decode_attention`` for decode-only steps, ``mixed_attention`` for steps with prefill rows).

An e4m3 pool (``kv_cache_fp8``) is written through ``kv_scale`` and read back dequantized to
float32 by every gather; the other paths compute in float32 anyway."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import kv_cache_fp8
from megatron_async.kernels.kv_cache_fp8 import gather


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Store the step's new keys/values ([T, KVH, D]) at their flat slots of one layer's cache
    (an e4m3 cache: quantized with ``kv_scale``)."""
    if kv_cache_fp8.is_fp8(kv_cache):
        return kv_cache_fp8.write_kv_fp8(kv_cache, k, v, slot_mapping, kv_scale)
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    kv_cache[0].view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_blocks(kv_cache: torch.Tensor, meta: AttentionMetadata, num_rows: int, num_blocks: int,
                  kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """K and V of the first ``num_blocks`` blocks of each row's table: [2, R * num_blocks, block, KVH, D]
    (``index_select`` copies whole blocks; advanced indexing is ~5x slower on the CPU)."""
    return gather(kv_cache, meta.block_table[:num_rows, :num_blocks].reshape(-1).long(), kv_scale)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries [T, H, D] over each row's paged KV (already written).

    Rows are padded to the step's longest query / KV length; key j is visible to a
    query at position p when j <= p (the KV of a row starts at position 0)."""
    T, H, D = q.shape
    R = meta.num_rows
    bs = meta.block_size
    kvh = kv_cache.shape[3]
    nblk = (meta.max_kv_len + bs - 1) // bs
    k, v = gather_blocks(kv_cache, meta, R, nblk, kv_scale).view(2, R, nblk * bs, kvh, D)
    if kvh != H:
        k = k.repeat_interleave(H // kvh, dim=2)
        v = v.repeat_interleave(H // kvh, dim=2)

    qp, pos, rows, within = _pad_queries(q, meta)
    key_pos = torch.arange(nblk * bs, device=q.device)
    visible = (key_pos[None, None, :] <= pos[:, :, None]) & (
        key_pos[None, None, :] < meta.kv_lens[:R].long()[:, None, None]
    )  # [R, Q, K]
    scores = torch.einsum("rqhd,rkhd->rhqk", qp, k.float()) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded queries see nothing
    out = torch.einsum("rhqk,rkhd->rqhd", probs, v.float())
    return out[rows, within].to(q.dtype)


def _pad_queries(q: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """Packed queries [T, H, D] padded per row: (queries [R, Q, H, D] float32, positions [R, Q]
    with -1 at padding, then each token's row and index within it, to unpad with [rows, within])."""
    T, H, D = q.shape
    R, n = meta.num_rows, meta.max_query_len
    rows = meta.token_to_row[:T].long()
    within = torch.arange(T, device=q.device) - meta.cu_query_lens[:R].long()[rows]
    qp = q.new_zeros(R, n, H, D, dtype=torch.float32)
    qp[rows, within] = q.float()
    pos = torch.full((R, n), -1, dtype=torch.long, device=q.device)
    pos[rows, within] = meta.positions[:T]
    return qp, pos, rows, within


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` of a decode-only step (one query per row: token r is row r), lean: the
    query heads that share a KV head form one group of queries over that head's keys (no
    repeated K/V), the gathered blocks are read in place through strides (no padded query
    copy), and one row's query sees its whole KV, so the only mask is the row's length. Torch's
    fused attention (float32, like the reference) does the rest: equal to ``paged_attention`` up
    to float32 rounding (its softmax is computed block by block)."""
    R = meta.num_rows
    return _single_query_rows(q, kv_cache, meta.block_table[:R], meta.kv_lens[:R], meta.max_kv_len,
                              meta.block_size, scale, kv_scale)


def _single_query_rows(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                       max_kv_len: int, block_size: int, scale: float,
                       kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of one query each (q [R, H, D], the row's last position) over their whole paged KV."""
    R, H, D = q.shape
    kvh = kv_cache.shape[3]
    nblk = (max_kv_len + block_size - 1) // block_size
    blocks = block_table[:, :nblk].reshape(-1).long()
    kv = gather(kv_cache, blocks, kv_scale).reshape(2, R, nblk * block_size, kvh, D).transpose(2, 3)  # [2,R,KVH,K,D]
    visible = torch.arange(nblk * block_size, device=q.device) < kv_lens[:, None]  # [R, K]
    qg = q.reshape(R, kvh, H // kvh, D).float()  # query head h reads KV head h // (H / KVH), as repeat_interleave
    out = F.scaled_dot_product_attention(qg, kv[0].float(), kv[1].float(), attn_mask=visible[:, None, None, :],
                                         scale=scale)
    return out.reshape(R, H, D).to(q.dtype)  # CUDA SDPA may return it non-contiguous


def mixed_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` of a step with prefill rows (the KV already written), through torch's
    fused attention instead of one padded [R, H, Q, K] score tensor (whose scores, mask, softmax
    and padding copies cost ~3x HF's forward on the CPU). What the step's host sizes tell apart,
    without reading a tensor on the host (forward reads nothing back):

    - one row of several tokens, alone or beside one-token rows (a prefill chunk while others
      decode): the one-token rows go through the decode path. The long row, found with tensor ops,
      attends causally over this step's k / v when it is a fresh prompt no other row outgrows
      (the step's longest KV is its query length: no gather at all); otherwise (a later chunk,
      or k / v already stored) it gathers its own blocks once (all heads) and its queries see
      the keys up to their positions;
    - several rows of several tokens: padded to the longest, as the reference, but fused.

    Query head h reads KV head h // (H / KVH) (``enable_gqa``: no repeated K/V). Float32, like the
    reference, and equal to it up to float32 rounding."""
    T, R, n = meta.num_tokens, meta.num_rows, meta.max_query_len
    if T - n != R - 1:
        return _padded_rows(q, kv_cache, meta, scale, kv_scale)
    H, D = q.shape[1:]
    bs, kvh = meta.block_size, kv_cache.shape[3]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    cu = meta.cu_query_lens[: R + 1].long()
    if R > 1:  # every row's last token (the long row's too: overwritten below) as a decode query
        last = cu[1:] - 1
        out.index_copy_(0, last, _single_query_rows(q.index_select(0, last), kv_cache, meta.block_table[:R],
                                                    meta.kv_lens[:R], meta.max_kv_len, bs, scale, kv_scale))
    long_row = (cu[1:] - cu[:-1]).argmax().view(1)
    tokens = cu.index_select(0, long_row) + torch.arange(n, device=q.device)
    qr = q.index_select(0, tokens)[None].transpose(1, 2).float()  # [1, H, n, D]
    if meta.max_kv_len == n and k is not None:  # fresh: its KV is its n new tokens, as the pool gives them back
        kr, vr = (_as_stored(t.index_select(0, tokens), kv_cache, kv_scale, i)[None].transpose(1, 2).float()
                  for i, t in enumerate((k, v)))
        o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=kvh != H)
    else:
        nblk = (meta.max_kv_len + bs - 1) // bs
        blocks = meta.block_table.index_select(0, long_row)[0, :nblk].long()
        kr, vr = gather(kv_cache, blocks, kv_scale).reshape(2, 1, nblk * bs, kvh, D).transpose(2, 3).float()
        visible = torch.arange(nblk * bs, device=q.device) <= meta.positions.index_select(0, tokens)[:, None]
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=visible, scale=scale, enable_gqa=kvh != H)
    return out.index_copy_(0, tokens, _to_tokens(o, q.dtype))


def _as_stored(t: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, kv: int) -> torch.Tensor:
    """Keys (``kv`` 0) or values (1) as the cache stores and returns them."""
    if kv_cache_fp8.is_fp8(kv_cache):
        return kv_cache_fp8.round_trip(t, kv_scale[kv])
    return t.to(kv_cache.dtype)


def _padded_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention``'s padding and mask, with the fused kernel in place of its float32 score
    tensor, softmax and masking passes (padded queries see no key; their outputs are dropped)."""
    H, D = q.shape[1:]
    R, bs, kvh = meta.num_rows, meta.block_size, kv_cache.shape[3]
    nblk = (meta.max_kv_len + bs - 1) // bs
    kv = gather_blocks(kv_cache, meta, R, nblk, kv_scale).view(2, R, nblk * bs, kvh, D).transpose(2, 3).float()
    qp, pos, rows, within = _pad_queries(q, meta)
    visible = torch.arange(nblk * bs, device=q.device) <= pos[:, :, None]  # [R, n, K]; pos < kv_len
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), kv[0], kv[1], attn_mask=visible[:, None], scale=scale,
                                       enable_gqa=kvh != H)
    return o.transpose(1, 2)[rows, within].to(q.dtype)


def _to_tokens(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's [1, H, n, D] back to tokens [n, H, D]."""
    return o[0].transpose(0, 1).to(dtype)
