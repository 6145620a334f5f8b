"""The KV chunk kernel compiled ahead of time for an H100 (sm_90) with the installed Triton: both
directions build, and the aligned form moves 16-byte vectors (the table's addresses carry no
alignment of their own: the hints must reach the loads and stores), the byte-wise form bytes.
A subprocess without TRITON_INTERPRET; skipped where Triton has no CUDA backend."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers.sm90_compile import compile_results  # noqa: E402

_SCRIPT = r'''
import re
import triton.language as tl
from megatron_async.kernels import triton_kv_chunk as k

out = {}
for gather in (True, False):
    for aligned in (True, False):
        sig = {"buf": "*i32" if aligned else "*u8", "table": "*i64", "idx": "*i64", "n": "i32", "tiles": "i32",
               "GATHER": "constexpr", "ELEM": "constexpr", "ELEM_BYTES": "constexpr", "ALIGNED": "constexpr",
               "BLOCK": "constexpr"}
        consts = {"GATHER": gather, "ELEM": tl.int32 if aligned else tl.uint8, "ELEM_BYTES": 4 if aligned else 1,
                  "ALIGNED": aligned, "BLOCK": k.TILE_BYTES // (4 if aligned else 1)}
        ptx = compile_asm(k._chunk_kernel, sig, consts, num_warps=4)["ptx"]
        out[f"{'gather' if gather else 'scatter'}_{'aligned' if aligned else 'bytes'}"] = sorted(
            set(re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b\d+", ptx)) - {"ld.global.b64"})  # (the table's entries)
print(json.dumps(out))
'''


def test_kv_chunk_kernel_compiles_with_vector_moves_for_sm90():
    result = compile_results(_SCRIPT, timeout=300)
    for side in ("gather", "scatter"):
        assert result[f"{side}_aligned"] == ["ld.global.v4.b32", "st.global.v4.b32"], result
        assert result[f"{side}_bytes"] == ["ld.global.b8", "st.global.b8"], result
