"""The Mamba2 kernels of a hybrid's mixed step on the packed rows (``triton_mamba_varlen``'s conv,
``triton_ssd_varlen``'s scan) at the NemotronH shape of ``scripts/make_hybrid_checkpoint.py``
(32 heads of 64, 8 groups, d_state 128; the conv over 4,096 channels of the 6,176-wide projection),
bf16 activations, float32 states: a step of prompts of 100-1,024 tokens packed to ``--tokens``
beside ``--decode`` one-token rows (seeded). us per call in CUDA graphs (``--heads 128``: the
8B-like width). ``--sweep`` times each kernel's launch settings (the conv's must give the default's
bits; the scan's error is against the torch reference, the mixer's path without the kernels).
Orientation only: the assertions are tests/unit_tests/kernels/test_mamba_varlen.py's.

    python -m benchmarks kernel-times mamba-mixed [--tokens 8192 2048] [--decode 120] [--sweep]"""
from __future__ import annotations

import argparse
import itertools
import random

import torch

from benchmarks.cuda_timing import graph_call_us
from benchmarks.kernel_times.mamba_kernels import rel_err
from megatron_async.kernels import mamba_varlen_ops, triton_mamba_varlen, triton_ssd_varlen

P, G, N, K = 64, 8, 128, 4
DEV, BF16 = "cuda", torch.bfloat16
CONV_SWEEP = [(8, 64, 2), (8, 128, 2), (16, 64, 2), (16, 128, 4), (16, 256, 4), (32, 64, 4), (32, 128, 4),
              (32, 256, 8), (64, 128, 8)]
STATE_SWEEP = [(32, 32, 4, 2), (64, 32, 4, 1), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 4, 2),
               (128, 64, 8, 2)]
OUT_SWEEP = [(64, 64, 4, 1, 4), (64, 64, 4, 1, 2), (64, 64, 4, 2, 4), (64, 32, 4, 1, 4), (64, 64, 8, 1, 4),
             (128, 64, 8, 1, 2), (32, 64, 4, 1, 4)]


def row_lengths(tokens: int, decode: int, seed: int = 1) -> list[int]:
    rnd, lengths, left = random.Random(seed), [], tokens - decode
    while left > 0:
        lengths.append(min(rnd.randint(100, 1024), left))
        left -= lengths[-1]
    return lengths + [1] * decode


class Step:
    """One mixed step's inputs as the mixer hands them: the in_proj output [z, xBC, dt] (the conv
    reads its xBC columns, the scan its dt ones) and the conv's output split into x, B, C."""

    def __init__(self, lengths: list[int], heads: int):
        T, R = sum(lengths), len(lengths)
        conv_dim = heads * P + 2 * G * N
        self.cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
        tok_row = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), torch.tensor(lengths)).to(DEV)
        self.slots = torch.randperm(R + 8, device=DEV)[:R]
        self.has_init = torch.rand(R, device=DEV) > 0.3
        multi = [r for r, n in enumerate(lengths) if n > 1]
        order = torch.tensor(multi + [r for r, n in enumerate(lengths) if n <= 1], device=DEV)
        self.rows = {triton: mamba_varlen_ops.varlen_rows(self.slots, self.has_init, self.cu, tok_row, order,
                                                          len(multi), max(lengths), triton=triton)
                     for triton in (True, False)}
        proj = torch.randn(T, heads * P + conv_dim + heads, device=DEV, dtype=BF16)
        self.conv_x, self.dt = proj[:, heads * P:heads * P + conv_dim], proj[:, heads * P + conv_dim:]
        self.w, self.bias = (torch.randn(*shape, device=DEV, dtype=BF16) for shape in ((conv_dim, K), (conv_dim,)))
        self.conv_pool = torch.randn(R + 8, conv_dim, K - 1, device=DEV, dtype=BF16)
        xs, B, C = torch.randn(T, conv_dim, device=DEV, dtype=BF16).split([heads * P, G * N, G * N], dim=-1)
        self.x, self.B, self.C = xs.unflatten(-1, (heads, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
        self.A_log, self.D = torch.log(torch.rand(heads, device=DEV) * 4 + 0.5), torch.randn(heads, device=DEV)
        self.prep = dict(dt_bias=torch.randn(heads, device=DEV) * 0.1 - 2, dt_softplus=True,
                         dt_limit=(0.0, float("inf")), A_is_log=True)
        self.ssm_pool = torch.randn(R + 8, heads, P, N, device=DEV) * 0.1
        self.start = (self.conv_pool.clone(), self.ssm_pool.clone())

    def conv(self) -> torch.Tensor:
        return triton_mamba_varlen.causal_conv1d_varlen(self.conv_x, self.w, self.bias, self.conv_pool, self.slots,
                                                        self.has_init, self.cu)

    def scan(self, triton: bool = True) -> torch.Tensor:
        return mamba_varlen_ops.ssd_varlen_inplace(self.x, self.dt, self.A_log, self.B, self.C, self.D, self.ssm_pool,
                                                   self.rows[triton], 128, **self.prep)

    def reset(self) -> None:
        self.conv_pool.copy_(self.start[0])
        self.ssm_pool.copy_(self.start[1])


def sweep(step: Step, name: str, settings: list, apply, call, check) -> None:
    """Time ``call`` at every setting ``apply`` installs; ``check`` -> the same-bits / error column."""
    rows = []
    for setting in settings:
        apply(setting)
        try:
            step.reset()
            note = check(call())
            rows.append((graph_call_us([call], 7), setting, note))
        except Exception as e:  # a setting that does not compile or fit: listed, not timed
            rows.append((float("inf"), setting, f"failed: {type(e).__name__}"))
    for us, setting, note in sorted(rows, key=lambda r: r[0])[:12]:
        print(f"  {name} {setting}: {us:8.1f} us  {note}")


def run_shape(tokens: int, decode: int, heads: int, do_sweep: bool) -> None:
    step = Step(row_lengths(tokens, decode), heads)
    step.reset()
    conv_ref = step.conv()
    step.reset()
    scan_ref = step.scan(triton=False)
    step.reset()
    err = rel_err(step.scan(), scan_ref)
    print(f"{tokens} tokens ({decode} decode rows), {heads} heads: conv {graph_call_us([step.conv], 7):7.1f} us, "
          f"scan {graph_call_us([step.scan], 7):7.1f} us (error against the torch reference {err:.1e})", flush=True)
    if not do_sweep:
        return
    conv_tile, state_tile, out_tile, programs = (triton_mamba_varlen.CONV_TILE, triton_ssd_varlen.STATE_TILE,
                                                 triton_ssd_varlen.OUT_TILE, triton_ssd_varlen.OUT_PROGRAMS_PER_SM)
    try:
        sweep(step, "conv (tokens, channels, warps)", CONV_SWEEP,
              lambda s: setattr(triton_mamba_varlen, "CONV_TILE", s), step.conv,
              lambda out: "same bits" if torch.equal(out, conv_ref) else "DIFFERENT BITS")
        triton_mamba_varlen.CONV_TILE = conv_tile
        scan_err = lambda out: f"error {rel_err(out, scan_ref):.1e}"  # noqa: E731
        sweep(step, "scan walk (tokens, dims, warps, stages)", STATE_SWEEP,
              lambda s: setattr(triton_ssd_varlen, "STATE_TILE", s), step.scan, scan_err)
        triton_ssd_varlen.STATE_TILE = state_tile

        def out_setting(s: tuple) -> None:
            triton_ssd_varlen.OUT_TILE, triton_ssd_varlen.OUT_PROGRAMS_PER_SM = s[:4], s[4]

        sweep(step, "scan items (tokens, dims, warps, stages, programs an SM)", OUT_SWEEP, out_setting, step.scan,
              scan_err)
    finally:
        triton_mamba_varlen.CONV_TILE, triton_ssd_varlen.STATE_TILE = conv_tile, state_tile
        triton_ssd_varlen.OUT_TILE, triton_ssd_varlen.OUT_PROGRAMS_PER_SM = out_tile, programs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 2048])
    parser.add_argument("--decode", type=int, default=120, help="one-token rows beside the prompts")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--sweep", action="store_true")


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    for tokens in args.tokens:
        run_shape(tokens, min(args.decode, tokens // 2), args.heads, args.sweep)
