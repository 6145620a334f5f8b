"""Fused Triton MoE against the torch reference on CUDA for a Qwen3-30B-A3B MoE layer (hidden 2048,
128 experts, top-8, moe_intermediate 768, bf16; tests/helpers/moe_layers.py): time per call, and
the whole MoE layer (router + experts) in a CUDA graph against its floor: reading the weights of
the experts the batch activates at the device's copy bandwidth. Errors and same-bits columns are
for orientation: the assertions are tests/unit_tests/kernels/test_fused_moe_gpu.py's,
test_moe_grouped_mm_gpu.py's and test_moe_plan.py's.

    python -m benchmarks kernel-times fused-moe [--tokens 1 8 32 128 512 2048] [--iters 30] [--sweep | --by-kernel]
    python -m benchmarks kernel-times fused-moe --grouped-mm [--tokens 512 1024 2048 8192]

Columns: tokens; active experts; their weights in MB; floor us (weights / copy bandwidth);
layer_graph us (router + align + 2 grouped GEMMs, replayed graph) and its ratio to the floor;
fused / reference: eager time of the routed experts alone; err: max |fused - ref| / max |ref|.

``--grouped-mm``: the routed experts alone through the fused Triton MoE and through the grouped
path (``moe_grouped_mm``) as the dispatch runs it and with its GEMMs forced onto torch's grouped
GEMM (CUTLASS) or ``triton_grouped_gemm``, eager and replayed in a graph, at prefill token counts:
ms per call, TFLOP/s of the routed FLOPs (2 * tokens * k * (N * K + H * I)), max error against
the torch reference; the grouped path by kernel at the largest count first, the table last.

``--combine-norm``: the grouped GEMM's last step and the next block's residual add + RMSNorm,
as ``combine_slots`` then ``add_rms_norm`` (two kernels) against the one kernel of a deferred
combine (``moe_grouped_mm.PendingCombine``): equal bits (both norm orders), then us per call
in a CUDA graph of 48 calls (one per layer) at each --tokens (default 2048 8192), the table
last.

    python -m benchmarks kernel-times fused-moe --combine-norm [--tokens 2048 8192]

``--plan``: the grouped GEMM's row plan (``triton_moe_plan.plan_rows``, two kernels) at 4,096,
16,384 and 65,536 pairs (512, 2,048, 8,192 tokens of the layer's router; ``--tokens`` to change):
equal bits to ``plan_rows_torch`` (router ids, and with ids of no expert mixed in), us per plan in
a graph of 48 (one per layer) and each kernel's device time, at the default segment size then at
each segment size and warp count, the table last; then the fused MoE's alignment at each count, one
program per expert against the plan's kernels in its layout (``triton_moe_plan.align_pairs``).

    python -m benchmarks kernel-times fused-moe --plan [--tokens 512 1024 2048 4000]"""
from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import graph_call_us, graph_replay, median_ms
from megatron_async.kernels import fused_ops, moe_grouped_mm, triton_fused_moe, triton_moe_plan
from megatron_async.kernels.backends import KernelBackends
from megatron_async.kernels.moe_torch import fused_experts_torch
from megatron_async.models.layers.block import StepInputs
from megatron_async.models.layers.moe import MoEMixer
from tests.helpers.moe_layers import QWEN3_30B_HIDDEN as HIDDEN, QWEN3_30B_MOE, qwen3_30b_moe_layer

EXPERTS, TOP_K, INTER = QWEN3_30B_MOE.num_experts, QWEN3_30B_MOE.top_k, QWEN3_30B_MOE.intermediate_size
DTYPE = torch.bfloat16
TRITON = StepInputs(None, None, None, kernels=KernelBackends(attention="triton"))  # the fused MoE experts


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: (read + write) bytes / time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def kernel_table(fn, iters: int) -> list[tuple[str, float]]:
    """us per call of each kernel in ``fn``'s graph replay (torch profiler, device intervals)."""
    replay = graph_replay(fn)
    replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def sweep(layer: MoEMixer, tokens: list[int], iters: int, tiles: bool) -> None:
    """The layer by kernel, then the two grouped GEMMs' launch settings one at a time (the
    other at its default): that GEMM's device time per call (profiler intervals of graph
    replays: event timings of a ~50 us graph moved by +-10 us between identical runs), same
    bits as the default."""
    w13, w2 = layer.experts.gate_up_proj.weight, layer.experts.down_proj.weight
    GemmTiles = triton_fused_moe.GemmTiles
    for T in tokens:
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        ids, weights = layer.gate.route(x)
        print(f"\n{T} tokens: the layer by kernel (us per call in a graph)")
        for name, us in kernel_table(lambda: layer(x, TRITON), iters):
            print(f"  {us:8.1f}  {name[:100]}")
        if not tiles:
            continue
        base = triton_fused_moe.fused_experts(x, w13, w2, ids, weights, True)
        print("| GEMM | block_n | block_k | warps | stages | kernel us | same bits |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for which in ("gate_up", "down"):
            for block_n in (16, 32, 64, 128):
                for block_k in (64, 128, 256):
                    for warps, stages in ((4, 3), (4, 4), (4, 5), (8, 4)):
                        tiles = GemmTiles(block_n, block_k, warps, stages)
                        kw = {"gate_up_tiles" if which == "gate_up" else "down_tiles": tiles}
                        fn = lambda: triton_fused_moe.fused_experts(x, w13, w2, ids, weights, True, **kw)  # noqa: E731
                        try:
                            times = dict(kernel_table(fn, iters))
                        except Exception as e:  # out of shared memory for this tile
                            print(f"| {which} | {block_n} | {block_k} | {warps} | {stages} | failed: {type(e).__name__} | |")
                            continue
                        print(f"| {which} | {block_n} | {block_k} | {warps} | {stages} | {times[f'_{which}_kernel']:.1f} | "
                              f"{torch.equal(fn(), base)} |")


def _gemms(fn, triton_gemms: bool):
    """``fn`` (the grouped path, taking ``triton_grouped_gemm``) with its GEMMs in Triton at any
    batch size, or on torch's grouped GEMM, whatever the dispatch would pick."""
    def run():
        least = moe_grouped_mm.TRITON_MIN_PAIRS_PER_EXPERT
        moe_grouped_mm.TRITON_MIN_PAIRS_PER_EXPERT = 0
        try:
            return fn(triton_grouped_gemm=triton_gemms)
        finally:
            moe_grouped_mm.TRITON_MIN_PAIRS_PER_EXPERT = least
    return run


def grouped_mm(layer: MoEMixer, tokens: list[int], iters: int) -> None:
    """The Triton and grouped-GEMM paths of the routed experts side by side."""
    w13, w2 = layer.experts.gate_up_proj.weight, layer.experts.down_proj.weight
    flops_per_pair = 2 * (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2])
    rows = []
    for T in tokens:
        x = torch.randn(T, HIDDEN, device=w13.device, dtype=DTYPE)
        ids, weights = layer.gate.route(x)
        expect = fused_experts_torch(x, w13, w2, ids, weights, True).float()
        grouped = lambda **kw: moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, weights, True, **kw)  # noqa: E731
        paths = {"triton": lambda: triton_fused_moe.fused_experts(x, w13, w2, ids, weights, True),
                 "grouped_mm": grouped, "grouped_mm, CUTLASS GEMMs": _gemms(grouped, False),
                 "grouped_mm, Triton GEMMs": _gemms(grouped, True)}
        flops = flops_per_pair * T * TOP_K
        print(f"{T} tokens: the dispatch takes grouped_mm: {moe_grouped_mm.use_grouped_mm(x, w13, w2, ids)}, "
              f"its GEMMs in Triton: {moe_grouped_mm.use_triton_experts(x, w13, w2, ids)}")
        if T == max(tokens):
            print(f"{T} tokens, grouped_mm by kernel (us per call in a graph)")
            for name, us in kernel_table(paths["grouped_mm"], iters):
                print(f"  {us:8.1f}  {name[:100]}")
        for name, fn in paths.items():
            err = float((fn().float() - expect).abs().max() / expect.abs().max())
            eager, graph = median_ms(fn, iters), median_ms(graph_replay(fn), iters)
            rows.append((T, name, eager, graph, flops / (graph * 1e-3) / 1e12, err))
    print(f"\n{torch.cuda.get_device_name()}: routed experts of one Qwen3-30B-A3B layer "
          f"(E {EXPERTS}, k {TOP_K}, K {HIDDEN}, I {INTER}, bf16)")
    print("| tokens | path | eager ms | graph ms | TFLOP/s (graph) | err vs ref |")
    print("|---:|---|---:|---:|---:|---:|")
    for T, name, eager, graph, tflops, err in rows:
        print(f"| {T} | {name} | {eager:.3f} | {graph:.3f} | {tflops:.0f} | {err:.2e} |")
    graph_ms = {(T, name): graph for T, name, _, graph, _, _ in rows}
    print("per step of 48 such layers, Triton GEMMs save over CUTLASS's (graph ms): " + ", ".join(
        f"{T} tokens {48 * (graph_ms[T, 'grouped_mm, CUTLASS GEMMs'] - graph_ms[T, 'grouped_mm, Triton GEMMs']):.1f}"
        for T in tokens))
    print("per step of 48 such layers, grouped_mm saves (graph ms): " + ", ".join(
        f"{T} tokens {48 * (graph_ms[T, 'triton'] - graph_ms[T, 'grouped_mm']):.1f}" for T in tokens))


def combine_norm(layer: MoEMixer, tokens: list[int], iters: int) -> None:
    """Two kernels (combine, add + norm) against the deferred combine's one."""
    w13, w2 = layer.experts.gate_up_proj.weight, layer.experts.down_proj.weight
    rows = []
    for T in tokens:
        x = torch.randn(T, HIDDEN, device=w13.device, dtype=DTYPE)
        residual = torch.randn(T, HIDDEN, device=w13.device, dtype=DTYPE)
        weight = (1 + 0.1 * torch.randn(HIDDEN, device=w13.device)).to(DTYPE)
        ids, weights = layer.gate.route(x)
        pending = moe_grouped_mm.fused_experts_grouped_mm(x, w13, w2, ids, weights, True, defer_combine=True)
        assert isinstance(pending, moe_grouped_mm.PendingCombine)
        same = True
        for cast_before_weight in (True, False):
            two = fused_ops.add_rms_norm(pending.reduce(), residual, weight, 1e-6, cast_before_weight)
            one = pending.add_rms_norm(residual, weight, 1e-6, cast_before_weight)
            same &= all(torch.equal(a, b) for a, b in zip(one, two))
        fns = {"combine + add_rms_norm": lambda: fused_ops.add_rms_norm(pending.reduce(), residual, weight, 1e-6),
               "combine_add_rms_norm": lambda: pending.add_rms_norm(residual, weight, 1e-6, True)}
        for name, fn in fns.items():
            rows.append((T, name, graph_call_us([fn], 48, replays=max(3, iters // 6)), same))
    print(f"\n{torch.cuda.get_device_name()}: one Qwen3-30B-A3B MoE layer's slot sum and the next norm "
          f"(H {HIDDEN}, k {TOP_K}, bf16), us per call in a graph of 48 calls")
    print("| tokens | kernels | us per layer | same bits |")
    print("|---:|---|---:|---|")
    for T, name, us, same in rows:
        print(f"| {T} | {name} | {us:.1f} | {same} |")
    us = {(T, name): v for T, name, v, _ in rows}
    print("per step of 48 layers, the fused kernel saves (ms): " + ", ".join(
        f"{T} tokens {48e-3 * (us[T, 'combine + add_rms_norm'] - us[T, 'combine_add_rms_norm']):.2f}"
        for T in tokens))


def plan(layer: MoEMixer, tokens: list[int], iters: int) -> None:
    """The row plan at each --tokens and segment size (with whether it has the reference's bits)."""
    rows = []
    for T in tokens:
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        ids = layer.gate.route(x)[0]
        dropped = torch.where(torch.rand(ids.shape, device="cuda") < 0.1, ids + EXPERTS, ids)  # EP: other ranks'
        n, default = ids.numel(), triton_moe_plan.segment_size(ids.numel())
        sweep = [(s, w) for s in (128, 256, 512, 1024, 2048) for w in (4, 8) if (s, w) != (default, 4)]
        for seg, warps in [(default, 4)] + sweep:
            def fn(i=ids, seg=seg, warps=warps):
                return triton_moe_plan.plan_rows(i, EXPERTS, moe_grouped_mm.ROW_ALIGN, seg, warps)

            same = all(torch.equal(a.long(), b.long()) for i in (ids, dropped) for a, b in
                       zip(moe_grouped_mm.plan_rows_torch(i, EXPERTS), fn(i)))
            kernels = dict(kernel_table(fn, iters))
            count, place = (next((us for k, us in kernels.items() if name in k), 0.0) for name in ("_count", "_place"))
            rows.append((n, seg, warps, graph_call_us([fn], 48, replays=max(3, iters // 6)), count, place, same))
    print(f"\n{torch.cuda.get_device_name()}: the grouped GEMM's row plan (E {EXPERTS}, k {TOP_K}), "
          f"us per plan in a graph of 48; the first row of each pair count is the default")
    print("| pairs | seg | warps | us per plan | count kernel us | place kernel us | same bits |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for n, seg, warps, us, count, place, same in rows:
        print(f"| {n} | {seg} | {warps} | {us:.1f} | {count:.1f} | {place:.1f} | {same} |")
    fused_alignment(layer, tokens)


def fused_alignment(layer: MoEMixer, tokens: list[int]) -> None:
    """The fused MoE's alignment at its block size: one program per expert against the plan's
    kernels in its layout (``align_pairs`` picks by ``PLAN_MIN_READS``), us in a graph of 48."""
    print(f"\nthe fused MoE's alignment (PLAN_MIN_READS {triton_fused_moe.PLAN_MIN_READS}), us in a graph of 48")
    print("| pairs | block_m | one kernel us | plan kernels us | same blocks and rows |")
    print("|---:|---:|---:|---:|---|")
    for T in tokens:
        ids = layer.gate.route(torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE))[0]
        bm = triton_fused_moe._block_m(ids.numel(), EXPERTS)
        one = lambda i=ids, bm=bm: triton_fused_moe.align_by_expert_triton(i, EXPERTS, bm)  # noqa: E731
        planned = lambda i=ids, bm=bm: triton_moe_plan.align_pairs(i, EXPERTS, bm)  # noqa: E731
        (p1, b1), (p2, b2) = one(), planned()
        live = (b1 < EXPERTS).repeat_interleave(bm)
        same = torch.equal(b1, b2) and torch.equal(p1[live], p2[live])
        print(f"| {ids.numel()} | {bm} | {graph_call_us([one], 48):.1f} | {graph_call_us([planned], 48):.1f} | {same} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="default 1 8 32 128 512 2048; 512 1024 2048 8192 with --grouped-mm; "
                             "2048 8192 with --combine-norm; 512 2048 8192 with --plan")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sweep", action="store_true",
                        help="per-kernel table and the grouped GEMMs' tile settings at each --tokens")
    parser.add_argument("--by-kernel", action="store_true", help="only the per-kernel table at each --tokens")
    parser.add_argument("--grouped-mm", action="store_true",
                        help="the fused Triton MoE against torch's grouped GEMM at each --tokens")
    parser.add_argument("--combine-norm", action="store_true",
                        help="the slot sum + next norm, two kernels against the deferred combine's one")
    parser.add_argument("--plan", action="store_true", help="the grouped GEMM's row plan: equal bits, us per layer")


def run(args: argparse.Namespace) -> None:
    args.tokens = args.tokens or ([512, 1024, 2048, 8192] if args.grouped_mm else [2048, 8192] if args.combine_norm
                                  else [512, 2048, 8192] if args.plan else [1, 8, 32, 128, 512, 2048])
    torch.manual_seed(0)
    layer = qwen3_30b_moe_layer()
    if args.grouped_mm or args.combine_norm or args.plan:
        with torch.no_grad():
            (grouped_mm if args.grouped_mm else combine_norm if args.combine_norm else plan)(layer, args.tokens,
                                                                                             args.iters)
        return
    w13, w2 = layer.experts.gate_up_proj.weight, layer.experts.down_proj.weight
    bw = copy_bandwidth_gbs()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s  "
          f"expert {expert_bytes / 1e6:.2f} MB  all experts {EXPERTS * expert_bytes / 1e9:.2f} GB")
    print(f"{'tokens':>6}{'active':>8}{'MB':>9}{'floor_us':>10}{'layer_graph':>13}{'x_floor':>9}"
          f"{'fused_us':>10}{'ref_us':>10}{'err':>10}")
    with torch.no_grad():
        if args.sweep or args.by_kernel:
            sweep(layer, args.tokens, args.iters, tiles=args.sweep)
            return
        for T in args.tokens:
            x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
            ids, weights = layer.gate.route(x)
            active = int(torch.unique(ids).numel())
            nbytes = active * expert_bytes + layer.gate.weight.numel() * 2
            floor_us = nbytes / (bw * 1e9) * 1e6
            layer_us = 1e3 * median_ms(graph_replay(lambda: layer(x, TRITON)), args.iters)
            fused = lambda: triton_fused_moe.fused_experts(x, w13, w2, ids, weights, True)  # noqa: E731
            ref = lambda: fused_experts_torch(x, w13, w2, ids, weights, True)  # noqa: E731
            out, expect = fused(), ref()
            err = float((out.float() - expect.float()).abs().max() / expect.float().abs().max())
            fused_us = 1e3 * median_ms(fused, args.iters)
            ref_us = 1e3 * median_ms(ref, max(3, args.iters // 5))
            print(f"{T:>6}{active:>8}{nbytes / 1e6:>9.1f}{floor_us:>10.1f}{layer_us:>13.1f}"
                  f"{layer_us / floor_us:>9.2f}{fused_us:>10.1f}{ref_us:>10.1f}{err:>10.2e}")

