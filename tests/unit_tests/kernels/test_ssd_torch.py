"""Reference SSD scan and causal conv1d: chunked == sequential, states carry exactly."""
import pytest
import torch
import torch.nn.functional as F

from megatron_async.kernels.conv1d_torch import causal_conv1d, causal_conv1d_step
from megatron_async.kernels.ssd_torch import ssd_chunked, ssd_sequential, ssd_step

B, L, H, P, G, N = 2, 11, 4, 3, 2, 5


def _inputs(seed: int = 0, length: int = L, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, length, H, P, generator=g)
    dt = 0.05 + 0.5 * torch.rand(B, length, H, generator=g)
    A = -(0.1 + torch.rand(H, generator=g))
    Bm = torch.randn(B, length, G, N, generator=g)
    Cm = torch.randn(B, length, G, N, generator=g)
    D = torch.randn(H, generator=g)
    init = torch.randn(B, H, P, N, generator=g)
    return [t.to(device) for t in (x, dt, A, Bm, Cm, D, init)]


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 16])
def test_chunked_equals_sequential_with_initial_state(chunk):
    x, dt, A, Bm, Cm, D, init = _inputs()
    y_ref, s_ref = ssd_sequential(x, dt, A, Bm, Cm, D, init)
    y, s = ssd_chunked(x, dt, A, Bm, Cm, chunk, D, init)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


def test_no_initial_state_means_zeros():
    x, dt, A, Bm, Cm, D, init = _inputs(1)
    y0, s0 = ssd_chunked(x, dt, A, Bm, Cm, 4, D)
    y1, s1 = ssd_chunked(x, dt, A, Bm, Cm, 4, D, torch.zeros_like(init))
    torch.testing.assert_close(y0, y1)
    torch.testing.assert_close(s0, s1)
    assert not torch.allclose(ssd_chunked(x, dt, A, Bm, Cm, 4, D, init)[0], y0)  # the state matters


def test_ssd_step_matches_elementwise_formula():
    """Independent of the einsum code: explicit loops, head h reads group h // (H / G)."""
    x, dt, A, Bm, Cm, D, init = _inputs(2)
    y, new = ssd_step(x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], init, D)
    for b in range(B):
        for h in range(H):
            grp = h // (H // G)
            decay = torch.exp(dt[b, 0, h] * A[h])
            for p in range(P):
                s = init[b, h, p] * decay + dt[b, 0, h] * x[b, 0, h, p] * Bm[b, 0, grp]
                torch.testing.assert_close(new[b, h, p], s)
                torch.testing.assert_close(y[b, h, p], (s * Cm[b, 0, grp]).sum() + D[h] * x[b, 0, h, p])


def test_split_sequence_carries_state():
    x, dt, A, Bm, Cm, D, init = _inputs(3)
    y_full, s_full = ssd_chunked(x, dt, A, Bm, Cm, 4, D, init)
    a = 6
    y1, s1 = ssd_chunked(x[:, :a], dt[:, :a], A, Bm[:, :a], Cm[:, :a], 4, D, init)
    y2, s2 = ssd_chunked(x[:, a:], dt[:, a:], A, Bm[:, a:], Cm[:, a:], 4, D, s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_full, rtol=1e-5, atol=1e-5)


def test_dt_zero_padding_keeps_final_state():
    """The mixer pads ragged rows with dt = 0: the final state is the state at the real end."""
    x, dt, A, Bm, Cm, D, init = _inputs(4)
    real = 7
    dt_pad = dt.clone()
    dt_pad[:, real:] = 0
    _, s_pad = ssd_chunked(x, dt_pad, A, Bm, Cm, 4, D, init)
    _, s_real = ssd_chunked(x[:, :real], dt[:, :real], A, Bm[:, :real], Cm[:, :real], 4, D, init)
    torch.testing.assert_close(s_pad, s_real, rtol=1e-5, atol=1e-5)


def _conv_inputs(seed: int = 0, length: int = 9, c: int = 6, k: int = 4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, length, c, generator=g), torch.randn(c, k, generator=g),
            torch.randn(c, generator=g), torch.randn(B, c, k - 1, generator=g))


def test_conv_with_state_equals_full_conv():
    x, w, bias, state = _conv_inputs()
    out, final = causal_conv1d(x, w, bias, state)
    # Ground truth: the state is the K-1 inputs before x; conv the whole history at once.
    history = torch.cat([state, x.transpose(1, 2)], dim=2)
    full = F.conv1d(history, w[:, None, :], bias, padding=w.shape[1] - 1, groups=w.shape[0])
    expected = F.silu(full[:, :, w.shape[1] - 1 : history.shape[2]]).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(final, history[:, :, -(w.shape[1] - 1):])


def test_conv_in_pieces_and_steps_equals_whole():
    x, w, bias, state = _conv_inputs(1)
    out, final = causal_conv1d(x, w, bias, state)
    o1, s1 = causal_conv1d(x[:, :2], w, bias, state)  # shorter than K - 1: keeps part of the state
    o2, s2 = causal_conv1d(x[:, 2:6], w, bias, s1)
    outs = [o1, o2]
    s = s2
    for t in range(6, x.shape[1]):
        o, s = causal_conv1d_step(x[:, t], w, bias, s)
        outs.append(o[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), out)
    torch.testing.assert_close(s, final)


def test_conv_lengths_take_each_rows_final_state():
    x, w, bias, state = _conv_inputs(2)
    lengths = torch.tensor([9, 2])
    out, final = causal_conv1d(x, w, bias, state, lengths)
    for b, n in enumerate(lengths.tolist()):
        o_b, f_b = causal_conv1d(x[b : b + 1, :n], w, bias, state[b : b + 1])
        torch.testing.assert_close(out[b : b + 1, :n], o_b)
        torch.testing.assert_close(final[b : b + 1], f_b)

