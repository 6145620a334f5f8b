"""The q/k norm + rope kernel compiled ahead of time for an H100 (sm_90) with the installed Triton,
on a TP rank's float32 qkv partials (``SPLITS`` 4) and on plain bf16 q / k / v, into the paged
cache and not. A subprocess without TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
from megatron_async.kernels import triton_rope as r

out = {}
for splits in (1, 4):
    for to_cache in (True, False):
        value = "*fp32" if splits > 1 else "*bf16"
        sig = {"q_ptr": value, "k_ptr": value, "v_ptr": value, "cos_ptr": "*bf16", "sin_ptr": "*bf16",
               "qw_ptr": "*bf16", "kw_ptr": "*bf16", "q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "v_out_ptr": "*bf16",
               "slot_ptr": "*i64", **{name: "i32" for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh",
               "stride_vt", "stride_vh", "stride_cos", "stride_sin", "stride_cb", "stride_cs", "stride_ch")},
               "eps": "fp32", "kv_scale_ptr": "*fp32", "split_stride": "i32"}
        consts = dict(NUM_Q_HEADS=8, NUM_K_HEADS=2, HEAD_DIM=128, ROT_DIM=128, BLOCK_HQ=8, BLOCK_HK=2, BLOCK_HALF=64,
                      BLOCK_PASS=1, BLOCK_D=128, HAS_NORM=True, TO_CACHE=to_cache, BLOCK_SIZE=16, KV_FP8=False,
                      EMULATE=False, SPLITS=splits)
        sig.update({name: "constexpr" for name in consts})
        asm = compile_asm(r._rope_qk_kernel, sig, consts, num_warps=4, enable_fp_fusion=False)
        out[f"{splits}_{to_cache}"] = asm["ptx"].count("ld.global")
print(json.dumps(out))
'''


def test_rope_kernel_compiles_on_split_partials_for_sm90():
    result = compile_results(_SCRIPT, timeout=300)
    for to_cache in (True, False):
        assert result[f"4_{to_cache}"] > result[f"1_{to_cache}"] > 0, result  # (the partials' extra loads)
