"""The P2P collectives' kernels (fused all-reduce + RMSNorm, EP all-gather / reduce-scatter)
compiled ahead of time for an H100 (sm_90) with the installed Triton, on any machine: they only
run on multi-GPU boxes, and the interpreter tests cannot see a compile failure (one turned the
fused path off at load on the GPUs: Triton 3.6 rejected a loop form 3.9 took). A subprocess
without TRITON_INTERPRET (the suite sets it on CPU machines, and interpreted kernels cannot be
compiled). Skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
from megatron_async.kernels import triton_fused_all_reduce as fused, triton_p2p_exchange as ex

def build(fn, sig, consts):
    asm = compile_asm(fn, sig, consts, num_warps=4)
    return {"cubin": "cubin" in asm, "posted_raise": "release.exch" in asm["ptx"] or ".exch" in asm["ptx"]}

out = {}
for world, splits in ((2, 0), (4, 0), (4, 4)):  # splits: a row-parallel projection's float32 K-split partials
    out[f"fused_w{world}" + (f"_s{splits}" if splits else "")] = build(fused._fused_kernel, {
        "x_ptr": "*fp32" if splits else "*bf16", "buf_table_ptr": "*i64", "pad_table_ptr": "*i64", "res_ptr": "*bf16",
        "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16", "state_ptr": "*i32", "M": "i32", "rank": "i32",
        "half": "i32", "eps": "fp32", "N": "constexpr", "BLOCK_N": "constexpr", "W": "constexpr",
        "CAST_BEFORE_WEIGHT": "constexpr", "BARRIER": "constexpr", "SPLITS": "constexpr"},
        {"N": 1024, "BLOCK_N": 1024, "W": world, "CAST_BEFORE_WEIGHT": True, "BARRIER": True, "SPLITS": splits})
for name, dtype in (("_all_gather_kernel", "*i32"), ("_reduce_scatter_kernel", "*bf16")):
    out[name] = build(getattr(ex, name), {
        "x_ptr": dtype, "buf_table_ptr": "*i64", "pad_table_ptr": "*i64", "state_ptr": "*i32", "out_ptr": dtype,
        "n": "i32", "rank": "i32", "half": "i32", "W": "constexpr", "BLOCK": "constexpr", "BARRIER": "constexpr"},
        {"W": 2, "BLOCK": 1024, "BARRIER": True})
print(json.dumps(out))
'''


def test_p2p_kernels_compile_for_sm90():
    result = compile_results(_SCRIPT, timeout=300)
    assert set(result) == {"fused_w2", "fused_w4", "fused_w4_s4", "_all_gather_kernel", "_reduce_scatter_kernel"}
    for name, got in result.items():
        assert got["cubin"] and got["posted_raise"], (name, got)
