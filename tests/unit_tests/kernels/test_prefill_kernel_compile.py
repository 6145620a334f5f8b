"""The prefill attention kernel at its default launch, compiled ahead of time for an H100 (sm_90)
with the installed Triton, on any machine: its speed rests on Hopper's wgmma for both dots and on
the K / V tile loads being software-pipelined (cp.async into shared memory, ``NUM_STAGES`` deep),
neither of which the interpreter tests can see; over an e4m3 pool, the pairs of values widened with
one conversion each and the tiles kept 16-bit in shared memory. Integer arguments are marked divisible by 16 as the
launch specializes them (unaligned strides would leave the loads scalar and unpipelined).
A subprocess without TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
import re
import torch
import triton.language as tl
from megatron_async.kernels import triton_prefill_attention as pa

fn = pa._prefill_kernel
types = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
types.update(block_table_ptr="*i32", kv_lens_ptr="*i32", positions_ptr="*i64", cu_q_ptr="*i32", schedule_ptr="*i64",
             scale_log2="fp32", kv_scale_ptr="*fp32", num_kv_heads="i32", oq_ptr="*fp8e4nv", os_ptr="*fp32",
             rows_padded="i32")
types.update({n: "i32" for n in fn.arg_names if n.startswith("stride")})
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n.startswith("stride")}
out = {}
for group, fp8 in ((2, False), (4, False), (2, True)):
    t = dict(types, **({"q_ptr": "*i32", "k_cache_ptr": "*i16", "v_cache_ptr": "*i16"} if fp8 else {}))  # pairs
    block_q, block_n = pa.prefill_tiles(group, torch.device("cuda"))
    consts = dict(GROUP=group, BLOCK_G=group, BLOCK_Q=block_q, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16,
                  BLOCK_N=block_n, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", HEADS_FASTEST=True, KV_FP8=fp8,
                  E4M3_PAIRS=fp8, Q_BF16=True, USE_ASM=True, QUANT_OUT=False)
    sig = {n: t.get(n, "constexpr") for n in fn.arg_names}
    asm = compile_asm(fn, sig, consts, aligned, num_warps=pa.NUM_WARPS, num_stages=pa.NUM_STAGES,
                      maxnreg=pa.max_registers(128, torch.device("cuda")))
    ptx = asm["ptx"]
    out[f"g{group}_fp8{fp8}"] = {"cubin": "cubin" in asm, "wgmma": ptx.count("wgmma.mma_async"),
                                 "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                                 "scalar_loads": ptx.count("ld.global.b16") + ptx.count("ld.global.b8"),
                                 "byte_lds": len(re.findall(r"ld\.shared\.[bu]8", ptx)),
                                 "cvt": ptx.count("cvt.rn.f16x2.e4m3x2"), "cvt_bf16": ptx.count("cvt.bf16.f16"),
                                 "spill": ptx.count(".local")}
print(json.dumps(out))
'''


def test_prefill_kernel_compiles_to_pipelined_wgmma_for_sm90():
    out = compile_results(_SCRIPT, timeout=600)
    for name, v in out.items():
        assert v["cubin"] and v["wgmma"] > 0, (name, v)
        assert v["cp_async"] > 0, (name, v)  # K / V tiles loaded asynchronously, stages ahead
        assert v["scalar_loads"] == 0, (name, v)  # 16-byte loads, not one element at a time
    # an e4m3 pool: one e4m3x2 -> f16x2 conversion per two values and no second one, 16-bit shared reads
    fp8 = out["g2_fp8True"]
    assert fp8["cvt"] > 0 and fp8["cvt_bf16"] == 0 and fp8["byte_lds"] == 0, fp8


_WIDE_SCRIPT = r'''
import torch
import triton.language as tl
from megatron_async.kernels import triton_prefill_wide as pw

fn = pw.prefill_wide_kernel
types = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
types.update(block_table_ptr="*i32", kv_lens_ptr="*i32", positions_ptr="*i64", cu_q_ptr="*i32", schedule_ptr="*i64",
             scale_log2="fp32", num_kv_heads="i32", oq_ptr="*fp8e4nv", os_ptr="*fp32", rows_padded="i32")
types.update({n: "i32" for n in fn.arg_names if n.startswith("stride")})
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n.startswith("stride")}
out = {}
for kernel, block_size, block_n, stages, ws in (("wide", 16, 64, 3, False), ("wide", 16, 128, 2, True),
                                                ("tma", 64, 64, 3, False), ("tma", 128, 128, 2, True)):
    tma = kernel == "tma"
    desc = f"tensordesc<bf16[{block_n}, 128]>" if tma else "*bf16"
    sig = {n: dict(types, k_desc=desc, v_desc=desc).get(n, "constexpr") for n in fn.arg_names}
    consts = dict(GROUP=2, BLOCK_G=2, BLOCK_Q=64, HEAD_DIM=128, BLOCK_SIZE=block_size, BLOCK_N=block_n,
                  DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", HEADS_FASTEST=True, KV_TMA=tma,
                  WARP_SPEC=ws,
                  QUANT_OUT=False, EMULATE=False)
    ptx = compile_asm(fn, sig, consts, aligned, num_warps=8, num_stages=stages)["ptx"]
    out[f"{kernel}_{block_n}_ws{ws}"] = {"wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
                                         "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                                         "spill": ptx.count(".local")}
print(json.dumps(out))
'''


def test_wide_prefill_kernels_compile_to_wgmma_with_async_loads_for_sm90():
    """The wide variants at 128-row tiles on 8 warps, no register cap: both dots on wgmma, K / V by TMA
    (``cp.async.bulk.tensor``) or by cp.async through the block table, nothing spilled; warp-specialized
    loops compile too."""
    out = compile_results(_WIDE_SCRIPT, timeout=600)
    for name, v in out.items():
        assert v["wgmma"] > 0 and v["spill"] == 0, (name, v)
        assert (v["tma"] > 0) if name.startswith("tma") else (v["cp_async"] > 0), (name, v)
