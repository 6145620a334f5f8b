"""The FP8 linear kernels compiled ahead of time for an H100 (sm_90) with the installed Triton, on
any machine: the interpreter tests cannot see a compile failure (a module global read inside a
kernel runs interpreted and fails to compile). The CUDA-core kernel at its settings
(``_gemv_tiles``, whether or not ``GEMV_M_MAX`` turns it on; each way of getting the activations,
bias, per-row scales) must read the weights with 16-byte loads; the tensor-core GEMM at each
bucket's tiles, split and not. A subprocess without TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
from unittest import mock
import torch
from megatron_async.kernels import triton_fp8_gemm as tg
from megatron_async.kernels.triton_fp8_gemv import fp8_gemv_kernel

D16 = [["tt.divisibility", 16]]
PTRS = ("a_ptr", "as_ptr", "w_ptr", "ws_ptr", "bias_ptr", "c_ptr", "part_ptr")
ALIGNED = ("N", "K", "stride_am", "stride_wn", "stride_cm")  # multiples of 16 at the real shapes

def build(fn, types, consts, num_warps, num_stages):
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(i,): D16 for i, n in enumerate(fn.arg_names) if n in PTRS + ALIGNED}
    asm = compile_asm(fn, sig, consts, attrs, num_warps=num_warps, num_stages=num_stages)
    return {"cubin": "cubin" in asm, "v4": "ld.global.v4" in asm["ptx"] or "ld.global.nc.v4" in asm["ptx"]}

types = {n: "i32" for n in fp8_gemv_kernel.arg_names + tg._fp8_gemm_kernel.arg_names if n in "MNK" or n == n.lower()}
types.update(a_ptr="*bf16", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*fp32", c_ptr="*bf16",
             part_ptr="*fp32")
out = {}
with mock.patch.object(tg, "num_compute_units", return_value=132):
    plans = {(n, m): tg.fp8_tiles(m, n, 4096, torch.device("cuda")) for n in (1024, 24576)
             for m in (1, 16, 64, 128, 256)}
    plans[(4096, 1)] = tg._gemv_tiles(4096, 4096, torch.device("cuda")), False  # the CUDA-core kernel, on or off
for (n, m), (t, pre) in plans.items():
    a = "*fp8e4nv" if pre else "*bf16"
    if t.block_m == 1:
        for p, bias, sbn in ((pre, False, 128), (True, False, 128), (False, True, 1)):
            a = "*fp8e4nv" if p else "*bf16"
            out[f"gemv n{n} pre{p} bias{bias} sbn{sbn}"] = build(fp8_gemv_kernel, dict(types, a_ptr=a), dict(
                BLOCK_N=t.block_n, GROUPS=t.groups, SCALE_BLOCK_N=sbn, PREQUANT=p, HAS_BIAS=bias, EMULATE=False),
                t.num_warps, t.num_stages)
    else:
        for split in (False, True):
            out[f"gemm m{m} n{n} split{split}"] = build(tg._fp8_gemm_kernel, dict(types, a_ptr=a), dict(
                SPLIT=split, BLOCK_M=t.block_m, BLOCK_N=t.block_n, GROUP_M=8, SCALE_BLOCK_N=128, PREQUANT=pre,
                HAS_BIAS=False, EMULATE=False), t.num_warps, t.num_stages)
print(json.dumps(out))
'''


def test_fp8_linear_kernels_compile_for_sm90():
    out = compile_results(_SCRIPT, timeout=600)
    assert any(k.startswith("gemv") for k in out) and any(k.startswith("gemm") for k in out), out
    assert all(v["cubin"] for v in out.values()), out
    assert all(out[k]["v4"] for k in out if k.startswith("gemv")), out
