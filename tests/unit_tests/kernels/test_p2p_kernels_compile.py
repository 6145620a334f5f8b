"""The P2P collectives' kernels (fused all-reduce + RMSNorm, EP all-gather / reduce-scatter)
compiled ahead of time for an H100 (sm_90) with the installed Triton, on any machine: they only
run on multi-GPU boxes, and the interpreter tests cannot see a compile failure (one turned the
fused path off at load on the GPUs: Triton 3.6 rejected a loop form 3.9 took). A subprocess
without TRITON_INTERPRET (the suite sets it on CPU machines, and interpreted kernels cannot be
compiled). Skipped where Triton has no CUDA backend."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = r'''
import json, sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", 90, 32)
except ImportError as e:
    print(json.dumps({"skip": str(e)})); sys.exit(0)
from megatron_async.kernels import triton_fused_all_reduce as fused, triton_p2p_exchange as ex

def build(fn, sig, consts):
    try:
        asm = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": 4}).asm
    except (KeyError, FileNotFoundError) as e:  # no CUDA backend / ptxas in this Triton
        print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
    return {"cubin": "cubin" in asm, "posted_raise": "release.exch" in asm["ptx"] or ".exch" in asm["ptx"]}

out = {}
for world in (2, 4):
    out[f"fused_w{world}"] = build(fused._fused_kernel, {
        "x_ptr": "*bf16", "buf_table_ptr": "*i64", "pad_table_ptr": "*i64", "res_ptr": "*bf16", "w_ptr": "*bf16",
        "out_ptr": "*bf16", "res_out_ptr": "*bf16", "state_ptr": "*i32", "M": "i32", "rank": "i32", "half": "i32",
        "eps": "fp32", "N": "constexpr", "BLOCK_N": "constexpr", "W": "constexpr",
        "CAST_BEFORE_WEIGHT": "constexpr", "BARRIER": "constexpr"},
        {"N": 1024, "BLOCK_N": 1024, "W": world, "CAST_BEFORE_WEIGHT": True, "BARRIER": True})
for name, dtype in (("_all_gather_kernel", "*i32"), ("_reduce_scatter_kernel", "*bf16")):
    out[name] = build(getattr(ex, name), {
        "x_ptr": dtype, "buf_table_ptr": "*i64", "pad_table_ptr": "*i64", "state_ptr": "*i32", "out_ptr": dtype,
        "n": "i32", "rank": "i32", "half": "i32", "W": "constexpr", "BLOCK": "constexpr", "BARRIER": "constexpr"},
        {"W": 2, "BLOCK": 1024, "BARRIER": True})
print(json.dumps(out))
'''


def test_p2p_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"Triton cannot compile for CUDA here: {result['skip']}")
    assert set(result) == {"fused_w2", "fused_w4", "_all_gather_kernel", "_reduce_scatter_kernel"}
    for name, got in result.items():
        assert got["cubin"] and got["posted_raise"], (name, got)
