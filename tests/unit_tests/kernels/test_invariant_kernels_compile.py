"""The batch-invariant attention's kernels (split + merge), the invariant matmul with its K ranges
added in one program, its TMA kernel for prefill rows and the fused invariant SwiGLU, compiled ahead of time for an H100 (sm_90) with the installed
Triton, on any machine: the interpreter tests cannot see a compile failure. The split kernel's
tiles (64 rows of 32 or 64 keys, 128 rows on 8 warps) must use Hopper's wgmma (the tensor-core instruction the speed of prefill in the mode
rests on), built without FMA contraction as the launch asks. A subprocess without TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
import triton.language as tl
from megatron_async.kernels import triton_invariant_attention as ia, triton_invariant_matmul as im
from megatron_async.kernels import triton_tma_linear as tma

def build(fn, types, consts, **opts):
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    asm = compile_asm(fn, sig, consts, **{"num_warps": 4, **opts})
    return {"cubin": "cubin" in asm, "wgmma": "wgmma.mma_async" in asm["ptx"], "fma": "fma.rn.f32" in asm["ptx"]}

i32 = "i32"
attn = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
attn.update(block_table_ptr="*i32", kv_lens_ptr="*i32", positions_ptr="*i64", cu_q_ptr="*i32", schedule_ptr="*i64",
            part_ptr="*fp32", lse_ptr="*fp32", scale_log2="fp32", num_heads=i32, num_kv_heads=i32)
attn.update({n: i32 for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs",
                              "stride_ch", "stride_bt")})
out = {}
for group, fp8 in ((2, False), (4, False), (2, True)):
    types = dict(attn, kv_scale_ptr="*fp32")
    if fp8:
        types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    block_q, block_n = ia.tiles(group, __import__("torch").device("cuda"))
    out[f"split_g{group}_fp8{fp8}"] = build(ia._split_kernel, types, dict(
        GROUP=group, BLOCK_G=group, BLOCK_Q=block_q, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=block_n,
        SPLIT=4096, MAX_SPLITS=5, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", KV_FP8=fp8, HEADS_FASTEST=True), num_stages=2,
        enable_fp_fusion=False)
# a long-context table's 64-key tiles: 64-row tiles on 4 warps, a long-tile step's 128-row tiles on 8 (ia.launches)
_, long_n = ia.tiles(2, __import__("torch").device("cuda"), 16500)
for rows, warps, fp8 in ((64, 4, False), (128, 8, False), (128, 8, True)):
    types = dict(attn, kv_scale_ptr="*fp32")
    if fp8:
        types.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    out[f"split_g2_n{long_n}_rows{rows}_fp8{fp8}"] = build(ia._split_kernel, types, dict(
        GROUP=2, BLOCK_G=2, BLOCK_Q=rows // 2, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=long_n, SPLIT=4096,
        MAX_SPLITS=5, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", KV_FP8=fp8, HEADS_FASTEST=True), num_stages=2,
        num_warps=warps, enable_fp_fusion=False)
out["split_with_fusion"] = build(ia._split_kernel, dict(attn, kv_scale_ptr="*fp32"), dict(
    GROUP=2, BLOCK_G=2, BLOCK_Q=32, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=32, SPLIT=4096, MAX_SPLITS=5,
    DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", KV_FP8=False, HEADS_FASTEST=True), num_stages=2, enable_fp_fusion=True)
out["merge"] = build(ia._merge_kernel, dict(part_ptr="*fp32", lse_ptr="*fp32", out_ptr="*bf16", positions_ptr="*i64",
                                           kv_lens_ptr="*i32", token_to_row_ptr="*i32", stride_ot=i32, stride_oh=i32,
                                           num_heads=i32),
                     dict(SPLIT=4096, MAX_SPLITS=5, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128))
out["matmul_in_program"] = build(im._matmul_kernel, dict(
    a_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", c_ptr="*bf16", ws_ptr="*bf16", M=i32, N=i32, K=i32,
    stride_am=i32, stride_ak=i32, stride_wn=i32, stride_wk=i32, stride_cm=i32),
    dict(K_PER_SPLIT=768, SPLIT_K=4, IN_PROGRAM=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8,
         HAS_BIAS=False, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", EVEN_K=True), num_stages=4)
out["swiglu"] = build(im._swiglu_kernel, dict(
    a_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", c_ptr="*bf16", M=i32, I=i32, K=i32,
    stride_am=i32, stride_ak=i32, stride_wn=i32, stride_wk=i32, stride_cm=i32),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, HAS_BIAS=True, DOT_DTYPE=tl.bfloat16,
         DOT_PRECISION="tf32", EVEN_K=True), num_stages=4)
for ranges, (bm, bn, bk, _w, stages) in tma.TILES.items():
    out[f"tma_linear_ranges{ranges}"] = build(tma._tma_linear_kernel, dict(
        a_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=f"tensordesc<bf16[{bn}, {bk}]>",
        out_desc=f"tensordesc<bf16[{bm}, {bn}]>", bias_ptr="*bf16", M=i32, N=i32, K=i32, num_programs=i32),
        dict(K_PER_SPLIT=768, RANGES=ranges, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, HAS_BIAS=True,
             DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32"), num_stages=stages)
print(json.dumps(out))
'''


def test_invariant_kernels_compile_for_sm90():
    out = compile_results(_SCRIPT, timeout=600)
    assert all(v["cubin"] for v in out.values()), out
    assert all(out[k]["wgmma"] for k in out if k.startswith(("split", "tma_linear"))), out
    # built as the launch builds it, no float FMA: the unmasked and masked key loops round alike
    # (contraction on, the same source forms FMAs: what the launch option prevents)
    assert not any(out[k]["fma"] for k in out if k.startswith("split_g")), out
    assert out["split_with_fusion"]["fma"], out
