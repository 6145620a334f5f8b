"""The decode attention kernel over an e4m3 pool, compiled ahead of time for an H100 (sm_90) with the
installed Triton, on any machine. Its speed rests on what the interpreter cannot see: the key and
value tiles reach shared memory in 16-byte copies and leave it through 16-bit ldmatrix (never one
byte at a time: e4m3 bytes have no transposed ldmatrix for the value tile), widening with one
conversion per two values (not e4m3 -> f16 -> bf16, two a value). A subprocess without
TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
import re
import triton.language as tl
from megatron_async.kernels import triton_decode_attention as da

fn = da._decode_split_kernel
D16 = [["tt.divisibility", 16]]
out = {}
for pairs in (True, False):
    kv = "*i16" if pairs else "*fp8e4nv"
    types = dict(q_ptr="*i32" if pairs else "*bf16", k_cache_ptr=kv, v_cache_ptr=kv, block_table_ptr="*i32", kv_lens_ptr="*i32",
                 positions_ptr="*i64", row_order_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32",
                 part_lse_ptr="*fp32", scale_log2="fp32", kv_scale_ptr="*fp32", oq_ptr="*fp8e4nv", os_ptr="*fp32")
    sig = {n: types.get(n, "constexpr" if n.isupper() else "i32") for n in fn.arg_names}
    consts = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=128, SPLIT=False,
                  ORDERED=False, HEADS_FASTEST=True, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", KV_FP8=True,
                  E4M3_PAIRS=pairs, BLOCK_P=64, Q_BF16=True, USE_ASM=True,
                  QUANT_OUT=False)
    attrs = {(i,): D16 for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") or n.startswith("stride_")}
    ptx = compile_asm(fn, sig, consts, attrs, num_warps=4, num_stages=3)["ptx"]
    out[str(pairs)] = {
        "copy_bytes": sorted({int(b, 16) for b in re.findall(r"cp\.async\.\w+\.shared\.global [^;]*, (0x[0-9a-f]+)", ptx)}),
        "byte_lds": len(re.findall(r"ld\.shared\.[bu]8", ptx)),
        "cvt": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "cvt_bf16": len(re.findall(r"cvt\.bf16\.f16", ptx)),
        "mma": len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32", ptx)),
    }
print(json.dumps(out))
'''


def test_e4m3_decode_tiles_stay_wide_for_sm90():
    out = compile_results(_SCRIPT, timeout=600)
    new, old = out["True"], out["False"]
    # 16-byte tile copies (4 bytes: the block table), 16-bit shared reads, one e4m3x2 -> f16x2 conversion
    # per two values and no second one, float16 MMAs
    assert new["copy_bytes"] == [4, 16] and new["byte_lds"] == 0 and new["cvt_bf16"] == 0, out
    assert new["cvt"] > 0 and new["mma"] > 0, out
    # the kernel reading e4m3 bytes (fp32 queries' path, the bf16 one before) fails these checks
    assert old["byte_lds"] > 0 and old["cvt_bf16"] > 0, out
