"""In-repo Triton Mamba2 kernels against the torch reference at NemotronH-like shapes on CUDA (128
heads of 64, d_state 128, 8 groups, conv kernel 4, bf16 activations, fp32 SSM states): time per
call (CUDA events after warm-up, median). Decode: batches of 1-256 rows on slot pools; "torch" is
the reference as the mixer runs it (gather the rows' states, step, scatter back), "triton" the
in-place slot kernels, also replayed from a CUDA graph (with the state bandwidth). The SSM ops get
dt raw and A as A_log, as the mixer hands them: the step-size preparation is timed with them. Mixed steps:
decode rows and a prefill chunk through the packed (varlen) conv + scan, eager and from a CUDA
graph. Errors and graph == eager for orientation: the assertions are
tests/unit_tests/kernels/test_mamba_triton.py's and test_mamba_varlen.py's.

    python -m benchmarks kernel-times mamba-kernels [--iters 10]"""
from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import median_ms
from megatron_async.kernels import mamba_ops
from megatron_async.kernels.conv1d_torch import causal_conv1d_step
from megatron_async.kernels.triton_mamba_decode import causal_conv1d_update, selective_state_update

H, P, N, G, K = 128, 64, 128, 8, 4
CONV_DIM = H * P + 2 * G * N
BF16 = torch.bfloat16
DEV = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def gathered(pool: torch.Tensor, slots: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
    states = pool.index_select(0, slots)
    return torch.where(has_init.view(-1, *([1] * (pool.dim() - 1))), states, torch.zeros_like(states))


def step_inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(dt raw [tokens, H] bf16, A_log [H], D [H], the step-size preparation) as the mixer hands them
    to the SSM ops (``Mamba2Mixer._step_prep``: bias, softplus, limits and A = -exp(A_log) done by
    the kernels, so their times include it)."""
    dt = torch.randn(tokens, H, device=DEV).to(BF16) - 2
    A_log, D = torch.log(torch.rand(H, device=DEV) * 4 + 0.5), torch.randn(H, device=DEV)
    prep = dict(dt_bias=torch.randn(H, device=DEV) * 0.1, dt_softplus=True, dt_limit=(0.0, float("inf")),
                A_is_log=True)
    return dt, A_log, D, prep


def decode_times(batch: int, iters: int) -> str:
    x, B, C = (torch.randn(batch, *s, device=DEV, dtype=BF16) for s in ((H, P), (G, N), (G, N)))
    dt, A_log, D, prep = step_inputs(batch)
    xbc, w, bias = (torch.randn(*s, device=DEV, dtype=BF16) for s in ((batch, CONV_DIM), (CONV_DIM, K), (CONV_DIM,)))
    slots = torch.randperm(batch + 16, device=DEV)[:batch]
    has_init = torch.rand(batch, device=DEV) > 0.1
    ssm_pool = torch.randn(batch + 16, H, P, N, device=DEV)
    conv_pool = torch.randn(batch + 16, CONV_DIM, K - 1, device=DEV, dtype=BF16)

    def torch_step() -> tuple[torch.Tensor, torch.Tensor]:
        out, cs = causal_conv1d_step(xbc, w, bias, gathered(conv_pool, slots, has_init))
        conv_pool.index_copy_(0, slots, cs)
        return out, mamba_ops.ssd_decode_inplace(x, dt, A_log, B, C, D, ssm_pool, slots, has_init, **prep)

    def triton_step() -> tuple[torch.Tensor, torch.Tensor]:
        out = causal_conv1d_update(xbc, w, bias, conv_pool, slots=slots, has_initial_state=has_init)
        return out, selective_state_update(x, dt, A_log, B, C, D, ssm_pool, slots=slots, has_initial_state=has_init,
                                           **prep)

    start_pools = (conv_pool.clone(), ssm_pool.clone())

    def reset() -> None:
        conv_pool.copy_(start_pools[0])
        ssm_pool.copy_(start_pools[1])

    ref = torch_step()
    ref_pools = (conv_pool[slots], ssm_pool[slots])
    reset()
    fast = triton_step()
    fast_pools = (conv_pool[slots], ssm_pool[slots])
    errs = [rel_err(f, r) for f, r in zip(fast + fast_pools, ref + ref_pools)]
    conv_err, ssm_err = max(errs[0], errs[2]), max(errs[1], errs[3])  # conv: the reference multiplies in bf16

    # CUDA graph: capture once, replay from the same starting pools: bitwise the eager result.
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = triton_step()
    reset()
    graph.replay()
    torch.cuda.synchronize()
    graph_ok = all(torch.equal(a, b) for a, b in zip(graph_out + (conv_pool[slots], ssm_pool[slots]), fast + fast_pools))

    t_torch, t_triton, t_graph = median_ms(torch_step, iters), median_ms(triton_step, iters), median_ms(graph.replay, iters)
    state_gb = 2 * batch * H * P * N * 4 / 1e9  # the state is read and written once
    return (f"decode b={batch:<4d} err conv {conv_err:.0e} ssm {ssm_err:.0e}  torch {t_torch:7.3f} ms  triton {t_triton:7.3f} ms"
            f"  graph {t_graph:7.3f} ms ({state_gb / t_graph * 1e3:6.0f} GB/s state)  graph==eager {graph_ok}")


def mixed_times(num_decode: int, chunk: int, iters: int) -> str:
    """A mixed step: ``num_decode`` decode rows + one prefill chunk through the varlen conv + scan
    of mixed steps (what a mixed CUDA graph replays). Error vs the torch reference (per row, as
    the mixer runs it without the kernels)."""
    from megatron_async.kernels import mamba_varlen_ops

    lengths = [1] * num_decode + [chunk]
    R, T = len(lengths), sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEV)
    tok_row = torch.repeat_interleave(torch.arange(R, device=DEV, dtype=torch.int32), torch.tensor(lengths, device=DEV))
    slots = torch.randperm(R + 16, device=DEV)[:R]
    has_init = torch.ones(R, dtype=torch.bool, device=DEV)
    order = torch.tensor([R - 1] + list(range(R - 1)), device=DEV)
    xbc, w, bias = (torch.randn(*sh, device=DEV, dtype=BF16) for sh in ((T, CONV_DIM), (CONV_DIM, K), (CONV_DIM,)))
    dt, A_log, D, prep = step_inputs(T)
    conv_pool = torch.randn(R + 16, CONV_DIM, K - 1, device=DEV, dtype=BF16)
    ssm_pool = torch.randn(R + 16, H, P, N, device=DEV)

    def packed(pools, triton=True):
        rows = mamba_varlen_ops.varlen_rows(slots, has_init, cu, tok_row, order, 1, chunk, triton=triton)
        out = mamba_varlen_ops.conv1d_varlen_inplace(xbc, w, bias, pools[0], rows)
        xs, B, C = out.split([H * P, G * N, G * N], dim=-1)
        return mamba_varlen_ops.ssd_varlen_inplace(xs.unflatten(-1, (H, P)), dt, A_log, B.unflatten(-1, (G, N)),
                                                   C.unflatten(-1, (G, N)), D, pools[1], rows, 128, **prep)

    pools = lambda: (conv_pool.clone(), ssm_pool.clone())  # noqa: E731
    ref_pools = pools()
    ref = packed(ref_pools, triton=False)
    got_pools = pools()
    got = packed(got_pools)
    err = max(rel_err(got, ref), rel_err(got_pools[1][slots], ref_pools[1][slots]))
    p1 = pools()
    t_packed = median_ms(lambda: packed(p1), iters)
    graph, p3 = torch.cuda.CUDAGraph(), pools()
    packed(p3)
    with torch.cuda.graph(graph):
        packed(p3)
    t_graph = median_ms(graph.replay, iters)
    return (f"mixed {num_decode:>3d} decode rows + {chunk:>4d}-token chunk: err {err:.1e} packed {t_packed:6.2f} ms "
            f"(graph {t_graph:6.2f} ms)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=10)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    print(f"heads {H}, head_dim {P}, d_state {N}, groups {G}, bf16 activations")
    for batch in (1, 8, 64, 256):
        print(decode_times(batch, args.iters))
    for num_decode, chunk in ((127, 1024), (127, 64), (16, 2048)):
        print(mixed_times(num_decode, chunk, args.iters))
