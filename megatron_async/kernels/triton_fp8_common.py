"""Triton pieces shared by the FP8 kernels: activation group scales, power-of-two scales from a
float's bits (KV cache), and the rounding to e4m3.

On the GPU the rounding is the hardware conversion (``.to(tl.float8e4nv)``: round to nearest
even, saturating). Triton's CPU interpreter converts float32 -> e4m3 wrongly (ties and
subnormals: 140 of 256 midpoints rounded the other way, 0.0013 -> 0 instead of 2^-9 with triton
3.9), while it converts values e4m3 holds exactly, and e4m3 -> float32, correctly. So under the
interpreter (``EMULATE``) the value is first rounded in float32 with the add-and-subtract trick at
the e4m3 spacing of its binade, then converted (exactly)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def emulate(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (then EMULATE=True)."""
    return isinstance(kernel, InterpretedFunction)


@triton.jit
def pow2_reciprocal(s):
    """1 / s for a power of two s (exact, from the exponent bits; no division)."""
    return ((254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """float32 -> e4m3, round to nearest even, saturating at +-448."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6: the subnormal spacing 2^-9
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        magic = ulp * 12582912.0  # 1.5 * 2^23 ulps: x + magic rounds x to a multiple of ulp (RNE)
        r = tl.minimum((tl.abs(x) + magic) - magic, 448.0)
        return tl.where(bits < 0, -r, r).to(tl.float8e4nv)  # the sign bit: -0.0 and values that round to 0
    else:
        return tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def quantize_groups(a, EMULATE: tl.constexpr):
    """a [R, 128] float32 (one group per row) -> (e4m3 [R, 128], scales [R]): scale = amax / 448,
    q = RNE(a * (448 / amax)), both divisions correctly rounded (``div_rn``: Triton's ``/`` on
    float32 is an approximate division on the GPU) so the bits equal ``fp8_quant.quantize_activation``."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), 7.888609052210118e-31)  # fp8_quant.AMAX_FLOOR
    c = amax * 0.0 + 448.0
    scale = tl.math.div_rn(amax, c)
    inv = tl.math.div_rn(c, amax)
    return to_e4m3(a * inv[:, None], EMULATE), scale
