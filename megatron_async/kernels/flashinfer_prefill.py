"""A prefill step's long rows on FlashInfer's FlashAttention-3 kernel (sm_90a: warp-specialized
wgmma with TMA, a persistent grid of one program an SM), where the ``flashinfer`` package is
importable; the step's other rows stay on the Triton prefill kernel (``triton_prefill_attention``).

The kernel runs work items (query head, row, query tile: 128 tokens, 192 at head_dim 64) from
lists that say which program runs which: FlashInfer plans them on the host (``PrefillSM90Plan``)
and copies them in per call.
Here ``_work_lists`` writes them on the device from the step's tile schedule (``tile_schedule``:
tiles most keys first), inside the step's CUDA graph and shared by every layer, so the step keeps
its one host-to-device copy and the host reads no lengths. Items are dealt to the programs in
snake order (most keys first, the direction turning each round), FlashInfer's cost-sorted
dealing without its heap.

The kernel reads the cache through the step's block table as FlashInfer's page indices (a row's
pages start at row * the table's stride) and each item's key count from the lists: causal,
bottom-right (a row's queries are the last of its keys), as the Triton kernels. bf16 / fp16 caches
and queries, head_dim 64 / 128 / 256; not the e4m3 cache, not batch-invariant mode (its own
kernels), not an output quantized for an FP8 o projection (the attention layer asks for none in
such a step).

The step's one-token rows run the split-K decode kernel (``attend_decode_rows``): alone, without
the prompts' tiles to overlap, the prefill kernel's one program a row and KV head streams a long
row's keys at a fraction of the memory bandwidth that key splits reach; the split count assumes
few decode rows among the step's (``mixed_step_splits``).

The lists follow FlashInfer 0.7's layout (``PrefillPlanSM90Info``), an internal of its; ``ready``
checks the kernel against a float32 attention before the engine takes it."""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import triton
import triton.language as tl

from megatron_async.forward_batch import AttentionMetadata
from megatron_async.kernels import attention_torch
from megatron_async.kernels.decode_splits import mixed_step_splits
from megatron_async.kernels.triton_decode_attention import decode_attention
from megatron_async.kernels.triton_paged_common import num_compute_units
from megatron_async.kernels.triton_tile_schedule import tile_schedule

log = logging.getLogger(__name__)


def tile_q(head_dim: int) -> int:
    """Query tokens of the kernel's tile: 192 at head_dim 64, else 128 (FlashInfer's ``cta_tile_q``
    in ``PrefillSM90Plan``, which the lists' tile indices count in)."""
    return 192 if head_dim == 64 else 128


MIN_QUERY = 128
"""Rows with this many query tokens or more go to the kernel; shorter rows (decode rows, short
chunks) would fill a fraction of a tile each and stay on the Triton kernel."""
HEAD_DIMS = (64, 128, 256)
"""The head dims FlashInfer's FA3 builds (``test_flashinfer_prefill``'s GPU tests run each)."""
CHECK_TOLERANCE = 3e-2
"""``self_check``'s bound on the largest error of bf16 / fp16 outputs of unit-variance values."""
_LISTS = 8  # qo tile, qo start, page start, qo len, kv len, head, program start (work_indptr), row


def unusable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot serve this model on ``device`` (None: it can)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "FlashInfer's FA3 prefill kernel is built for sm_90a (H100 / H200)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashInfer's FA3 prefill kernel takes bf16 / fp16, not {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"FlashInfer's FA3 prefill kernel takes head_dim {HEAD_DIMS}, not {head_dim}"
    try:
        import flashinfer.prefill  # noqa: F401
    except ImportError as e:
        return f"flashinfer is not importable ({e})"
    return None


@functools.cache
def module(dtype: torch.dtype, head_dim: int):
    """FlashInfer's FA3 batch-prefill module for 16-bit Q / KV / O and int32 indices (built by
    FlashInfer's JIT on first use, minutes, then from its cache under ~/.cache/flashinfer)."""
    from flashinfer.prefill import get_batch_prefill_module

    log.info("loading FlashInfer's FA3 prefill kernel (%s, head_dim %d; a first build takes minutes)", dtype, head_dim)
    # positional, as FlashInfer's wrapper passes them: no rope, no window, no soft cap, no fp16 reduction
    return get_batch_prefill_module("fa3", dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False, False)


@functools.cache
def _float_workspace(device: torch.device) -> torch.Tensor:
    """The kernel's float workspace (split-KV partials, which the paged FA3 kernel does not use)."""
    return torch.empty(1 << 20, dtype=torch.uint8, device=device)


@triton.jit
def _first_item(c, rounds, rem, num_programs):
    """Program c's first position in the lists: one item a round before it, plus the programs before
    it that the last, partial round reaches (from the front in an even round, from the back in an odd one)."""
    return c * rounds + tl.where(rounds % 2 == 0, tl.minimum(c, rem), tl.maximum(c - (num_programs - rem), 0))


@triton.jit(do_not_specialize=["num_programs", "table_stride"])
def _work_lists(entry_ptr, live_ptr, cu_q_ptr, kv_lens_ptr, tile_ptr, qo_ptr, page_ptr, qo_len_ptr, kv_len_ptr,
                head_ptr, indptr_ptr, row_ptr, num_programs, table_stride,
                HEADS: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Item j = (tile j // HEADS of the schedule, head j % HEADS), dealt in snake order: round k =
    j // P gives one item to each of the P programs, forwards in even rounds, backwards in odd ones;
    the last round's partial share goes to the programs that round reaches first."""
    n = tl.load(live_ptr).to(tl.int32) * HEADS
    rounds = n // num_programs
    rem = n - rounds * num_programs
    if tl.program_id(0) == 0:  # each program's first item
        for c0 in range(0, num_programs + 1, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(indptr_ptr + c, _first_item(c, rounds, rem, num_programs), mask=c <= num_programs)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < n
    entry = tl.load(entry_ptr + j // HEADS, mask=live, other=0)
    row = (entry >> 32).to(tl.int32)
    q_first = (entry & 0xFFFFFFFF).to(tl.int32)
    k = j // num_programs
    i = j - k * num_programs
    c = tl.where(k % 2 == 0, i, num_programs - 1 - i)
    pos = _first_item(c, rounds, rem, num_programs) + k
    q_begin = tl.load(cu_q_ptr + row, mask=live, other=0)
    q_len = tl.load(cu_q_ptr + row + 1, mask=live, other=0) - q_begin
    tl.store(tile_ptr + pos, q_first // TILE, mask=live)
    tl.store(qo_ptr + pos, q_begin, mask=live)
    tl.store(page_ptr + pos, row * table_stride, mask=live)
    tl.store(qo_len_ptr + pos, q_len, mask=live)
    tl.store(kv_len_ptr + pos, tl.load(kv_lens_ptr + row, mask=live, other=0), mask=live)
    tl.store(head_ptr + pos, j % HEADS, mask=live)
    tl.store(row_ptr + pos, row, mask=live)


def work_lists(meta: AttentionMetadata, num_heads: int, programs: int,
               tile: int) -> tuple[torch.Tensor, list[int]]:
    """(int32 workspace, FlashInfer's plan info: the byte offsets of its lists) of the step's rows of
    ``MIN_QUERY``+ tokens in ``tile``-query tiles (``tile_q``) dealt to ``programs`` programs (the
    kernel launches one an SM); computed by the first layer that asks and kept on ``meta``."""
    key = ("fa3_lists", num_heads, programs, tile)
    if key not in meta.scratch:
        slots = meta.num_tokens // tile + meta.num_rows
        schedule = tile_schedule(meta, tile, slots, min_query=MIN_QUERY)
        live = (schedule >= 0).sum(dtype=torch.int32)
        items = -(-slots * num_heads // 4) * 4  # each list 16-byte aligned
        sizes = [items] * 6 + [-(-(programs + 1) // 4) * 4, items]
        ws = torch.empty(sum(sizes), dtype=torch.int32, device=meta.cu_query_lens.device)
        lists = list(torch.split(ws, sizes))
        block = 1024
        _work_lists[(triton.cdiv(slots * num_heads, block),)](
            schedule, live, meta.cu_query_lens, meta.kv_lens, *lists, programs, meta.block_table.stride(0),
            HEADS=num_heads, TILE=tile, BLOCK=block)
        offsets = [4 * sum(sizes[:i]) for i in range(_LISTS)]
        meta.scratch[key] = ws, offsets + [0]  # 0: a schedule per head
    return meta.scratch[key]


def attend_long_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     out: torch.Tensor) -> None:
    """Causal attention of the step's rows of ``MIN_QUERY``+ query tokens over their paged keys into
    ``out`` ([T, H, D]; the other rows' outputs untouched). q [T, H, D], the cache [2, blocks,
    block_size, KVH, D] of q's dtype, the new keys already appended."""
    ws, plan_info = work_lists(meta, q.shape[1], num_compute_units(q.device), tile_q(q.shape[2]))
    table = meta.block_table
    if not table.is_contiguous():
        raise ValueError("attend_long_rows: the block table must be contiguous (its rows are the kernel's page lists)")
    module(q.dtype, q.shape[2]).paged_run(
        _float_workspace(q.device), ws, plan_info, q, kv_cache[0], kv_cache[1], meta.cu_query_lens, meta.kv_lens,
        table.view(-1), meta.kv_lens, out, None,
        1, 0, -1, False,  # causal mask, NHD layout, no window, no programmatic dependent launch
        None, None, None, None, None, None,  # custom mask / indptr, alibi, prefix / item positions
        0.0, scale, None, None, None, 1.0, 1e4, 0, 0)  # no soft cap, the scale, no FP8 scales, rope unused


@triton.jit
def _scatter_rows(src_ptr, dst_ptr, cu_q_ptr, stride_s, stride_d, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """dst[cu_q[r]] = src[r] for each row r of exactly one query token."""
    r = tl.program_id(0)
    first = tl.load(cu_q_ptr + r)
    if tl.load(cu_q_ptr + r + 1) - first == 1:
        offs = tl.arange(0, BLOCK)
        vals = tl.load(src_ptr + r.to(tl.int64) * stride_s + offs, mask=offs < WIDTH)
        tl.store(dst_ptr + first.to(tl.int64) * stride_d + offs, vals, mask=offs < WIDTH)


def attend_decode_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       out: torch.Tensor) -> None:
    """The step's rows of one query token on the split-K decode kernel into ``out`` (other rows'
    outputs untouched): through a view of the step with one query a row, each row's last token,
    the rows of more tokens (or none) given no keys and their outputs not copied back."""
    last, view = _decode_view(meta)
    splits = mixed_step_splits(meta.num_rows, kv_cache.shape[3], meta.block_table.shape[1], kv_cache.shape[2], q.device)
    got = decode_attention(q[last], kv_cache, view, scale, num_splits=splits)
    width = q.shape[1] * q.shape[2]
    _scatter_rows[(meta.num_rows,)](got, out, meta.cu_query_lens, got.stride(0), out.stride(0), WIDTH=width,
                                    BLOCK=triton.next_power_of_2(width))


def _decode_view(meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """(each row's last token, the one-query-a-row view of the step) for ``attend_decode_rows``;
    built by the first layer that asks and kept on ``meta``."""
    if "fa3_decode_view" not in meta.scratch:
        rows, cu = meta.num_rows, meta.cu_query_lens
        last = (cu[1: rows + 1] - 1).clamp(min=0).long()
        one = (cu[1: rows + 1] - cu[:rows]) == 1
        view = dataclasses.replace(meta, num_tokens=rows, max_query_len=1, is_decode_only=True,
                                   positions=meta.positions[last], kv_lens=torch.where(one, meta.kv_lens[:rows], 0),
                                   cu_query_lens=torch.arange(rows + 1, dtype=cu.dtype, device=cu.device),
                                   row_order=None, long_tiles=False)
        meta.scratch["fa3_decode_view"] = last, view
    return meta.scratch["fa3_decode_view"]


def self_check(device: torch.device, dtype: torch.dtype, head_dim: int) -> float:
    """The largest error of ``attend_long_rows`` against a float32 causal attention on a fresh random
    row (a 300-token chunk after 200 cached tokens, 4 / 2 heads, 16-token pages). The work lists are
    laid out as FlashInfer 0.7 reads them (``PrefillPlanSM90Info``); the engine runs this once at
    start-up, so that a release that reads them otherwise falls back to Triton instead of serving
    wrong attention."""
    gen = torch.Generator().manual_seed(0)
    cached, new, heads, kv_heads, page = 200, 300, 4, 2, 16
    total, pages = cached + new, -(-(cached + new) // page)
    q = torch.randn(new, heads, head_dim, generator=gen).to(device, dtype)
    kv = torch.randn(2, pages, page, kv_heads, head_dim, generator=gen).to(device, dtype)
    i32 = dict(dtype=torch.int32, device=device)
    positions = torch.arange(cached, total, device=device)
    meta = AttentionMetadata(
        num_tokens=new, num_rows=1, max_query_len=new, max_kv_len=total, is_decode_only=False, positions=positions,
        slot_mapping=positions.clone(), token_to_row=torch.zeros(new, **i32), cu_query_lens=torch.tensor([0, new], **i32),
        kv_lens=torch.tensor([total], **i32), block_table=torch.arange(pages, **i32).view(1, pages), block_size=page,
        long_tiles=True)
    out = torch.zeros_like(q)
    attend_long_rows(q, kv, meta, head_dim**-0.5, out)
    ref = attention_torch.paged_attention(q.float(), kv.float(), meta, head_dim**-0.5)
    return (out.float() - ref).abs().max().item()


def ready(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel can serve a model of ``dtype`` / ``head_dim`` on ``device``: usable here,
    loaded (built on first use) and right on ``self_check``; why not is logged (a failed build, load
    or check as a warning), and the long rows then stay on Triton."""
    why = unusable(device, dtype, head_dim)
    if why is not None:
        log.info("long prefill rows on the Triton attention: %s", why)
        return False
    try:
        error = self_check(device, dtype, head_dim)
    except Exception as e:  # noqa: BLE001 (a JIT build without nvcc, a release whose API moved)
        log.warning("FlashInfer's FA3 prefill kernel did not load (%s: %s); long prefill rows stay on Triton",
                    type(e).__name__, e)
        return False
    if not error <= CHECK_TOLERANCE:
        log.warning("FlashInfer's FA3 prefill kernel is off by %g from a float32 attention at start-up (a release "
                    "whose work lists differ?); long prefill rows stay on Triton", error)
        return False
    return True
