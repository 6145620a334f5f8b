"""In-repo Triton Mamba2 kernels vs the torch reference ops (interpreter on CPU, compiled on
CUDA): decode conv / state updates on slot pools, the decode ops on both paths, backend
selection, and the mixer run end to end on both backends."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from megatron_async.config import MambaBackend  # noqa: E402
from megatron_async.forward_batch import MambaMetadata  # noqa: E402
from megatron_async.kernels import backends, mamba_ops  # noqa: E402
from megatron_async.kernels.conv1d_torch import causal_conv1d_step  # noqa: E402
from megatron_async.kernels.ssd_torch import ssd_step  # noqa: E402
from megatron_async.kernels.triton_mamba_decode import causal_conv1d_update, selective_state_update  # noqa: E402
from megatron_async.models.hybrid_config import MambaConfig  # noqa: E402
from megatron_async.models.layers.mamba2_mixer import Mamba2Mixer, MambaStepPlan  # noqa: E402
from megatron_async.parallel.state import ParallelState  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(rtol=1e-4, atol=1e-4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=g).to(DEVICE)


def _gathered(pool: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    """What a row starts from: its slot's state, or zeros."""
    zero = torch.zeros((), dtype=pool.dtype, device=pool.device)
    return torch.where(has_init.view(-1, *([1] * (pool.dim() - 1))), pool[slots], zero)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(autouse=True)
def exact_cudnn_conv():
    """On CUDA the reference conv1d may round to tf32 in cuDNN; the fp32 tolerances need exact."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


# Rows read slots 4, 0, 2 of a 6-slot pool; row 1 has no initial state, its slot holds junk.
SLOTS = [4, 0, 2]
HAS_INIT = [True, False, True]


@pytest.mark.parametrize("k, with_bias, dtype", [(4, True, torch.float32), (2, False, torch.float32), (4, True, torch.bfloat16)])
def test_conv_update_in_place_on_slots(k, with_bias, dtype):
    g = _gen(k)
    c = 12
    x, w = _randn(g, 3, c, dtype=dtype), _randn(g, c, k, dtype=dtype)
    bias = _randn(g, c, dtype=dtype) if with_bias else None
    pool = _randn(g, 6, c, k - 1, dtype=dtype)
    slots, has_init = torch.tensor(SLOTS, device=DEVICE), torch.tensor(HAS_INIT, device=DEVICE)
    ref_out, ref_state = causal_conv1d_step(x, w, bias, _gathered(pool, slots, has_init))

    new_pool = pool.clone()
    out = causal_conv1d_update(x, w, bias, new_pool, slots=slots, has_initial_state=has_init)
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    assert torch.equal(new_pool[slots], ref_state)  # a shift plus x: exact
    untouched = [s for s in range(6) if s not in SLOTS]
    assert torch.equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dt_options", [False, True])
def test_state_update_in_place_on_slots(groups, dt_options):
    g = _gen(10 * groups + dt_options)
    h, p, n = 4, 5, 6
    x = _randn(g, 3, h, p)
    dt = _randn(g, 3, h) if dt_options else 0.05 + _rand(g, 3, h)
    A, D, dt_bias = -(0.1 + _rand(g, h)), _randn(g, h), _randn(g, h)
    B, C = _randn(g, 3, groups, n), _randn(g, 3, groups, n)
    pool = _randn(g, 6, h, p, n)
    slots, has_init = torch.tensor(SLOTS, device=DEVICE), torch.tensor(HAS_INIT, device=DEVICE)
    opts = dict(dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.2, 0.9)) if dt_options else {}
    dt_final = F.softplus(dt + dt_bias).clamp(0.2, 0.9) if dt_options else dt
    ref_y, ref_state = ssd_step(x, dt_final, A, B, C, _gathered(pool, slots, has_init), D)

    new_pool = pool.clone()
    y = selective_state_update(x, dt, A, B, C, D, new_pool, slots=slots, has_initial_state=has_init, **opts)
    torch.testing.assert_close(y, ref_y, **TOL)
    torch.testing.assert_close(new_pool[slots], ref_state, **TOL)
    untouched = [s for s in range(6) if s not in SLOTS]
    assert torch.equal(new_pool[untouched], pool[untouched])


def test_state_update_strided_inputs_without_D():
    """x / B / C as the mixer passes them: views into one [b, conv_dim] activation."""
    g = _gen(3)
    h, p, grp, n = 4, 3, 2, 5
    xbc = _randn(g, 2, h * p + 2 * grp * n)
    x, B, C = xbc.split([h * p, grp * n, grp * n], dim=-1)
    x, B, C = x.unflatten(-1, (h, p)), B.unflatten(-1, (grp, n)), C.unflatten(-1, (grp, n))
    dt, A, state = 0.1 + _rand(g, 2, h), -_rand(g, h), _randn(g, 2, h, p, n)
    ref_y, ref_state = ssd_step(x, dt, A, B, C, state)
    new_state = state.clone()  # rows are their slots (no slot table): updated in place
    y = selective_state_update(x, dt, A, B, C, None, new_state)
    torch.testing.assert_close(y, ref_y, **TOL)
    torch.testing.assert_close(new_state, ref_state, **TOL)


@pytest.mark.parametrize("backend", [MambaBackend.TORCH, MambaBackend.TRITON])
def test_inplace_decode_ops_agree_across_backends(backend):
    g = _gen(9)
    h, p, grp, n, c, k = 4, 3, 2, 5, 8, 4
    x, dt, dt_bias = _randn(g, 3, h, p), _randn(g, 3, h), _randn(g, h)
    A, D, B, C = -_rand(g, h), _randn(g, h), _randn(g, 3, grp, n), _randn(g, 3, grp, n)
    cx, w, bias = _randn(g, 3, c), _randn(g, c, k), _randn(g, c)
    ssm_pool, conv_pool = _randn(g, 6, h, p, n), _randn(g, 6, c, k - 1)
    slots, has_init = torch.tensor(SLOTS, device=DEVICE), torch.tensor(HAS_INIT, device=DEVICE)
    ref_conv_out, ref_conv = causal_conv1d_step(cx, w, bias, _gathered(conv_pool, slots, has_init))
    dt_final = F.softplus(dt + dt_bias).clamp(0.0, 0.5)
    ref_y, ref_ssm = ssd_step(x, dt_final, A, B, C, _gathered(ssm_pool, slots, has_init), D)
    triton = backend == MambaBackend.TRITON
    conv_out = mamba_ops.conv1d_decode_inplace(cx, w, bias, conv_pool, slots, has_init, triton=triton)
    y = mamba_ops.ssd_decode_inplace(
        x, dt, A, B, C, D, ssm_pool, slots, has_init, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, 0.5),
        triton=triton,
    )
    torch.testing.assert_close(conv_out, ref_conv_out, **TOL)
    torch.testing.assert_close(conv_pool[slots], ref_conv, **TOL)
    torch.testing.assert_close(y, ref_y, **TOL)
    torch.testing.assert_close(ssm_pool[slots], ref_ssm, **TOL)


def test_backend_selection(monkeypatch):
    resolve = backends.resolve_mamba_backend
    assert resolve(MambaBackend.AUTO, "cpu") == MambaBackend.TORCH
    assert resolve("torch", "cpu") == MambaBackend.TORCH
    with pytest.raises(ValueError, match="MAMBA_SSM"):
        resolve(MambaBackend.MAMBA_SSM, "cpu")
    # where the mamba_ssm packages import, AUTO still takes the Triton kernels; MAMBA_SSM only on request
    monkeypatch.setattr(backends, "_mamba_ssm_importable", lambda: True)
    monkeypatch.setattr(backends, "_triton_mamba_usable", lambda on_cuda: True)
    assert resolve(MambaBackend.AUTO, "cuda") == MambaBackend.TRITON
    assert resolve(MambaBackend.MAMBA_SSM, "cuda") == MambaBackend.MAMBA_SSM


def _mixer(seed: int, parallel: ParallelState = ParallelState()) -> Mamba2Mixer:
    cfg = MambaConfig(num_heads=4, head_dim=4, d_state=8, n_groups=2, conv_kernel=4, chunk_size=8,
                      dt_limit=(0.0, float("inf")), use_conv_bias=True, proj_bias=False, norm_eps=1e-5,
                      norm_before_gate=False)
    mixer = Mamba2Mixer(16, cfg, 0, parallel, torch.float32, DEVICE)
    mixer.out_proj.parallel = ParallelState()  # a TP rank's partial output, before the all-reduce
    g = _gen(seed)
    for param in mixer.parameters():
        param.data.copy_(0.3 * torch.randn(param.shape, generator=g))
    mixer.A_log.data.copy_(torch.rand(mixer.num_heads, generator=g).log())
    return mixer


@pytest.mark.parametrize("tp_rank", [None, 1])
def test_mixer_mixed_step_same_on_both_backends(tp_rank):
    """A step with decode rows, a fresh one-token row and ragged prefill chunks (continuing and
    fresh) gives the same output and pool states on TRITON as on TORCH; also with a tensor-
    parallel rank's local shapes (2 of 4 heads, 1 of 2 groups)."""
    parallel = ParallelState() if tp_rank is None else ParallelState(tp_rank=tp_rank, tp_size=2)
    mixer, g = _mixer(11, parallel), _gen(12)
    lengths, has_init, slots = [1, 6, 1, 3, 9], [True, True, False, False, True], [5, 0, 3, 1, 6]
    meta = MambaMetadata.for_rows(lengths, slots, has_init, DEVICE)
    x = _randn(g, sum(lengths), 16)
    conv_shape, ssm_shape = mixer.state_shapes()  # this rank's channels and heads
    pools = (_randn(g, 8, *conv_shape), _randn(g, 8, *ssm_shape))
    results = []
    for triton in (False, True):
        conv_pool, ssm_pool = (t.clone() for t in pools)
        out = mixer.mix(x, conv_pool, ssm_pool, MambaStepPlan.build(meta, triton))
        results.append((out, conv_pool, ssm_pool))
    for ref, fast in zip(*results):
        torch.testing.assert_close(fast, ref, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_realistic_sizes_on_gpu(rows):
    """NemotronH-like: 128 heads of 64, d_state 128, 8 groups, bf16 activations, fp32 states;
    decode batches of 1-256 rows on slot pools. Both in-place updates captured in one CUDA graph
    and replayed from the same starting pools give the eager call's bits."""
    g = _gen(13 + rows)
    h, p, grp, n, k = 128, 64, 8, 128, 4
    c = h * p + 2 * grp * n
    bf16 = torch.bfloat16
    x, B, C = _randn(g, rows, h, p, dtype=bf16), _randn(g, rows, grp, n, dtype=bf16), _randn(g, rows, grp, n, dtype=bf16)
    dt, dt_bias, A_log, D = _randn(g, rows, h), _randn(g, h), (0.5 + 4 * _rand(g, h)).log(), _randn(g, h)
    pool = _randn(g, rows + 8, h, p, n)
    slots = torch.randperm(rows + 8, generator=g)[:rows].to(DEVICE)
    has_init = _rand(g, rows) > 0.2
    cx, w, bias = _randn(g, rows, c, dtype=bf16), _randn(g, c, k, dtype=bf16), _randn(g, c, dtype=bf16)
    cpool = _randn(g, rows + 8, c, k - 1, dtype=bf16)
    start = (pool.clone(), cpool.clone())

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        y = selective_state_update(x, dt, A_log, B, C, D, pool, slots=slots, has_initial_state=has_init,
                                   dt_bias=dt_bias, dt_softplus=True, dt_limit=(1e-3, float("inf")), A_is_log=True)
        return y, causal_conv1d_update(cx, w, bias, cpool, slots=slots, has_initial_state=has_init)

    dt_final = F.softplus(dt + dt_bias).clamp(1e-3, float("inf"))
    ref_y, ref_state = ssd_step(x, dt_final, -A_log.exp(), B, C, _gathered(pool, slots, has_init), D)
    ref_out, ref_cstate = causal_conv1d_step(cx, w, bias, _gathered(cpool, slots, has_init))
    y, out = step()
    assert _rel_err(y, ref_y) < 1e-5 and _rel_err(pool[slots], ref_state) < 1e-5
    assert _rel_err(out, ref_out) < 1e-2 and torch.equal(cpool[slots], ref_cstate)

    eager = (y, out, pool[slots], cpool[slots])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    pool.copy_(start[0]), cpool.copy_(start[1])
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((*captured, pool[slots], cpool[slots]), eager))
