"""FP8 kernel times against bf16 at real shapes (``python -m benchmarks fp8 kernels``): the Qwen3-8B
linears (cuBLAS bf16; the engine's FP8 linear, which is the Triton W8A8 GEMM up to 64 rows and
cuBLASLt above; the Triton GEMM alone; ``torch._scaled_mm``'s block-scaled recipe with its
activation quantization), one Qwen3-30B-A3B MoE layer (the engine's bf16 experts against the FP8
fused MoE; at prefill sizes also the FP8 MoE on 64-row blocks with the decode blocks' tiles
("fp8 16-row tiles") and with ``ONE_A_SM`` ("fp8 1-a-SM tiles")) and Qwen3-8B decode
attention over a bf16 and an e4m3 KV pool. Every call is timed as a replayed CUDA graph cycling
through enough weight copies that they come from DRAM, as in a step."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_async.kernels import fp8_quant as fq, kv_cache_fp8 as kf, triton_fp8_gemm as tg
from megatron_async.kernels.moe_experts import fused_experts
from megatron_async.kernels.triton_decode_attention import decode_attention
from megatron_async.kernels import triton_fp8_moe as tm
from megatron_async.kernels.triton_fp8_moe import FP8_MOE_TILES, Fp8MoeTiles

LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
"""Qwen3-8B's linears of one layer (N, K)."""
MOE = (128, 2048, 768, 8)
"""Qwen3-30B-A3B's MoE layer: experts, hidden, moe_intermediate, top-k."""
L2_BYTES = 64 << 20
ONE_A_SM = Fp8MoeTiles(gate_up_warps=8, gate_up_stages=4, down_block_n=128, down_warps=4, down_stages=4)
"""The other candidate for 64-row blocks (row "fp8 1-a-SM tiles"): one gate_up program an SM, its
two warpgroups in step (8 warps, 4 stages, 180 registers), down on 4 warps; against
FP8_MOE_TILES' two programs an SM in both GEMMs."""


def _timer(device: torch.device):
    """us per call of fns cycled in a graph (CUDA), or one wall-clock call (CPU: plumbing only)."""
    if device.type == "cuda":
        from benchmarks.cuda_timing import graph_call_us

        return lambda fns: graph_call_us(fns, calls_per_graph=2 * len(fns))

    def once(fns):
        import time

        t = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t) * 1e6 / len(fns)
    return once


def scaled_mm_runs(device: torch.device) -> str | None:
    """None when ``torch._scaled_mm``'s 1 x 128 / 128 x 128 recipe runs here, else why not."""
    if device.type != "cuda":
        return "not on CPU"
    return None if tg.scaled_mm_runs(device) else "no block-scaled recipe in this torch / cuBLASLt"


def linear_rows(ms: list[int], device: torch.device, shapes: dict = LINEARS) -> list[dict]:
    timer, no_scaled_mm = _timer(device), scaled_mm_runs(device)
    rows = []
    for layer, (n, k) in shapes.items():
        copies = max(2, min(8, -(-2 * L2_BYTES // (n * k * 2))))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        qs = [fq.quantize_weight(w) for w in ws]
        fp8_bytes = n * k + qs[0][1].numel() * 4
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16 = timer([lambda w=w: F.linear(x, w) for w in ws])
            fp8 = timer([lambda q=q, s=s: tg.fp8_linear(x, q, s) for q, s in qs])
            tiles, pre = tg.fp8_tiles(m, n, k, device)
            triton = timer([lambda q=q, s=s: tg.fp8_linear(x, q, s, tiles=tiles, prequantize=pre) for q, s in qs])
            sm = None
            if no_scaled_mm is None:
                sm = timer([lambda q=q, s=s: tg.scaled_mm_linear(x, q, s) for q, s in qs])
            rows.append({"kind": "linear", "layer": layer, "m": m, "bf16_us": bf16, "fp8_us": fp8, "scaled_mm_us": sm, "triton_us": triton,
                         "fp8_gbs": fp8_bytes / fp8 / 1e3, "bf16_gbs": 2 * n * k / bf16 / 1e3})
        del ws, qs
    return rows


def moe_rows(tokens: list[int], device: torch.device, shape: tuple = MOE) -> list[dict]:
    E, H, I, k = shape
    timer = _timer(device)
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=device, generator=g).to(torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device=device, generator=g).to(torch.bfloat16) * 0.03
    (q13, s13), (q2, s2) = fq.quantize_weight(w13), fq.quantize_weight(w2)
    triton = device.type == "cuda"
    rows = []
    for n in tokens:
        x = torch.randn(n, H, device=device, generator=g).to(torch.bfloat16)
        w, ids = torch.softmax(torch.randn(n, E, device=device, generator=g), -1).topk(k, dim=-1)
        ids, w = ids.to(torch.int32), w.float()
        bf16 = timer([lambda: fused_experts(x, w13, w2, ids, w, True, triton=triton)])
        fp8 = timer([lambda: fused_experts(x, q13, q2, ids, w, True, triton=triton, w13_scale=s13, w2_scale=s2)])
        rows.append({"kind": "moe", "layer": "30b-a3b experts", "m": n, "bf16_us": bf16, "fp8_us": fp8})
        block_m = tm.rows_per_block(n * k, E)
        if triton and block_m == 64:  # prefill sizes: the decode blocks' tiles and the other candidate, beside
            for name, tiles in [("fp8 16-row tiles", FP8_MOE_TILES[16]), ("fp8 1-a-SM tiles", ONE_A_SM)]:
                t = timer([lambda tiles=tiles: tm.fused_experts_fp8(x, q13, s13, q2, s2, ids, w, True, tiles=tiles,
                                                                    block_rows=block_m)])
                rows.append({"kind": "moe", "layer": name, "m": n, "bf16_us": bf16, "fp8_us": t})
    return rows


def attention_rows(cases: list[tuple[int, int]], device: torch.device, heads: tuple = (32, 8, 128)) -> list[dict]:
    """Decode attention of ``rows`` rows of ``context`` keys each over a bf16 and an e4m3 pool."""
    from tests.helpers.paged_attention_cases import make_case

    timer = _timer(device)
    out = []
    for num_rows, context in cases:
        case = make_case([(context - 1, 1)] * num_rows, num_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                         block_size=16, dtype=torch.bfloat16, device=device, unused=0.0)
        scales = torch.ones(2, heads[1], device=device)
        pool = kf.quantize_kv(case.kv_cache.flatten(0, 2), scales[0]).view(case.kv_cache.shape)
        q, meta, sc, cache = case.q, case.meta, case.scale, case.kv_cache
        bf16 = timer([lambda: decode_attention(q, cache, meta, sc)])
        fp8 = timer([lambda: decode_attention(q, pool, meta, sc, kv_scale=scales)])
        out.append({"kind": "decode attention", "layer": f"{num_rows} x {context}", "m": num_rows,
                    "bf16_us": bf16, "fp8_us": fp8})
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':<17} {'shape':<16} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'bf16/fp8':>8} {'triton':>8} "
          f"{'_scaled_mm':>10} {'fp8 GB/s':>8}")
    for r in rows:
        sm = f"{r['scaled_mm_us']:>10.1f}" if r.get("scaled_mm_us") else f"{'-':>10}"
        gbs = f"{r['fp8_gbs']:>8.0f}" if "fp8_gbs" in r else f"{'-':>8}"
        tri = f"{r['triton_us']:>8.1f}" if "triton_us" in r else f"{'-':>8}"
        print(f"{r['kind']:<17} {r['layer']:<16} {r['m']:>5} {r['bf16_us']:>9.1f} {r['fp8_us']:>9.1f} "
              f"{r['bf16_us'] / r['fp8_us']:>8.2f} {tri} {sm} {gbs}")
