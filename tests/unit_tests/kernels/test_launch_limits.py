"""Every tile table of kernels/ picks a launch the device can hold: the shared check
(``launch_limits``) against an H100's, an A100's and a 99 KiB opt-in, for the operand types each
kernel takes; the fp32 fused-MoE gate_up that asked an H100 for 294,912 bytes; a planted over-size
entry refused. Limits are plain numbers: nothing here needs a GPU."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from megatron_async.kernels import (  # noqa: E402
    cuda_device,
    launch_limits,
    triton_fp8_gemm,
    triton_fp8_grouped,
    triton_fp8_moe,
    triton_fused_moe,
    triton_grouped_gemm,
    triton_invariant_matmul,
    triton_prefill_attention,
    triton_split_linear,
    triton_swiglu_matmul,
    triton_tma_linear,
)
from megatron_async.kernels.launch_limits import A100, H100, DeviceLimits, LaunchLimitError  # noqa: E402

LIMITS = st.sampled_from([H100, A100, DeviceLimits(101_376)])
CUDA = torch.device("cuda", 0)
SMS = 132


def _fits(tiles, footprint, limits) -> bool:
    return launch_limits.fits(footprint(tiles), limits)


def test_the_fp32_gate_up_that_failed_on_an_h100_picks_a_launch_that_fits(monkeypatch):
    """Qwen3-30B-A3B's experts (hidden 2,048, intermediate 768) in float32, prefill-size blocks of 64
    pairs, gated: 3 stages of the prefill tiles are over an H100's 232,448 bytes (Triton asked for
    294,912); the launch fused_experts makes fits."""
    hidden, inter, block_m = 2048, 768, 64
    old = launch_limits.gemm_footprint(block_m, 256, 64, 3, 8, 4, 4, b_tiles=2)
    assert old.shared_bytes >= 294_912 > H100.shared_memory
    picked = triton_fused_moe.default_tiles(block_m, 2, 4, 4, H100)
    footprint = launch_limits.gemm_footprint(block_m, picked.block_n, picked.block_k, picked.num_stages,
                                             picked.num_warps, 4, 4, b_tiles=2)
    assert footprint.shared_bytes <= H100.shared_memory
    assert (picked.block_n, picked.block_k) == (256, 64) and picked.num_stages < 3  # fewer stages first

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs)
                raise StopIteration
            return launch

    monkeypatch.setattr(launch_limits, "device_limits", lambda device: H100)
    monkeypatch.setattr(triton_fused_moe, "_gate_up_kernel", Recorder())
    experts, tokens, top_k = 2, 80, 2  # 80 pairs an expert: blocks of 64
    x = torch.randn(tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
    with pytest.raises(StopIteration):
        triton_fused_moe.fused_experts(x, w13, w2, ids, torch.ones(tokens, top_k), True)
    (kw,) = launched
    assert kw["BLOCK_M"] == block_m
    sent = launch_limits.gemm_footprint(block_m, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_stages"], kw["num_warps"],
                                        4, 4, b_tiles=2)
    assert sent.shared_bytes <= H100.shared_memory


def test_device_limits_come_from_the_driver_on_cuda(monkeypatch):
    monkeypatch.setattr(cuda_device, "shared_memory_optin", lambda device: 232_448)
    assert launch_limits.device_limits(CUDA) == H100
    assert launch_limits.device_limits(torch.device("cpu")).shared_memory is None


@settings(max_examples=60, deadline=None)
@given(limits=LIMITS, block_m=st.sampled_from([16, 32, 64]), gated=st.booleans(), elem=st.sampled_from([2, 4]))
def test_fused_moe_picks_fit(limits, block_m, gated, elem):
    b_tiles = 2 if gated else 1
    t = triton_fused_moe.default_tiles(block_m, b_tiles, elem, elem, limits)
    assert _fits(t, triton_fused_moe._footprint(block_m, b_tiles, elem, elem), limits)


@settings(max_examples=60, deadline=None)
@given(limits=LIMITS, rows=st.sampled_from(sorted(triton_fp8_moe.FP8_MOE_TILES)), gated=st.booleans(),
       a_bytes=st.sampled_from([1, 2, 4]), out_bytes=st.sampled_from([2, 4]))
def test_fp8_moe_picks_fit(limits, rows, gated, a_bytes, out_bytes):
    t = triton_fp8_moe.fp8_moe_tiles(rows, a_bytes, out_bytes, gated, limits)
    assert _fits(t, triton_fp8_moe.gate_up_footprint(rows, a_bytes, gated), limits)
    assert _fits(t, triton_fp8_moe.down_footprint(rows, out_bytes), limits)


@settings(max_examples=40, deadline=None)
@given(limits=LIMITS, gemm=st.sampled_from(["gate_up", "down"]), gated=st.booleans(), out=st.sampled_from([1, 2, 4]))
def test_fp8_grouped_picks_fit(limits, gemm, gated, out):
    t = triton_fp8_grouped.launch_tiles(gemm, gated, out, limits)
    assert t.block_m == triton_fp8_grouped.ROW_TILE and _fits(t, triton_fp8_grouped.footprint(gemm, gated, out), limits)


@settings(max_examples=40, deadline=None)
@given(limits=LIMITS, gated=st.booleans(), elem=st.sampled_from([2, 4]))
def test_grouped_gemm_picks_fit(limits, gated, elem):
    t = triton_grouped_gemm.launch_tiles(gated, elem, limits)
    assert t.block_m == triton_grouped_gemm.TILES[True].block_m  # the plan's row tile
    assert _fits(t, triton_grouped_gemm.footprint(gated, elem), limits)


@settings(max_examples=80, deadline=None)
@given(limits=LIMITS, m=st.integers(1, 16_384), n=st.sampled_from([256, 1024, 2048, 4096, 6144, 151_936]),
       k=st.sampled_from([128, 1024, 2048, 4096, 12_288]), invariant=st.booleans(), a_bytes=st.sampled_from([1, 2, 4]))
def test_fp8_gemm_picks_fit(limits, m, n, k, invariant, a_bytes):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_fp8_gemm, "num_compute_units", lambda device: SMS)
        t, _ = triton_fp8_gemm.fp8_tiles(m, n, k, CUDA, invariant)
    footprint = triton_fp8_gemm.footprint(a_bytes, 4)
    assert _fits(launch_limits.fit(t, footprint, limits), footprint, limits)


@settings(max_examples=40, deadline=None)
@given(limits=LIMITS, ranges=st.booleans())
def test_tma_linear_picks_fit(limits, ranges):  # 16-bit operands only
    t = triton_tma_linear.launch_tiles(ranges, 2, limits)
    assert t[:3] == triton_tma_linear.TILES[ranges][:3] and _fits(t, triton_tma_linear.footprint(ranges, 2), limits)


@settings(max_examples=80, deadline=None)
@given(limits=LIMITS, m=st.integers(1, 16_384), gated=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_swiglu_matmul_picks_fit(limits, m, gated, dtype):
    t = triton_swiglu_matmul.act_tiles(m, dtype, CUDA, gated, limits)
    assert _fits(t, triton_swiglu_matmul.footprint(gated, dtype.itemsize), limits)


@settings(max_examples=40, deadline=None)
@given(limits=LIMITS, m=st.integers(1, 128), n=st.sampled_from([1024, 2048]), k=st.sampled_from([2048, 4096, 12_288]))
def test_split_linear_picks_fit(limits, m, n, k):  # 16-bit operands only
    t = triton_split_linear.split_tiles(m, n, k)
    if t is not None:
        footprint = triton_split_linear.footprint(2)
        assert _fits(launch_limits.fit(t, footprint, limits), footprint, limits)


@settings(max_examples=80, deadline=None)
@given(limits=LIMITS, m=st.integers(1, 16_384), n=st.sampled_from([1024, 2048, 4096, 6144, 151_936]),
       k=st.sampled_from([1024, 2048, 4096, 12_288]), swiglu=st.booleans(), elem=st.sampled_from([2, 4]))
def test_invariant_matmul_picks_fit(limits, m, n, k, swiglu, elem):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_invariant_matmul, "num_compute_units", lambda device: SMS)
        base = triton_invariant_matmul.launch_tiles(m, n, k, CUDA, swiglu)
    t = triton_invariant_matmul.fitted_tiles(base, elem, limits, swiglu)
    assert (t.block_k, t.split_k) == (base.block_k, base.split_k)  # the K order stays
    assert _fits(t, triton_invariant_matmul.footprint(elem, swiglu), limits)


@settings(max_examples=80, deadline=None)
@given(limits=LIMITS, head_dim=st.sampled_from([64, 128, 256]), group=st.integers(1, 16),
       q_bytes=st.sampled_from([2, 4]), kv_bytes=st.sampled_from([1, 2, 4]), decode=st.booleans())
def test_attention_picks_fit(limits, head_dim, group, q_bytes, kv_bytes, decode):
    """The decode kernel (128 keys, 3 stages; 64 / 2 past 128 dims) and the prefill kernel (64 rows,
    32 keys, 2 stages) as they call the check."""
    block_g = 1 << (group - 1).bit_length()
    if decode:
        rows = max(16, block_g)
        block_n, stages = (64, 2) if head_dim > 128 else (128, 3)
        smaller = [(rows, n) for n in (64, 32, 16)]
    else:
        rows, block_n, stages = max(1, 64 // block_g) * block_g, 32, 2
        smaller = triton_prefill_attention.prefill_fallbacks(block_g)
    t = launch_limits.attention_tiles(rows, block_n, head_dim, stages, 4, q_bytes, kv_bytes, limits, smaller)
    footprint = launch_limits.attention_footprint(t.rows, t.block_n, head_dim, t.num_stages, 4, q_bytes, kv_bytes)
    assert t.rows <= rows and t.rows % block_g == 0 and t.block_n <= block_n and launch_limits.fits(footprint, limits)


@settings(max_examples=100, deadline=None)
@given(limits=LIMITS, table=st.lists(st.tuples(st.sampled_from([16, 32, 64, 128, 256]),
                                               st.sampled_from([16, 32, 64, 128, 256]), st.integers(1, 6)),
                                     min_size=1, max_size=6),
       elem=st.sampled_from([1, 2, 4]))
@example(limits=H100, table=[(256, 32, 1), (16, 128, 2)], elem=4)  # the first refused for its registers
def test_fit_never_picks_what_does_not_fit_nor_anything_bigger(limits, table, elem):
    entries = [triton_fused_moe.GemmTiles(bn, bk, 4, stages) for bn, bk, stages in table]
    footprint = triton_fused_moe._footprint(64, 2, elem, elem)
    try:
        t = launch_limits.fit(entries[0], footprint, limits, entries)
    except LaunchLimitError:
        assert not any(_fits(dataclasses.replace(e, num_stages=1), footprint, limits) for e in entries
                       if footprint(e).stage_bytes <= footprint(entries[0]).stage_bytes)
        return
    assert _fits(t, footprint, limits)
    # no bigger tile than the preferred one (shared memory a stage), never more stages than its table entry
    # has (an entry with a smaller tile may keep more stages than the preferred one, and may then hold more
    # shared memory in all: it fits, which is the point)
    assert footprint(t).stage_bytes <= footprint(entries[0]).stage_bytes
    assert any((e.block_n, e.block_k) == (t.block_n, t.block_k) and t.num_stages <= e.num_stages for e in entries)


def test_a_planted_over_size_entry_is_refused(monkeypatch):
    giant = triton_fused_moe.GemmTiles(block_n=1024, block_k=256, num_warps=8, num_stages=8)
    footprint = triton_fused_moe._footprint(64, 2, 2, 2)
    assert not _fits(giant, footprint, H100)
    # the table's preferred entry: the largest that fits instead
    monkeypatch.setattr(triton_fused_moe, "_PREFILL_TILES", giant)
    monkeypatch.setattr(triton_fused_moe, "_TABLE", (*triton_fused_moe._TABLE, giant))
    t = triton_fused_moe.default_tiles(64, 2, 2, 2, H100)
    assert t != giant and _fits(t, footprint, H100)
    # an entry bigger than the preferred one is never taken, even where it alone would fit (the
    # preferred one's accumulators on one warp are over a thread's registers)
    one_warp = triton_fused_moe.GemmTiles(block_n=256, block_k=16, num_warps=1, num_stages=1)
    bigger = triton_fused_moe.GemmTiles(block_n=256, block_k=32, num_warps=8, num_stages=1)
    assert not _fits(one_warp, footprint, H100) and _fits(bigger, footprint, H100)
    with pytest.raises(LaunchLimitError, match="fits the device"):
        launch_limits.fit(one_warp, footprint, H100, (one_warp, bigger))
    # an explicit launch over the limit: refused before the compiler sees it
    monkeypatch.setattr(launch_limits, "device_limits", lambda device: H100)
    x, w13, w2 = torch.randn(80, 64), torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    ids = torch.arange(160).remainder(2).view(80, 2)
    with pytest.raises(LaunchLimitError, match="does not fit"):
        triton_fused_moe.fused_experts(x, w13, w2, ids, torch.ones(80, 2), True, gate_up_tiles=giant)


def test_accumulators_past_the_register_file_are_refused():
    """Two 128 x 256 float32 accumulators on 4 warps: 512 registers a thread, over the 255 a thread addresses."""
    footprint = launch_limits.gemm_footprint(128, 256, 16, 1, 4, 2, 2, b_tiles=2)
    assert footprint.accumulator_registers == 512
    assert "accumulator registers" in launch_limits.refusal(footprint, DeviceLimits(None))


@pytest.mark.parametrize("m", [1, 16, 64, 128, 256, 2048, 8192])
def test_an_h100_keeps_every_tuned_launch_for_its_operand_type(monkeypatch, m):
    """The tables were measured on an H100 with 16-bit (and e4m3) operands: there nothing changes."""
    for module in (triton_fp8_gemm, triton_invariant_matmul):
        monkeypatch.setattr(module, "num_compute_units", lambda device: SMS)
    for n, k in [(1024, 1024), (3072, 1024), (6144, 4096), (4096, 12_288), (151_936, 1024)]:
        t, pre = triton_fp8_gemm.fp8_tiles(m, n, k, CUDA)
        assert launch_limits.fit(t, triton_fp8_gemm.footprint(1 if pre else 2, 2), H100) == t
        for swiglu in (False, True):
            cfg = triton_invariant_matmul.launch_tiles(m, n, k, CUDA, swiglu)
            assert triton_invariant_matmul.fitted_tiles(cfg, 2, H100, swiglu) == cfg
    for gated in (False, True):
        t = triton_swiglu_matmul.act_tiles(m, torch.bfloat16, CUDA, gated, launch_limits.INTERPRETER)
        assert triton_swiglu_matmul.act_tiles(m, torch.bfloat16, CUDA, gated, H100) == t
        assert triton_grouped_gemm.launch_tiles(gated, 2, H100) == triton_grouped_gemm.TILES[gated]
        assert triton_tma_linear.launch_tiles(gated, 2, H100) == triton_tma_linear.TILES[gated]
    for rows, tiles in triton_fp8_moe.FP8_MOE_TILES.items():
        assert triton_fp8_moe.fp8_moe_tiles(rows, 2, 2, True, H100) == tiles
    for gemm, tiles in triton_fp8_grouped.TILES.items():
        assert triton_fp8_grouped.launch_tiles(gemm, True, 2, H100) == tiles
    assert triton_fused_moe.default_tiles(64, 2, 2, 2, H100) == triton_fused_moe._PREFILL_TILES
    assert triton_fused_moe.default_tiles(16, 2, 2, 2, H100) == triton_fused_moe._DECODE_TILES
    for head_dim in (64, 128, 256):  # the decode kernel's 128 (64 wide) keys on 3 (2) stages, the prefill's 2
        n, stages = (64, 2) if head_dim > 128 else (128, 3)
        assert launch_limits.attention_tiles(16, n, head_dim, stages, 4, 2, 2, H100) == (16, n, stages)
        assert launch_limits.attention_tiles(64, 32, head_dim, 2, 4, 2, 2, H100) == (64, 32, 2)


def test_resident_programs_counts_registers_shared_memory_and_threads():
    """What the compiled kernels reported on an H200 (registers a thread, shared bytes) against what
    an SM holds: the FP8 grouped gate_up uncapped (185 registers, 8 warps) one, capped at 128 two;
    three stages of it (131 KB) one by shared memory; the decode attention (238, 4 warps) two; a
    small elementwise kernel the thread limit's 16."""
    assert launch_limits.resident_programs(8, 185, 0, H100) == 1
    assert launch_limits.resident_programs(8, 128, 90_144, H100) == 2
    assert launch_limits.resident_programs(8, 128, 131_128, H100) == 1
    assert launch_limits.resident_programs(4, 238, 74_240, H100) == 2
    assert launch_limits.resident_programs(4, 32, 0, H100) == 16
    assert launch_limits.resident_programs(4, 32, 0, launch_limits.INTERPRETER) == 16


def test_fp8_grouped_programs_an_sm_fit_it_together():
    """The FP8 grouped MoE GEMMs launch ``per_sm`` programs an SM so one scales while the other's dot
    runs: that many must fit one SM at once, by shared memory and by registers (a thread at its cap,
    or at 255 uncapped). gate_up on three uncapped stages (131 KB, 185 registers a thread) ran one."""
    def held(tiles, shared: int) -> int:  # each thread at its cap, or at the 255 a thread may address
        return launch_limits.resident_programs(tiles.num_warps, tiles.maxnreg or H100.thread_registers, shared, H100)

    for gemm, asked in triton_fp8_grouped.TILES.items():
        tiles = triton_fp8_grouped.launch_tiles(gemm, True, 2, H100)
        shared = triton_fp8_grouped.footprint(gemm, True, 2)(tiles).shared_bytes
        assert held(tiles, shared) >= asked.per_sm, (gemm, tiles)
    three_stages = triton_fp8_grouped.GroupedTiles(64, 8, 3, 2)
    assert held(three_stages, triton_fp8_grouped.footprint("gate_up", True, 1)(three_stages).shared_bytes) == 1


@pytest.mark.parametrize("limits", [H100, A100, DeviceLimits(101_376)], ids=["h100", "a100", "99k"])
def test_every_swept_prefill_launch_is_fitted_to_the_device(limits):
    """Each launch ``kernel-times prefill-attention`` tries, as ``fitted_launch`` hands it to the compiler
    (head_dim 128, bf16, groups 2 and 4): within the device's shared memory and a thread's registers and
    never bigger than asked, the kernel variant and warps kept. On an H100, 128 x 128 tiles on 4 stages
    (320 KiB) drop to the 2 that fit and the default launch stays as tuned."""
    from benchmarks.kernel_times.prefill_attention import candidates
    from megatron_async.kernels.triton_prefill_common import HOPPER_LONG, PrefillLaunch, fitted_launch, prefill_launch

    asked_all = {c for bs in (16, 64, 128) for c in candidates(bs) if c is not None}
    asked_all.add(PrefillLaunch(128, 128, 8, 4, 0, "tma"))
    for block_g in (2, 4):
        for asked in asked_all:
            t = fitted_launch(asked, block_g, 128, 2, 2, limits)
            footprint = launch_limits.attention_footprint(t.rows, t.block_n, 128, t.num_stages, t.num_warps, 2, 2)
            assert launch_limits.fits(footprint, limits), (asked, t)
            assert t.rows <= asked.rows and t.block_n <= asked.block_n and t.num_stages <= asked.num_stages
            assert (t.kernel, t.num_warps, t.warp_specialize, t.maxnreg) == (asked.kernel, asked.num_warps,
                                                                              asked.warp_specialize, asked.maxnreg)
    big = PrefillLaunch(128, 128, 8, 4, 0, "tma")
    assert launch_limits.attention_footprint(128, 128, 128, 4, 8, 2, 2).shared_bytes > H100.shared_memory
    if limits is H100:
        assert fitted_launch(big, 2, 128, 2, 2, H100) == big._replace(num_stages=2)
        default = prefill_launch(2, 128, 16, CUDA)
        assert fitted_launch(default, 2, 128, 2, 2, H100) == default
        assert fitted_launch(HOPPER_LONG, 2, 128, 2, 2, H100) == HOPPER_LONG


def test_a_prefill_launch_no_tile_of_fits_is_refused():
    """128 x 128 float32 tiles on one warp: over a thread's registers at any stage count, and every
    fallback tile too on a device of 16 KiB."""
    from megatron_async.kernels.triton_prefill_common import PrefillLaunch, fitted_launch

    with pytest.raises(LaunchLimitError, match="fits the device"):
        fitted_launch(PrefillLaunch(128, 128, 1, 2, 0, "wide"), 2, 128, 4, 4, DeviceLimits(16_384))

