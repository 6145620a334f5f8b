"""Launch settings of the FP8 Triton GEMM swept at decode sizes (``python -m benchmarks fp8 sweep``):
for each linear (Qwen3-8B, Qwen3-0.6B) and row count, every candidate of M's bucket (BLOCK_M,
BLOCK_N, SPLIT_K, num_warps, num_stages, activations quantized in the GEMM or before) timed as a
replayed CUDA graph whose weight copies come from DRAM, beside ``fp8_tiles``'s choice, the engine's
call (``fp8_linear``: cuBLASLt above ``TRITON_M_MAX`` rows) and cuBLAS bf16; GB/s against the
weight bytes (e4m3 + scales). The candidates compile first in parallel processes (Triton's disk
cache), then one process times them one after the other."""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing as mp
import os
import time

import torch
import torch.nn.functional as F
import triton

from megatron_async.kernels import fp8_quant as fq, triton_fp8_gemm as tg
from megatron_async.kernels.triton_fp8_gemm import Fp8Tiles

SHAPES = {
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
"""(N, K) of one layer's linears."""
DRAM_BYTES = 128 << 20
"""Weight copies cycled per graph: at least this many bytes (twice the H100's 50 MB L2)."""


def candidates(m: int, n: int, k: int, family: str = "tiles", device: torch.device = torch.device("cuda")
               ) -> list[tuple[Fp8Tiles, bool]]:
    """(tiles, prequantize) to try: ``tiles``, M's bucket of the tensor-core GEMM (16-row tiles
    quantizing in the GEMM up to ``SMALL_M`` rows, else 64- and 128-row tiles, mostly over
    pre-quantized activations); ``gemv``, the CUDA-core kernel's settings (``block_m`` 1) and the
    GEMM's 16-row tiles beside them; ``none``: only the current choice and the one before."""
    groups = triton.cdiv(k, tg.GROUP)
    splits = [s for s in (1, 2, 4, 8, 16) if s <= groups]
    out = []
    if family == "none":
        return out
    if family == "gemv":
        for bn, per_step, warps in itertools.product((2, 4, 8, 16, 32), (1, 2, 4, 8, 16, 32), (1, 2, 4, 8)):
            if 16 <= bn * per_step * tg.GROUP // (32 * warps) <= 256 and per_step <= groups:  # 16-byte loads, <= 16 a thread
                out.append((Fp8Tiles(1, bn, 1, warps, 1, per_step), False))  # stages: no loads to pipeline
        return out + [(tg.fp8_tiles(tg.SMALL_M, n, k, device)[0], False)]
    if m <= tg.SMALL_M:
        for bn, warps in ((32, 2), (32, 4), (64, 4), (128, 4), (128, 8)):
            for s in splits:
                for st in (3, 4, 6) + ((8,) if s <= 2 and bn <= 64 else ()):
                    out.append((Fp8Tiles(16, bn, s, warps, st), False))
        return out
    for bm, bn, warps in ((64, 32, 4), (64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 32, 4), (128, 64, 4),
                          (128, 64, 8), (128, 128, 8)):
        for s in splits[:4]:
            for st in (3, 4):
                out.append((Fp8Tiles(bm, bn, s, warps, st), True))
    for bn in (64, 128):
        for s in splits[:3]:
            out.append((Fp8Tiles(64, bn, s, 4, 3), False))
    return out


def before(m: int, n: int, k: int) -> tuple[Fp8Tiles, bool, bool]:
    """(tiles, prequantize, cuBLASLt) of ``fp8_linear`` before the sweep (H100: 132 SMs): Triton up
    to 64 rows, cuBLASLt above where it runs."""
    groups = triton.cdiv(k, tg.GROUP)
    want = max(1, min(8, groups // 4, 4 * 132 // triton.cdiv(n, 64)))
    split = 1 << (want.bit_length() - 1)
    if m <= tg.SMALL_M:
        return Fp8Tiles(16, 64, split, 4, 3), False, False
    if m <= tg.DECODE_M_MAX:
        return Fp8Tiles(64, 64, split if m <= 64 else min(2, split), 4, 4), True, m > 64
    return Fp8Tiles(128, 64, 1, 4, 3), True, True


def _compile_key(m: int, k: int, t: Fp8Tiles, pre: bool) -> tuple:
    """What tells two launches' binaries apart: the constexprs (split or not) and, pre-quantized,
    M's specialization (the activation scales' stride is M: 1, a multiple of 16 or neither)."""
    groups = triton.cdiv(k, tg.GROUP)
    split = triton.cdiv(groups, triton.cdiv(groups, t.split_k)) > 1
    spec = (m == 1, m % 16 == 0) if pre else None
    return split, t.block_m, t.block_n, t.num_warps, t.num_stages, t.groups, pre, spec


def _compile(jobs: list[tuple[int, int, int, Fp8Tiles, bool]]) -> int:
    """Worker: one launch of each (M, N, K, tiles, prequantize) on throw-away operands, which
    leaves the binary in Triton's disk cache; returns how many failed."""
    failed, ops = 0, {}
    for m, n, k, t, pre in jobs:
        if (n, k) not in ops:
            ops[(n, k)] = (torch.zeros(n, k, device="cuda").to(fq.FP8),
                           torch.ones(triton.cdiv(n, 128), triton.cdiv(k, 128), device="cuda"))
        q, s = ops[(n, k)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        try:
            tg.fp8_linear(x, q, s, tiles=t, prequantize=pre)
        except Exception:  # noqa: BLE001 - out of resources etc.: the timing pass skips it too
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(cases: list[tuple[int, int, int]], procs: int, family: str) -> tuple[int, int, float]:
    """Compile every candidate of ``cases`` (M, N, K) once, spread over ``procs`` processes."""
    seen, jobs = set(), []
    for m, n, k in cases:
        for t, pre in candidates(m, n, k, family) + [tg.fp8_tiles(m, n, k, torch.device("cuda")), before(m, n, k)[:2]]:
            key = _compile_key(m, k, t, pre)
            if key not in seen:
                seen.add(key)
                jobs.append((m, n, k, t, pre))
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        failed = sum(pool.map(_compile, [jobs[i::procs] for i in range(procs)]))  # mixed K a worker
    return len(jobs), failed, time.perf_counter() - start


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((out.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max() + 1e-3).item())


def sweep(ms: list[int], models: list[str], device: torch.device, budget_s: float = 1e9, procs: int = 0,
          shapes: dict = SHAPES, limit: int | None = None, family: str = "tiles") -> list[dict]:
    """One row per (model, layer, M): the current choice, the swept best and every candidate's us
    (the first ``limit`` candidates of each bucket; timing stops trying new ones after ``budget_s``)."""
    from benchmarks.fp8_kernel_times import _timer

    timer = _timer(device)
    cases = [(m, n, k) for model in models for n, k in shapes[model].values() for m in ms]
    if device.type == "cuda" and procs > 1:
        try:
            jobs, failed, secs = precompile(cases, procs, family)
            print(f"precompiled {jobs} kernels ({failed} failed) in {secs:.1f} s on {procs} processes", flush=True)
        except Exception as e:  # noqa: BLE001 - then the timing pass compiles each as it comes
            print(f"precompiling failed ({type(e).__name__}: {e}); compiling while timing", flush=True)
    start, rows = time.perf_counter(), []
    for model in models:
        for layer, (n, k) in shapes[model].items():
            weight_bytes = n * k + triton.cdiv(n, 128) * triton.cdiv(k, 128) * 4
            copies = max(2, min(48, -(-DRAM_BYTES // weight_bytes))) if device.type == "cuda" else 1
            g = torch.Generator(device=device).manual_seed(n + k)
            ws = [torch.randn(n, k, device=device, generator=g).to(torch.bfloat16) * 0.02 for _ in range(copies)]
            qs = [fq.quantize_weight(w) for w in ws]
            for m in ms:
                x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
                now, now_pre = tg.fp8_tiles(m, n, k, device)
                ref = tg.fp8_linear(x, *qs[0], tiles=now, prequantize=now_pre)
                row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "bytes": weight_bytes,
                       "bf16_us": timer([lambda w=w: F.linear(x, w) for w in ws]),
                       "engine_us": timer([lambda q=q, s=s: tg.fp8_linear(x, q, s) for q, s in qs]),
                       "now": (now, now_pre), "tried": []}
                old, old_pre, old_cublas = before(m, n, k)
                if old_cublas and device.type == "cuda" and tg.scaled_mm_runs(device):
                    row["before_us"] = timer([lambda q=q, s=s: tg.scaled_mm_linear(x, q, s) for q, s in qs])
                else:
                    row["before_us"] = timer([lambda q=q, s=s: tg.fp8_linear(x, q, s, tiles=old, prequantize=old_pre)
                                              for q, s in qs])
                for t, pre in candidates(m, n, k, family, device)[:limit]:
                    if time.perf_counter() - start > budget_s:
                        break
                    try:
                        if not _close(tg.fp8_linear(x, *qs[0], tiles=t, prequantize=pre), ref):
                            row["tried"].append((t, pre, float("nan")))
                            continue
                        us = timer([lambda q=q, s=s, t=t, pre=pre: tg.fp8_linear(x, q, s, tiles=t, prequantize=pre)
                                    for q, s in qs])
                    except Exception:  # noqa: BLE001 - a launch setting this GPU cannot run
                        continue
                    row["tried"].append((t, pre, us))
                row["now_us"] = next((us for t, pre, us in row["tried"] if (t, pre) == row["now"]), None)
                if row["now_us"] is None:
                    row["now_us"] = timer([lambda q=q, s=s: tg.fp8_linear(x, q, s, tiles=now, prequantize=now_pre)
                                           for q, s in qs])
                timed = [c for c in row["tried"] if c[2] == c[2]]
                row["best"] = min(timed, key=lambda c: c[2]) if timed else (now, now_pre, row["now_us"])
                row["sum_us"] = _split_sum_us(timer, m, n, k, row["best"][0], device)
                rows.append(row)
            del ws, qs
    return rows


def _split_sum_us(timer, m: int, n: int, k: int, t: Fp8Tiles, device: torch.device) -> float:
    """us of the second kernel alone (adding the K ranges' partials), what a split costs on top."""
    from megatron_async.kernels.triton_invariant_matmul import _split_sum_kernel

    groups = triton.cdiv(k, tg.GROUP)
    split = triton.cdiv(groups, triton.cdiv(groups, t.split_k))
    if split == 1 or t.block_m == 1:
        return 0.0
    part = torch.zeros(split, m, n, device=device)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    return timer([lambda: _split_sum_kernel[(triton.cdiv(m * n, 1024),)](
        part, part, out, m, n, out.stride(0), SPLIT_K=split, HAS_BIAS=False, BLOCK=1024, num_warps=4)])


def _tiles(t: Fp8Tiles, pre: bool) -> str:
    if t.block_m == 1:
        return f"gemv {t.block_n} g{t.groups} w{t.num_warps} st{t.num_stages}{' pre' if pre else ''}"
    return f"{t.block_m}x{t.block_n} s{t.split_k} w{t.num_warps} st{t.num_stages}{' pre' if pre else ''}"


def print_sweep(rows: list[dict]) -> None:
    """The summary: per (model, layer, M) the current tiles and the best, us and weight GB/s."""
    print(f"{'model':<10} {'layer':<8} {'M':>4} {'bf16':>7} {'before':>7} {'engine':>7} {'now us':>7} {'GB/s':>5} "
          f"{'best us':>7} {'GB/s':>5} {'sum us':>6} {'now tiles':<24} {'best tiles':<24}")
    for r in rows:
        t, pre, best = r["best"]
        print(f"{r['model']:<10} {r['layer']:<8} {r['m']:>4} {r['bf16_us']:>7.1f} {r['before_us']:>7.1f} "
              f"{r['engine_us']:>7.1f} {r['now_us']:>7.1f} {r['bytes'] / r['now_us'] / 1e3:>5.0f} {best:>7.1f} "
              f"{r['bytes'] / best / 1e3:>5.0f} "
              f"{r['sum_us']:>6.1f} {_tiles(*r['now']):<24} {_tiles(t, pre):<24}")


def to_json(rows: list[dict]) -> list[dict]:
    """Rows with their tiles spelled out (for ``json.dump``)."""
    def spell(t: Fp8Tiles, pre: bool) -> dict:
        return {**t.__dict__, "prequantize": pre}

    return [{**{k: v for k, v in r.items() if k not in ("now", "best", "tried")}, "now": spell(*r["now"]),
             "best": {**spell(*r["best"][:2]), "us": r["best"][2]},
             "tried": [{**spell(t, pre), "us": us} for t, pre, us in r["tried"]]} for r in rows]


def default_procs() -> int:
    return max(1, min(15, (os.cpu_count() or 2) - 1))
