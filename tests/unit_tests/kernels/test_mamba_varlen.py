"""The packed (varlen) Mamba2 ops of mixed steps against the per-row reference: ragged rows
(one-token decode rows, continuing and fresh prefill chunks) followed by graph padding rows
that share the padding slot, one with all padding tokens and some with none; on both backends
(TORCH's device layout, the TRITON kernels: interpreter on CPU). Real slots end where the
reference leaves them, the padding slot is the only other slot written; skipped rows (slot -1:
speculative verification windows, which the mixer runs apart) read and keep no state."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megatron_async.config import MambaBackend  # noqa: E402
from megatron_async.kernels import mamba_ops, mamba_varlen_ops, mamba_window_ops, triton_ssd_varlen  # noqa: E402
from megatron_async.kernels.conv1d_torch import causal_conv1d  # noqa: E402
from megatron_async.kernels.ssd_torch import ssd_sequential  # noqa: E402
from tests.unit_tests.kernels.test_mamba_triton import DEVICE, _gen, _rand, _randn  # noqa: E402

PAD_SLOT = 9


@pytest.fixture(params=[MambaBackend.TORCH, MambaBackend.TRITON])
def backend(request) -> bool:
    """Whether the ops run the Triton kernels (TRITON) or the torch reference (TORCH)."""
    return request.param == MambaBackend.TRITON


def _rows(lengths: list[int], slots: list[int], has_init: list[bool], num_real: int, max_len: int,
          skipped: tuple[int, ...] = (), triton: bool = False):
    """VarlenRows of a step as the plan lays it out: ``skipped`` rows (verification windows) first
    in the order and left out, then several-token real rows, then the rest."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    run = [r for r in range(num_real) if r not in skipped]
    order = list(skipped) + [r for r in run if lengths[r] > 1] + [r for r in run if lengths[r] <= 1]
    order += list(range(num_real, len(lengths)))
    dev = lambda v, dt=torch.long: torch.tensor(v, dtype=dt, device=DEVICE)  # noqa: E731
    tok_row = [r for r, n in enumerate(lengths) for _ in range(n)]
    graph = num_real < len(lengths)
    num_scan = len(order) - len(skipped) if graph else sum(lengths[r] > 1 for r in run)  # a graph: every row
    W = len(skipped)
    order_t = dev(order)
    return cu, mamba_varlen_ops.varlen_rows(dev(slots), dev(has_init, torch.bool), dev(cu, torch.int32),
                                            dev(tok_row, torch.int32), order_t[W:], num_scan, max_len,
                                            skip_rows=order_t[:W] if W else None, triton=triton)


CASES = {
    # lengths, slots, has_init, real rows (the rest: graph padding rows on the padding slot), skipped rows
    "eager": ([1, 6, 1, 3, 17, 2], [5, 0, 3, 1, 6, 2], [True, True, False, False, True, False], 6, ()),
    "padded": ([1, 6, 3, 1, 7, 0, 0], [5, 0, 1, 3, PAD_SLOT, PAD_SLOT, PAD_SLOT], [True, True, False, True] + [False] * 3, 4, ()),
    "windows skipped": ([3, 6, 1, 2, 4], [5, 0, 3, 1, 6], [True, True, True, False, True], 5, (0, 3)),
    # rows of several scan chunks (64 tokens here) and sub-chunks (32 / 64 tokens), fresh and continuing
    "long rows": ([40, 1, 70, 140, 33, 0], [2, 5, 0, 4, 3, PAD_SLOT], [False, True, True, True, True, False], 5, ()),
    # chunks that end a token into a row, rows of exactly one chunk and of two tokens
    "chunk edges": ([65, 2, 1, 64, 129, 2], [1, 2, 3, 4, 5, 6], [True, False, True, True, False, True], 6, ()),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_ops_equal_per_row_reference(backend, case, dtype, monkeypatch):
    monkeypatch.setattr(triton_ssd_varlen, "CHUNK", 64)  # the real 128 would keep these rows to one chunk
    lengths, slots, has_init, num_real, skipped = CASES[case]
    g = _gen(3)
    T, c, k = sum(lengths), 24, 4
    h, p, grp, n = 4, 8, 2, 16
    cu, rows = _rows(lengths, slots, has_init, num_real, max(lengths), skipped, backend)
    # x as the mixer passes it: a strided slice of a wider projection
    wide = _randn(g, T, c + 5, dtype=dtype)
    x = wide[:, 2 : 2 + c]
    w, bias = _randn(g, c, k, dtype=dtype), _randn(g, c, dtype=dtype)
    conv_pool = _randn(g, PAD_SLOT + 1, c, k - 1, dtype=dtype)
    xs, B, C = _randn(g, T, h, p, dtype=dtype), _randn(g, T, grp, n, dtype=dtype), _randn(g, T, grp, n, dtype=dtype)
    dt, A, D = 0.05 + 0.3 * _rand(g, T, h), -(0.1 + _rand(g, h)), _randn(g, h)
    ssm_pool = _randn(g, PAD_SLOT + 1, h, p, n)

    ref_conv, ref_ssm = conv_pool.clone(), ssm_pool.clone()
    ref_out, ref_y = torch.empty(T, c, dtype=dtype, device=DEVICE), torch.empty(T, h, p, device=DEVICE)
    ran = [r for r in range(num_real) if r not in skipped]
    for r in ran:
        a, b, s = cu[r], cu[r + 1], slots[r]
        init_c = conv_pool[s : s + 1] if has_init[r] else torch.zeros_like(conv_pool[:1])
        out, fin = causal_conv1d(x[None, a:b], w, bias, init_c)
        ref_out[a:b], ref_conv[s] = out[0], fin[0]
        init_s = ssm_pool[s : s + 1] if has_init[r] else torch.zeros_like(ssm_pool[:1])
        y, fin = ssd_sequential(xs[None, a:b], dt[None, a:b], A, B[None, a:b], C[None, a:b], D, init_s)
        ref_y[a:b], ref_ssm[s] = y[0], fin[0]

    got_conv, got_ssm = conv_pool.clone(), ssm_pool.clone()
    out = mamba_varlen_ops.conv1d_varlen_inplace(x, w, bias, got_conv, rows)
    y = mamba_varlen_ops.ssd_varlen_inplace(xs, dt, A, B, C, D, got_ssm, rows, chunk_size=4)
    tok = [t for r in ran for t in range(cu[r], cu[r + 1])]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[tok].float(), ref_out[tok].float(), **tol)
    torch.testing.assert_close(y[tok], ref_y[tok], **tol)
    real_slots = [slots[r] for r in ran]
    torch.testing.assert_close(got_conv[real_slots].float(), ref_conv[real_slots].float(), **tol)
    torch.testing.assert_close(got_ssm[real_slots], ref_ssm[real_slots], **tol)
    untouched = [s for s in range(PAD_SLOT) if s not in real_slots]
    assert torch.equal(got_conv[untouched], conv_pool[untouched]) and torch.equal(got_ssm[untouched], ssm_pool[untouched])


def _mixed_step(num_decode: int, chunk: int, h: int, p: int, grp: int, n: int, k: int, graph: bool) -> None:
    """A mixed step: ``num_decode`` one-token rows and one ``chunk``-token prefill row, every row
    continuing its slot's state (rows in a shuffled order, the chunk first), through the packed
    conv + scan with the kernels against the ops' torch path; bf16 activations, fp32 states.
    ``graph``: the kernels' step captured in a CUDA graph replays the eager bits."""
    lengths = [1] * num_decode + [chunk]
    R, T, c = len(lengths), sum(lengths), h * p + 2 * grp * n
    g = _gen(num_decode + chunk)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    tok_row = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), torch.tensor(lengths)).to(DEVICE)
    slots = torch.randperm(R + 16, generator=g)[:R].to(DEVICE)
    has_init = torch.ones(R, dtype=torch.bool, device=DEVICE)
    order = torch.tensor([R - 1] + list(range(R - 1)), device=DEVICE)
    bf16 = torch.bfloat16
    xbc, w, bias = _randn(g, T, c, dtype=bf16), _randn(g, c, k, dtype=bf16), _randn(g, c, dtype=bf16)
    dt, dt_bias = _randn(g, T, h), _randn(g, h) - 2  # raw, as the mixer passes them
    A_log, D = (0.5 + 4 * _rand(g, h)).log(), _randn(g, h)
    prep = dict(dt_bias=dt_bias, dt_softplus=True, dt_limit=(1e-3, float("inf")), A_is_log=True)
    conv_pool, ssm_pool = _randn(g, R + 16, c, k - 1, dtype=bf16), _randn(g, R + 16, h, p, n)

    def packed(pools, triton: bool) -> torch.Tensor:
        rows = mamba_varlen_ops.varlen_rows(slots, has_init, cu, tok_row, order, 1, chunk, triton=triton)
        out = mamba_varlen_ops.conv1d_varlen_inplace(xbc, w, bias, pools[0], rows)
        xs, B, C = out.split([h * p, grp * n, grp * n], dim=-1)
        return mamba_varlen_ops.ssd_varlen_inplace(xs.unflatten(-1, (h, p)), dt, A_log, B.unflatten(-1, (grp, n)),
                                                   C.unflatten(-1, (grp, n)), D, pools[1], rows, 128, **prep)

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    ref_pools, got_pools = (conv_pool.clone(), ssm_pool.clone()), (conv_pool.clone(), ssm_pool.clone())
    ref, got = packed(ref_pools, triton=False), packed(got_pools, triton=True)
    # the conv states are the rows' last inputs (copies); outputs and SSM states differ by bf16
    # roundings of the scan's operands (~1e-2 of the norm)
    assert torch.equal(got_pools[0][slots], ref_pools[0][slots])
    assert rel_err(got, ref) < 3e-2 and rel_err(got_pools[1][slots], ref_pools[1][slots]) < 3e-2
    if graph:
        pools = (conv_pool.clone(), ssm_pool.clone())
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            captured = packed(pools, triton=True)
        cuda_graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, got)
        assert torch.equal(pools[0], got_pools[0]) and torch.equal(pools[1], got_pools[1])


def test_mixed_step_kernels_equal_the_torch_path():
    _mixed_step(3, 10, h=4, p=8, grp=2, n=16, k=4, graph=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_decode, chunk", [(127, 1024), (127, 64), (16, 2048)])
def test_mixed_step_at_real_sizes_on_gpu(num_decode, chunk):
    """NemotronH-like (128 heads of 64, d_state 128, 8 groups, conv kernel 4): decode rows beside a
    prefill chunk, eager and replayed from a CUDA graph."""
    _mixed_step(num_decode, chunk, h=128, p=64, grp=8, n=128, k=4, graph=True)


def test_triton_paths_make_the_same_step_sizes_and_decays():
    """Decode tokens through the three Triton SSM paths (a decode-only step, a mixed step beside a
    prefill chunk, verification windows of one token), given dt raw and A as A_log as the mixer
    passes them (bf16): every path makes the step size and A itself the same way (what speculative
    == plain and async == serial runs rely on). Rows starting fresh have state (x * dt) B and rows
    whose B is 0 state * exp(dt A): bit for bit the same whatever each kernel's reduction tiles, so
    those states are compared exactly (the outputs y sum over d_state: close)."""
    g = _gen(17)
    h, p, grp, n, R = 8, 8, 2, 16, 8
    lengths = [1] * R + [5]
    T, bf16 = sum(lengths), torch.bfloat16
    xs, B, C = _randn(g, T, h, p, dtype=bf16), _randn(g, T, grp, n, dtype=bf16), _randn(g, T, grp, n, dtype=bf16)
    B[R // 2 : R] = 0
    dt = (3 * _randn(g, T, h)).to(bf16)
    dt_bias = torch.tensor([0.5, 25.0, -1.0, -6.0, 0.0, 1.0, -2.0, 3.0], device=DEVICE, dtype=bf16)  # 25: softplus's identity
    A_log, D = (0.1 + 2 * _rand(g, h)).log().to(bf16), _randn(g, h, dtype=bf16)
    prep = dict(dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.01, 20.0), A_is_log=True)
    ssm_pool = _randn(g, 16, h, p, n)
    slot_list, init_list = list(range(3, 3 + R)), [False] * (R // 2) + [True] * (R // 2)
    slots, has_init = torch.tensor(slot_list, device=DEVICE), torch.tensor(init_list, device=DEVICE)

    pools = [ssm_pool.clone() for _ in range(3)]
    y_dec = mamba_ops.ssd_decode_inplace(xs[:R], dt[:R], A_log, B[:R], C[:R], D, pools[0], slots, has_init,
                                         triton=True, **prep)
    _, rows = _rows(lengths, slot_list + [15], init_list + [False], R + 1, 5, triton=True)
    y_mix = mamba_varlen_ops.ssd_varlen_inplace(xs, dt, A_log, B, C, D, pools[1], rows, 128, **prep)
    scratch = torch.zeros(16, 1, h, p, n, device=DEVICE)
    y_win = mamba_window_ops.ssd_window(xs[:R, None], dt[:R, None], A_log, B[:R, None], C[:R, None], D, pools[2],
                                        scratch, slots, has_init, triton=True, **prep)
    new = pools[0][slots]
    assert new[: R // 2].abs().gt(0).all() and not torch.equal(new[R // 2 :], ssm_pool[slots[R // 2 :]])
    assert torch.equal(pools[1][slots], new) and torch.equal(scratch[slots, 0], new)
    torch.testing.assert_close(y_mix[:R], y_dec, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y_win[:, 0], y_dec, rtol=1e-6, atol=1e-6)
