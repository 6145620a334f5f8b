"""The fused all-reduce + add + RMSNorm kernels (one-shot, one-shot over K-split partials, two-shot)
compiled ahead of time for an H100 (sm_90) with the installed Triton, on any machine: the
interpreter runs them on CPU but cannot see a construct the compiler refuses (the two-shot one in
float32 too, as the set-up's self-test runs it). Each must compile,
push its rows in 16-byte stores and raise its barrier flags with system-scope release atomics."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
import re
from megatron_async.kernels import triton_fused_all_reduce as fused

D16 = [["tt.divisibility", 16]]
types = dict(x_ptr="*bf16", buf_table_ptr="*i64", pad_table_ptr="*i64", res_ptr="*bf16", w_ptr="*bf16",
             out_ptr="*bf16", res_out_ptr="*bf16", state_ptr="*i32", eps="fp32")
out = {}
fp32 = {n: "*fp32" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
for name, fn, extra in (("one", fused._fused_kernel, dict(SPLITS=0)), ("split", fused._fused_kernel, dict(SPLITS=4)),
                        ("two", fused._two_shot_kernel, {}), ("two_fp32", fused._two_shot_kernel, {})):
    sig = {n: types.get(n, "constexpr" if n.isupper() and n != "M" else "i32") for n in fn.arg_names}
    if name == "split":
        sig["x_ptr"] = "*fp32"
    if name == "two_fp32":  # the set-up's self-test: float32 rows of 256
        sig.update(fp32)
    hidden = 256 if name == "two_fp32" else 4096
    consts = dict(N=hidden, BLOCK_N=hidden, W=4, CAST_BEFORE_WEIGHT=True, BARRIER=True, **extra)
    attrs = {(i,): D16 for i, n in enumerate(fn.arg_names) if n.endswith("_ptr")}
    ptx = compile_asm(fn, sig, consts, attrs, num_warps=min(max(hidden // 512, 1), 16))["ptx"]  # the launch's warps
    out[name] = {"wide_stores": len(re.findall(r"st\.global(\.\w+)*\.v4\.b32", ptx)),
                 "release_sys": len(re.findall(r"atom\.global\.sys\.release\.exch", ptx))}
print(json.dumps(out))
'''


def test_fused_all_reduce_kernels_compile_for_sm90():
    out = compile_results(_SCRIPT, timeout=600)
    for name in ("one", "split", "two", "two_fp32"):
        assert out[name]["wide_stores"] > 0 and out[name]["release_sys"] > 0, out
