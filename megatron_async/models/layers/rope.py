"""Rotary position embedding: one cos/sin table per model, gathered at each token's position.

The table holds row p = the rotation of position p; it is built once up to
``max_position_embeddings`` and regrown (host-side check of a host int, no device
sync) when a step reaches past it. Frequencies follow the Hugging Face rope types
"default", "linear", "dynamic", "llama3" and "yarn".

"dynamic" (NTK) in Hugging Face rescales the base with the longest sequence in the
forward call, so its value depends on batching. Here row p uses the base HF computes
when the sequence is p + 1 tokens long: identical to HF for positions below
``max_position_embeddings`` and for token-by-token decoding beyond it, and
independent of how requests are batched."""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron_async.models.model_config import RopeScaling


def _default_inv_freq(theta: float | torch.Tensor, dim: int, device: torch.device | str) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by factor, short ones kept, the band between blended.
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(theta: float, dim: int, s: RopeScaling, device: torch.device | str) -> tuple[torch.Tensor, float]:
    """Per-dimension blend of interpolated (slow) and extrapolated (fast) frequencies."""

    def correction_dim(num_rotations: float) -> float:
        wavelengths = s.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1 = keep the original (extrapolated) frequency
    inv = interpolated * (1 - keep) + extrapolated * keep
    if s.attention_factor is not None:
        attn = float(s.attention_factor)
    elif s.mscale and s.mscale_all_dim:
        attn = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attn = _yarn_mscale(s.factor)
    return inv, attn


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        theta: float,
        scaling: RopeScaling | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_position_embeddings = max_position_embeddings
        self.dtype = dtype
        self.attention_factor = 1.0
        kind = scaling.rope_type if scaling else "default"
        # On the meta device (a model built only to count its bytes) the values are computed on
        # the CPU: meta arithmetic runs torch's Python references, whose first use imports
        # torch._dynamo (~1 s of a start-up that never needs it).
        at = "cpu" if torch.device(device).type == "meta" else device
        inv = _default_inv_freq(theta, head_dim, at)
        if kind == "linear":
            inv = inv / scaling.factor
        elif kind == "llama3":
            inv = _llama3_inv_freq(inv, scaling)
        elif kind == "yarn":
            inv, self.attention_factor = _yarn_inv_freq(theta, head_dim, scaling, at)
        inv = inv.to(device)
        self.inv_freq: torch.Tensor
        self.table: torch.Tensor
        """[P, head_dim]: row p = cos | sin of position p, so a step gathers both in one kernel."""
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("table", torch.empty(0, head_dim, dtype=dtype, device=device), persistent=False)
        self.reserve(max_position_embeddings)

    @property
    def num_positions(self) -> int:
        return self.table.shape[0]

    def _inv_freq_per_position(self, positions: torch.Tensor) -> torch.Tensor:
        """[P] -> [P, D/2] (dynamic NTK) or [D/2] (every other type)."""
        if self.scaling is None or self.scaling.rope_type != "dynamic":
            return self.inv_freq
        dim, mpe, factor = self.head_dim, self.max_position_embeddings, self.scaling.factor
        seq_len = torch.clamp(positions + 1, min=mpe)
        base = self.theta * ((factor * seq_len / mpe) - (factor - 1)) ** (dim / (dim - 2))
        inv = _default_inv_freq(base[:, None], dim, positions.device)
        return torch.where((positions < mpe)[:, None], self.inv_freq[None, :], inv)

    def reserve(self, num_positions: int) -> None:
        """Make the table cover positions [0, num_positions); grows geometrically. Call
        before CUDA-graph capture so replays never need to regrow it."""
        if num_positions <= self.num_positions:
            return
        size = max(num_positions, 2 * self.num_positions)
        if self.inv_freq.is_meta:  # sizes only (see __init__)
            self.table = torch.empty(size, self.head_dim, dtype=self.dtype, device="meta")
            return
        positions = torch.arange(size, device=self.inv_freq.device)
        freqs = positions[:, None].float() * self._inv_freq_per_position(positions)
        self.table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).mul(self.attention_factor).to(self.dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, head_dim / 2] in the model dtype (views of
        one gathered [T, head_dim] tensor: unit last stride, row stride head_dim)."""
        rows = self.table[positions]
        return rows[:, : self.head_dim // 2], rows[:, self.head_dim // 2 :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim of x [T, N, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
