"""FP8 (e4m3) block-scaled quantization in torch: every rule the Triton FP8 kernels follow, and
the emulated (CPU) path of the FP8 linear.

Conventions (the published Qwen3-*-FP8 / DeepSeek-V3 layout for weights):
- A weight W [N, K] is stored as ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32
  [ceil(N / 128), ceil(K / 128)]: W ~= weight * weight_scale_inv, block by block (the name says
  "inverse" because the quantizer divided by it; it is the DEQUANTIZATION multiplier). The last
  row / column block may be partial.
- Quantize-at-load (bf16 -> fp8) uses s = amax(block) / 448 (an all-zero block gets s = 1) and
  q = RNE(clamp(W / s, -448, 448)): the rule the published checkpoints were made with.
- Activations: per token, per group of 128 consecutive K elements, float32 s = amax / 448 (the
  dequantization multiplier) and inv = 448 / amax (the quantization multiplier), each ONE correctly
  rounded division (torch: tensor / tensor; Triton: ``tl.math.div_rn``), then q = RNE(clamp(x * inv)):
  one multiply and one rounding per element, so the kernels, their interpreter runs and this
  module give the same bits. The group's largest element lands on 448 and is represented almost
  exactly (it dominates the dot). torch's ``scalar / tensor`` is a reciprocal then a multiply
  (two roundings), not a division: never use it here.
- K not a multiple of 128: the last group is partial (zeros pad it); never rejected.
- Power-of-two scales (``pow2_scale``: exact without any division) are the KV cache's.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
AMAX_FLOOR = 2.0 ** -100
"""Group maxima are raised to this, so an all-zero group gets a finite scale (2^-108)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) float32, both powers of two: the smallest 2^e with amax / 2^e <= 448.
    The Triton kernels compute the same from the float's bits (``triton_fp8_common.pow2_scale``)."""
    amax = amax.float().clamp(min=AMAX_FLOOR)
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1); 448 = 0.875 * 2^9
    e = exp - 9 + (mant > 0.875).to(exp.dtype)
    return torch.ldexp(torch.ones_like(amax), e), torch.ldexp(torch.ones_like(amax), -e)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even to e4m3, saturating at +-448 (what the GPU's cvt.rn.satfinite does)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def group_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale = amax / 448, inv = 448 / amax), float32, each one IEEE division (tensor / tensor)."""
    amax = amax.float().clamp(min=AMAX_FLOOR)
    c = torch.full_like(amax, FP8_MAX)
    return amax / c, c / amax


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, ceil(K / 128)] float32); x ~= q * scale per (row, group)."""
    m, k = x.shape
    g = _pad_to(x.float(), 1, GROUP).view(m, -1, GROUP)
    scale, inv = group_scales(g.abs().amax(dim=2))
    q = to_e4m3(g * inv[:, :, None]).view(m, -1)[:, :k]
    return q, scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    k = q.shape[1]
    return q.float() * scale.repeat_interleave(GROUP, dim=1)[:, :k]


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] e4m3, weight_scale_inv [..., ceil(N / bn), ceil(K / bk)] float32)
    with s = amax / 448 per block (1 for an all-zero block), q = RNE(clamp(w / s)). Every op is
    IEEE-exact or correctly rounded, so CPU and GPU give the same bits."""
    bn, bk = block
    *lead, n, k = w.shape
    wf = _pad_to(_pad_to(w.float(), -1, bk), -2, bn)
    nb, kb = wf.shape[-2] // bn, wf.shape[-1] // bk
    blocks = wf.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    # tensor / tensor: CUDA turns a division by a Python scalar into a multiply by its reciprocal
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    q = to_e4m3(blocks / scale[..., :, None, :, None]).reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
    return q.contiguous(), scale


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] = (GROUP, GROUP)) -> torch.Tensor:
    """A block scale grid [..., Nb, Kb] as one value per element [..., n, k]."""
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, scale_block_n: int = GROUP) -> torch.Tensor:
    """float32 weights from e4m3 + a scale grid whose rows each cover ``scale_block_n`` weight rows
    (128: the checkpoint grid; 1: one scale row per weight row, see ``row_scales``)."""
    n, k = q.shape[-2:]
    return q.float() * expand_block_scale(scale, n, k, (scale_block_n, GROUP))


def row_scales(scale: torch.Tensor, n: int, row_offset: int = 0) -> torch.Tensor:
    """A checkpoint grid [Nb, Kb] as one scale row per weight row [n, Kb] for the rows
    row_offset .. row_offset + n - 1 (stacked parts or TP shards whose row ranges do not fall
    on 128-row block boundaries: exact, no requantization)."""
    rows = torch.arange(row_offset, row_offset + n, device=scale.device) // GROUP
    return scale.index_select(-2, rows)


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                         scale_block_n: int = GROUP, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float32 reference (and the CPU emulated path) of the W8A8 block-scaled linear: x [M, K]
    is quantized per 1 x 128 group, both operands dequantized to float32, multiplied in float32,
    the bias added in float32, one rounding to ``out_dtype`` (default: x's dtype)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_activation(x2)
    y = dequantize_activation(xq, x_scale) @ dequantize_weight(q, scale, scale_block_n).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).reshape(*lead, q.shape[0])
