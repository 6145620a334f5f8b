"""A long-tile step's launches as the engine picks them (``prefill_launch(..., long=True)`` for the
prefill kernel, ``triton_invariant_attention.launches`` for the batch-invariant one) compiled ahead
of time for an H100 (sm_90) at head dim 256 (and the prefill kernel's at 64; 128's launches have
compile tests of their own), with the installed Triton, on any machine. ptxas refuses a
128-register cap where a 256-wide accumulator needs more (the long launches once took it at every
head dim); the interpreter tests cannot see that. A subprocess without
TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
import types as pytypes
import torch
import triton.language as tl
from megatron_async.kernels import triton_invariant_attention as ia, triton_prefill_attention as pa
from megatron_async.kernels.triton_prefill_common import prefill_launch

cuda = torch.device("cuda")
ptrs = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
ptrs.update(block_table_ptr="*i32", kv_lens_ptr="*i32", positions_ptr="*i64", cu_q_ptr="*i32", schedule_ptr="*i64",
            scale_log2="fp32", kv_scale_ptr="*fp32", num_kv_heads="i32", num_heads="i32", oq_ptr="*fp8e4nv",
            os_ptr="*fp32", rows_padded="i32", part_ptr="*fp32", lse_ptr="*fp32")


def build(fn, consts, launch_rows, warps, stages, maxnreg, **opts):
    sig = {n: ("i32" if n.startswith("stride") else ptrs.get(n, "constexpr")) for n in fn.arg_names}
    try:
        asm = compile_asm(fn, sig, consts, num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}),
                          **opts)
        return {"cubin": "cubin" in asm, "rows": launch_rows, "maxnreg": maxnreg}
    except Exception as e:  # a ptxas refusal is the failure this test looks for
        return {"cubin": False, "rows": launch_rows, "maxnreg": maxnreg, "error": f"{type(e).__name__}: {str(e)[:300]}"}


out = {}
for d in (64, 256):
    launch = prefill_launch(2, d, 16, cuda, long=True)
    out[f"prefill_d{d}"] = build(pa._prefill_kernel, dict(
        GROUP=2, BLOCK_G=2, BLOCK_Q=launch.rows // 2, HEAD_DIM=d, BLOCK_D=d, BLOCK_SIZE=16, BLOCK_N=launch.block_n,
        DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", HEADS_FASTEST=True, KV_FP8=False, E4M3_PAIRS=False,
        Q_BF16=True, USE_ASM=True, QUANT_OUT=False), launch.rows, launch.num_warps, launch.num_stages, launch.maxnreg)
    if d != 256:
        continue
    _, block_n = ia.tiles(2, cuda, 16500)  # a long-context table: 64-key tiles, long-tile steps split
    for i, inv in enumerate(ia.launches(pytypes.SimpleNamespace(long_tiles=True), 2, block_n, d, cuda)):
        out[f"invariant_d{d}_{i}"] = build(ia._split_kernel, dict(
            GROUP=2, BLOCK_G=2, BLOCK_Q=inv.rows // 2, HEAD_DIM=d, BLOCK_D=d, BLOCK_SIZE=16, BLOCK_N=block_n,
            SPLIT=4096, MAX_SPLITS=5, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", KV_FP8=False, HEADS_FASTEST=True),
            inv.rows, inv.num_warps, 2, inv.maxnreg, enable_fp_fusion=False)
print(json.dumps(out))
'''


def test_long_tile_launches_compile_at_every_head_dim():
    out = compile_results(_SCRIPT, timeout=900)
    assert all(v["cubin"] for v in out.values()), {k: v for k, v in out.items() if not v["cubin"]}
    # the 128-row tiles where they fit (64), the default 64-row launch at 256
    assert [out[f"prefill_d{d}"]["rows"] for d in (64, 256)] == [128, 64]
    assert {k for k in out if k.startswith("invariant_d256")} == {"invariant_d256_0"}
