"""Row-wise float32 log-softmax whose bits do not depend on the number of rows.

One program per row walks the row in fixed BLOCK-wide slices from column 0: each lane keeps
its own running max and sum of exponentials, and the lanes are combined once at the end by
one fixed-shape reduction. The block and warp count depend only on the row width, so a row
reduces the same way alone or among thousands (torch's kernels choose their launch shape
from the whole tensor). Runs on CPU under ``TRITON_INTERPRET=1``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse(x_row, V, BLOCK: tl.constexpr):
    """The row's log-sum-exp in this module's fixed order."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only -inf
        s = s * tl.exp(m - m_use) + tl.exp(x - m_use)
        m = m_new
    m_row = tl.max(m, 0)
    m_row_use = tl.where(m_row == float("-inf"), 0.0, m_row)
    return m_row_use + tl.log(tl.sum(s * tl.exp(m - m_row_use), 0))


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, stride_x, stride_o, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    lse = _lse(x_row, V, BLOCK)
    o_row = out_ptr + row * stride_o
    for v0 in range(0, V, BLOCK):
        x = tl.load(x_row + v0 + offs, mask=v0 + offs < V, other=0.0).to(tl.float32)
        tl.store(o_row + v0 + offs, x - lse, mask=v0 + offs < V)


@triton.jit
def _lse_kernel(x_ptr, out_ptr, stride_x, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row, _lse(x_ptr + row * stride_x, V, BLOCK))


def _launch(logits: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if logits.dim() != 2:
        raise ValueError(f"log_softmax takes [rows, vocab], got {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(4096, triton.next_power_of_2(logits.shape[1]))
    return logits, block, 8 if block >= 2048 else 4


def row_lse(logits: torch.Tensor) -> torch.Tensor:
    """[R] float32: each row's log-sum-exp, the bits ``log_softmax`` subtracts."""
    logits, block, warps = _launch(logits)
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    if out.numel() and logits.shape[1]:
        _lse_kernel[(logits.shape[0],)](logits, out, logits.stride(0), logits.shape[1], BLOCK=block, num_warps=warps)
    return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of a 2-D tensor, in float32."""
    logits, block, warps = _launch(logits)
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows == 0 or vocab == 0:
        return out
    _log_softmax_kernel[(rows,)](logits, out, logits.stride(0), out.stride(0), vocab, BLOCK=block, num_warps=warps)
    return out
