"""GPU checks and timings of the fused TP all-reduce + residual add + RMSNorm
(``P2PAllReduce.add_rms_norm``, kernels/triton_fused_all_reduce.py) against the unfused path
(the P2P all-reduce, then ``add_rms_norm``), on spawned ranks: called by
``all_reduce_checks.all_reduce_worker`` (``--fused`` in python -m benchmarks all-reduce, and
tests/functional_tests/test_multigpu_p2p_all_reduce.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_async.kernels import triton_rmsnorm
from megatron_async.parallel.p2p_all_reduce import P2PAllReduce

HIDDEN = 4096
EPS = 1e-6
ROWS = [1, 5, 64, 128, 200]  # decode batches: bf16 8 KB .. 1.6 MB (fp32 200 rows is above the fused limit)


def _inputs(rows: int, dtype: torch.dtype, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's partial, the residual and norm weight, identical on every rank)."""
    own = torch.Generator(device="cuda").manual_seed(seed + 1000 * rank)
    shared = torch.Generator(device="cuda").manual_seed(seed + 7)
    partial = torch.randn(rows, HIDDEN, device="cuda", generator=own).to(dtype)
    residual = (3 * torch.randn(rows, HIDDEN, device="cuda", generator=shared)).to(dtype)
    weight = (1 + 0.3 * torch.randn(HIDDEN, device="cuda", generator=shared)).to(dtype)
    return partial, residual, weight


def unfused(reducer: P2PAllReduce, partial: torch.Tensor, residual: torch.Tensor,
            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the layers run with the fused path off: the all-reduce in place, then add + RMSNorm."""
    if reducer.accepts(partial):
        reducer.all_reduce(partial)
    else:
        dist.all_reduce(partial, group=reducer.group)
    return triton_rmsnorm.add_rms_norm(partial, residual, weight, EPS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _ranks_equal(t: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def check_fused_norm(reducer: P2PAllReduce, group, seed: int) -> list[dict]:
    """Per dtype and row count, fresh random data: whether ``fuses_norm`` takes it, and the fused
    results against the unfused path (relative errors of the normed output and of the new
    residual) and across ranks (identical bits)."""
    rank, rows_out = dist.get_rank(group), []
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            partial, residual, weight = _inputs(rows, dtype, rank, seed + rows)
            row = {"dtype": str(dtype).split(".")[-1], "rows": rows, "bytes": partial.numel() * partial.element_size(),
                   "fused": reducer.fuses_norm(partial), "fused_max_bytes": reducer.fused_max_bytes,
                   "buffer_bytes": reducer.max_bytes, "world": reducer.peers.world_size}
            if row["fused"]:
                out, new_res = reducer.add_rms_norm(partial, residual, weight, EPS, True)
                ref_out, ref_res = unfused(reducer, partial.clone(), residual, weight)
                row.update(out_rel=_rel(out, ref_out), residual_rel=_rel(new_res, ref_res),
                           residual_equal=bool(torch.equal(new_res, ref_res)),
                           ranks_equal=_ranks_equal(out, group) and _ranks_equal(new_res, group),
                           **_two_shot_check(reducer, partial, residual, weight, out, new_res))
                if dtype == torch.bfloat16:  # K-split partials: their sum in split order, rounded, then the same
                    pieces = 0.5 * torch.randn(4, rows, HIDDEN, device="cuda",
                                               generator=torch.Generator(device="cuda").manual_seed(seed + rank))
                    summed = pieces[0].clone()
                    for piece in pieces[1:]:
                        summed += piece
                    split = reducer.add_rms_norm(pieces, residual, weight, EPS, True)
                    whole = reducer.add_rms_norm(summed.to(dtype), residual, weight, EPS, True)
                    row["split_equal"] = all(torch.equal(a, b) for a, b in zip(split, whole))
            rows_out.append(row)
    return rows_out


def _two_shot_check(reducer: P2PAllReduce, partial, residual, weight, out, new_res) -> dict:
    """Whether the call above ran the two-shot kernel, and if so whether the one-shot kernel
    gives the same bits on the same inputs (every rank makes the same calls)."""
    from megatron_async.kernels import triton_fused_all_reduce as fused

    p = reducer.peers
    two = p.second_barrier and fused.takes_two_shot(partial, residual, p.world_size)
    if not two:
        return {"two_shot": False}
    one = fused.all_reduce_add_rms_norm(partial, residual, weight, EPS, True, p.buffers, p.signal_pads, p.state,
                                        p.half_bytes, p.rank, p.max_programs, two_shot=False)
    return {"two_shot": True, "shots_equal": torch.equal(one[0], out) and torch.equal(one[1], new_res)}


def check_fused_graph_replay(reducer: P2PAllReduce, group, seed: int, replays: int = 3) -> list[bool]:
    """A CUDA graph of three fused calls (1, 64 and 128 rows, bf16) replayed on fresh inputs:
    each replay gives the bits an eager fused call gives on the same inputs (flags reset, fixed
    pointers). Returns one verdict per replay."""
    rank = dist.get_rank(group)
    static = [_inputs(rows, torch.bfloat16, rank, seed + rows) for rows in (1, 64, 128)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for p, r, w in static:
            reducer.add_rms_norm(p, r, w, EPS, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outs = [reducer.add_rms_norm(p, r, w, EPS, True) for p, r, w in static]
    verdicts = []
    for i in range(replays):
        for (p, r, _), rows in zip(static, (1, 64, 128)):
            fresh_p, fresh_r, _ = _inputs(rows, torch.bfloat16, rank, seed + 100 * (i + 1) + rows)
            p.copy_(fresh_p)
            r.copy_(fresh_r)
        graph.replay()
        eager = [reducer.add_rms_norm(p, r, w, EPS, True) for p, r, w in static]
        verdicts.append(all(torch.equal(a, b) for (o, n), (eo, en) in zip(outs, eager) for a, b in ((o, eo), (n, en))))
    torch.cuda.synchronize()
    return verdicts


def time_layer_halves(reducer: P2PAllReduce, group, rows_list: list[int], iters: int, graph_us) -> list[dict]:
    """us per layer (two all-reduce + add + RMSNorm, bf16, hidden 4096) inside CUDA graphs: the
    unfused path (2 kernels each) against the fused kernel (1 each). ``graph_us(ops, iters)``
    times a list of ops replayed in one graph (all_reduce_checks._graph_us)."""
    rank, rows_out = dist.get_rank(group), []
    for rows in rows_list:
        pairs = [_inputs(rows, torch.bfloat16, rank, 11 + i) for i in range(16)]
        un = [lambda p=p, r=r, w=w: unfused(reducer, p, r, w) for p, r, w in pairs]
        fu = [lambda p=p, r=r, w=w: reducer.add_rms_norm(p, r, w, EPS, True) for p, r, w in pairs]
        unfused_us, fused_us = 2 * graph_us(un, iters), 2 * graph_us(fu, iters)
        rows_out.append({"rows": rows, "bytes": rows * HIDDEN * 2, "unfused_layer_us": unfused_us,
                         "fused_layer_us": fused_us, "fused": reducer.fuses_norm(pairs[0][0])})
    return rows_out


def assert_fused_report(values: list[dict], replays: list[bool]) -> None:
    """What one rank's fused checks must show (AssertionError with the row)."""
    for row in values:
        # FUSED_NORM_MAX_BYTES, and world_size pushed messages fit the reducer's buffer
        assert row["fused_max_bytes"] == min(2 << 20, row["buffer_bytes"] // row["world"]), row
        assert row["fused"] == (row["bytes"] <= row["fused_max_bytes"]), row
        if not row["fused"]:
            continue
        assert row["ranks_equal"], row
        # at 4+ ranks, messages of 512 KB+ (64+ bf16 rows) run the two-shot kernel: one-shot's bits
        assert row["two_shot"] == (row["world"] >= 4 and row["bytes"] >= 512 << 10), row
        assert row.get("shots_equal", True), row
        if row["dtype"] == "float32":  # rank order, float32 adds: the unfused P2P path's sums exactly
            assert row["residual_equal"] and row["out_rel"] < 1e-6, row
        else:  # bf16: one rounding of the float32 sum vs torch's per-add rounding
            assert row["residual_rel"] < 4e-3 and row["out_rel"] < 8e-3, row
            assert row["split_equal"], row
    assert replays and all(replays), replays
