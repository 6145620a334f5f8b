"""Mamba2 decode windows (speculative verification) and the on-device commit: a window of T
tokens equals T sequential single-token decodes (outputs and the state after every token),
the committed slot pool is never written by a window, T = 1 equals today's decode, and the
commit copies exactly scratch[slot, accepted] into each row's slot for every accepted count.
Triton kernels run compiled on CUDA or interpreted on CPU; both backends are checked."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.config import MambaBackend  # noqa: E402
from megatron_async.kernels import mamba_ops, mamba_window_ops  # noqa: E402
from megatron_async.kernels.triton_mamba_decode import causal_conv1d_update, selective_state_update  # noqa: E402
from megatron_async.kernels.triton_mamba_window import (  # noqa: E402
    causal_conv1d_window,
    commit_window_state,
    selective_state_window,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = [4, 0, 2]  # rows read slots 4, 0, 2 of a 6-slot pool
HAS_INIT = [True, False, True]  # row 1 starts from zeros: its slot holds junk
FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@pytest.fixture(params=[MambaBackend.TORCH, MambaBackend.TRITON])
def backend(request) -> bool:
    """Whether the ops run the Triton kernels (TRITON) or the torch reference (TORCH)."""
    return request.param == MambaBackend.TRITON


def _rows():
    return torch.tensor(SLOTS, device=DEVICE), torch.tensor(HAS_INIT, device=DEVICE)


def _conv_case(seed: int, T: int, k: int, dtype: torch.dtype, c: int = 12):
    g = torch.Generator().manual_seed(seed)
    return (_randn(g, 3, T, c, dtype=dtype), _randn(g, c, k, dtype=dtype), _randn(g, c, dtype=dtype),
            _randn(g, 6, c, k - 1, dtype=dtype))


def _ssm_case(seed: int, T: int, h: int = 4, p: int = 8, g_: int = 2, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    x, dt_raw = _randn(g, 3, T, h, p), _randn(g, 3, T, h)
    A = -torch.rand(h, generator=g).to(DEVICE) - 0.5
    B, C, D = _randn(g, 3, T, g_, n), _randn(g, 3, T, g_, n), _randn(g, h)
    dt_bias, pool = _randn(g, h), _randn(g, 6, h, p, n)
    return x, dt_raw, A, B, C, D, dt_bias, pool


@pytest.mark.parametrize("T, k, dtype", [(1, 4, torch.float32), (4, 4, torch.float32), (3, 2, torch.float32),
                                          (4, 4, torch.bfloat16)])
def test_conv_window_equals_sequential_decodes(backend, T, k, dtype):
    x, w, bias, pool = _conv_case(T * 10 + k, T, k, dtype)
    slots, has_init = _rows()
    seq_pool, outs, states = pool.clone(), [], []
    for t in range(T):
        outs.append(mamba_ops.conv1d_decode_inplace(x[:, t], w, bias, seq_pool, slots, has_init if t == 0 else torch.ones_like(has_init)))
        states.append(seq_pool[slots].clone())

    scratch = torch.full((7, T + 1, *pool.shape[1:]), 7.0, dtype=dtype, device=DEVICE)
    win_pool = pool.clone()
    out = mamba_window_ops.conv1d_window(x, w, bias, win_pool, scratch, slots, has_init, triton=backend)
    tol = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(out.float(), torch.stack(outs, 1).float(), **tol)
    torch.testing.assert_close(scratch[slots, :T].float(), torch.stack(states, 1).float(), **tol)
    assert torch.equal(win_pool, pool), "a window must not write the committed slots"
    untouched = [s for s in range(7) if s not in SLOTS]
    assert (scratch[untouched] == 7.0).all() and (scratch[:, T:] == 7.0).all()


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("dt_opts", [False, True])
def test_ssd_window_equals_sequential_decodes(backend, T, dt_opts):
    x, dt_raw, A, B, C, D, dt_bias, pool = _ssm_case(T + 7 * dt_opts, T)
    slots, has_init = _rows()
    kw = dict(dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.01, 2.0)) if dt_opts else {}
    dt = dt_raw if dt_opts else torch.nn.functional.softplus(dt_raw)
    seq_pool, ys, states = pool.clone(), [], []
    for t in range(T):
        init = has_init if t == 0 else torch.ones_like(has_init)
        ys.append(mamba_ops.ssd_decode_inplace(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, seq_pool, slots, init, **kw))
        states.append(seq_pool[slots].clone())

    scratch = torch.full((7, T, *pool.shape[1:]), 7.0, device=DEVICE)
    win_pool = pool.clone()
    y = mamba_window_ops.ssd_window(x, dt, A, B, C, D, win_pool, scratch, slots, has_init, **kw, triton=backend)
    torch.testing.assert_close(y, torch.stack(ys, 1), **FP32)
    torch.testing.assert_close(scratch[slots], torch.stack(states, 1), **FP32)
    assert torch.equal(win_pool, pool)


def test_ssd_window_bf16_inputs():
    """bf16 activations (the GPU dtype): the kernel upcasts like the fp32 reference does."""
    x, dt_raw, A, B, C, D, _, pool = _ssm_case(5, 3)
    slots, has_init = _rows()
    dt = torch.nn.functional.softplus(dt_raw)
    xb, Bb, Cb = x.bfloat16(), B.bfloat16(), C.bfloat16()
    scratch_ref, scratch = torch.zeros(7, 3, *pool.shape[1:], device=DEVICE), torch.zeros(7, 3, *pool.shape[1:], device=DEVICE)
    ref = mamba_window_ops.ssd_window(xb, dt, A, Bb, Cb, D, pool, scratch_ref, slots, has_init)
    y = selective_state_window(xb, dt, A, Bb, Cb, D, pool, scratch, slots, has_init)
    torch.testing.assert_close(y, ref, **FP32)
    torch.testing.assert_close(scratch, scratch_ref, **FP32)


def test_window_of_one_equals_todays_decode_kernels():
    """T = 1 through the window kernels == the in-place decode kernels (same math, same slot)."""
    x, w, bias, cpool = _conv_case(3, 1, 4, torch.float32)
    slots, has_init = _rows()
    cscratch = torch.zeros(7, 1, *cpool.shape[1:], device=DEVICE)
    new_cpool = cpool.clone()
    ref = causal_conv1d_update(x[:, 0], w, bias, new_cpool, slots=slots, has_initial_state=has_init)
    out = causal_conv1d_window(x, w, bias, cpool, cscratch, slots, has_init)
    torch.testing.assert_close(out[:, 0], ref, rtol=0, atol=0)
    torch.testing.assert_close(cscratch[slots, 0], new_cpool[slots], rtol=0, atol=0)

    xs, dt, A, B, C, D, dt_bias, spool = _ssm_case(4, 1)
    sscratch = torch.zeros(7, 1, *spool.shape[1:], device=DEVICE)
    new_spool = spool.clone()
    kw = dict(dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 5.0))
    ref = selective_state_update(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, new_spool, slots=slots, has_initial_state=has_init, **kw)
    y = selective_state_window(xs, dt, A, B, C, D, spool, sscratch, slots, has_init, **kw)
    torch.testing.assert_close(y[:, 0], ref, **FP32)
    torch.testing.assert_close(sscratch[slots, 0], new_spool[slots], **FP32)


@pytest.mark.parametrize("k", [1, 3])
def test_commit_picks_the_accepted_state(backend, k):
    """Every accepted count 0..k, rows in any slot order: each row's slot gets exactly
    scratch[slot, accepted]; every other slot (and the scratch) keeps its bytes."""
    g = torch.Generator().manual_seed(k)
    S, T = 2 * (k + 1) + 2, k + 1
    conv_pool, ssm_pool = _randn(g, S, 5, 3), _randn(g, S, 2, 3, 4)
    conv_scratch, ssm_scratch = _randn(g, S, T, 5, 3), _randn(g, S, T, 2, 3, 4)
    accepted = torch.tensor([a for a in range(T) for _ in range(2)], device=DEVICE)  # each count twice
    slots = torch.randperm(S, generator=g)[: accepted.numel()].to(DEVICE)
    before = (conv_pool.clone(), ssm_pool.clone(), conv_scratch.clone(), ssm_scratch.clone())
    mamba_window_ops.commit_window_states([conv_pool, ssm_pool], [conv_scratch, ssm_scratch], slots, accepted,
                                          triton=backend)
    for r, (s, a) in enumerate(zip(slots.tolist(), accepted.tolist())):
        assert torch.equal(conv_pool[s], before[2][s, a]) and torch.equal(ssm_pool[s], before[3][s, a]), (r, s, a)
    others = [s for s in range(S) if s not in slots.tolist()]
    assert others and torch.equal(conv_pool[others], before[0][others]) and torch.equal(ssm_pool[others], before[1][others])
    assert torch.equal(conv_scratch, before[2]) and torch.equal(ssm_scratch, before[3])


def test_commit_leaves_rows_outside_the_mask_alone(backend):
    """Rows without drafts (prefill chunks, plain decode rows) advanced their slots in place: a
    commit with ``rows`` False for them must not write those slots."""
    g = torch.Generator().manual_seed(5)
    pool, scratch = _randn(g, 5, 3, 2), _randn(g, 5, 2, 3, 2)
    before = pool.clone()
    slots, accepted = torch.tensor([2, 0, 4], device=DEVICE), torch.tensor([1, 1, 0], device=DEVICE)
    rows = torch.tensor([True, False, True], device=DEVICE)
    mamba_window_ops.commit_window_states([pool], [scratch], slots, accepted, rows, triton=backend)
    assert torch.equal(pool[2], scratch[2, 1]) and torch.equal(pool[4], scratch[4, 0])
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])


def test_commit_rejects_mismatched_scratch():
    pool, scratch = torch.zeros(4, 3, 2, device=DEVICE), torch.zeros(4, 2, 3, 3, device=DEVICE)
    with pytest.raises(ValueError):
        commit_window_state(pool, scratch, torch.tensor([0], device=DEVICE), torch.tensor([0], device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_window_realistic_sizes_on_gpu():
    """NemotronH-like: 128 heads of 64, d_state 128, 8 groups, bf16 activations, k = 3 drafts."""
    g = torch.Generator().manual_seed(13)
    h, p, grp, n, K, rows, T = 128, 64, 8, 128, 4, 64, 4
    c, bf16 = h * p + 2 * grp * n, torch.bfloat16
    x, B, C = _randn(g, rows, T, h, p, dtype=bf16), _randn(g, rows, T, grp, n, dtype=bf16), _randn(g, rows, T, grp, n, dtype=bf16)
    dt, dt_bias, D = _randn(g, rows, T, h), _randn(g, h), _randn(g, h)
    A = -(0.5 + 4 * torch.rand(h, generator=g).to(DEVICE))
    pool = _randn(g, rows + 8, h, p, n)
    slots = torch.randperm(rows + 8, generator=g)[:rows].to(DEVICE)
    has_init = torch.rand(rows, generator=g).to(DEVICE) > 0.2
    kw = dict(dt_bias=dt_bias, dt_softplus=True, dt_limit=(1e-3, float("inf")))
    scratch_ref, scratch = (torch.zeros(rows + 8, T, h, p, n, device=DEVICE) for _ in range(2))
    ref = mamba_window_ops.ssd_window(x, dt, A, B, C, D, pool, scratch_ref, slots, has_init, **kw)
    y = selective_state_window(x, dt, A, B, C, D, pool, scratch, slots, has_init, **kw)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(scratch[slots], scratch_ref[slots], rtol=1e-4, atol=1e-4)

    cx, w, bias = _randn(g, rows, T, c, dtype=bf16), _randn(g, c, K, dtype=bf16), _randn(g, c, dtype=bf16)
    cpool = _randn(g, rows + 8, c, K - 1, dtype=bf16)
    cscratch_ref, cscratch = (torch.zeros(rows + 8, T, c, K - 1, dtype=bf16, device=DEVICE) for _ in range(2))
    ref_out = mamba_window_ops.conv1d_window(cx, w, bias, cpool, cscratch_ref, slots, has_init)
    out = causal_conv1d_window(cx, w, bias, cpool, cscratch, slots, has_init)
    torch.testing.assert_close(out.float(), ref_out.float(), **BF16)
    assert torch.equal(cscratch[slots], cscratch_ref[slots])  # states are copies of inputs: exact

    accepted = torch.randint(0, T, (rows,), generator=g).to(DEVICE)
    new_pool = pool.clone()
    commit_window_state(new_pool, scratch, slots, accepted)
    assert torch.equal(new_pool[slots], scratch[slots, accepted])
