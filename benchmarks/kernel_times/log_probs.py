"""Log-probs of a step's logits at Qwen3's vocabulary (bf16, CUDA): us per call in a CUDA graph of
the Triton kernels (kernels/triton_log_probs.py) and of the torch reference (a float32 copy,
logsumexp, int64 sort keys + topk), default and batch-invariant, with the sampler's own passes for
scale; ``--sweep`` also times the kernel's launch settings (chunk / warps) at the largest row
count. The assertions are tests/unit_tests/kernels/test_triton_log_probs.py's.

    python -m benchmarks kernel-times log-probs [--rows 1 64 128] [--sweep]"""
from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import graph_call_us
from megatron_async.inference.text_generation_controllers.sampling import log_probs_of
from megatron_async.kernels import triton_log_probs, triton_sampling

VOCAB = 151936
DT = torch.bfloat16
TOP_N = (0, 5, 20)


def _inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (3 * torch.randn(rows, VOCAB, device="cuda", generator=g)).to(DT)  # bf16: many ties
    x[:, 100:110] = x.max()  # a tie at the top: the lowest ids first
    x[0, ::2] = float("-inf")
    tokens = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    return x, tokens


def _sampler_passes(rows: int, sets) -> dict:
    """The sampler's passes, for scale: a GREEDY graph argmaxes (its log-prob twin does not:
    the log-prob pass gives the tokens); a NUCLEUS graph (or its twin) draws with top-p; a
    FULL graph (penalties with log-probs) applies penalties (rows without any read the shared
    padding slot) and runs the filtered draw, here with every filter off per row."""
    ones = torch.ones(rows, device="cuda")
    zero, t08, p095 = 0 * ones, 0.8 * ones, 0.95 * ones
    zeros_i = torch.zeros(rows, dtype=torch.int64, device="cuda")
    ids = torch.arange(rows, device="cuda")
    slot = torch.full((rows,), rows, dtype=torch.int64, device="cuda")
    counts = torch.zeros(rows + 1, VOCAB, dtype=torch.int32, device="cuda")
    masks = torch.zeros(rows + 1, VOCAB, dtype=torch.bool, device="cuda")
    no_flag = torch.zeros(rows, dtype=torch.bool, device="cuda")

    def full(x, temperature):
        pen = triton_sampling.apply_penalties(x, slot, counts, masks, masks, zero, zero, ones, no_flag)
        return triton_sampling.sample(pen, temperature, zeros_i, zero, zero, ids, ids, True)

    return {"argmax (GREEDY graph)": [lambda s=s: triton_sampling.argmax(s[0]) for s in sets],
            "top-p 0.95 draw (NUCLEUS graph)": [
                lambda s=s: triton_sampling.sample(s[0], t08, zeros_i, p095, zero, ids, ids, (False, True, False))
                for s in sets],
            "penalties + filtered draw, greedy rows (FULL graph)": [lambda s=s: full(s[0], zero) for s in sets],
            "penalties + filtered draw, t 0.8 (FULL graph)": [lambda s=s: full(s[0], t08) for s in sets]}


def times(rows: int) -> None:
    sets = [_inputs(rows, seed=rows + i) for i in range(4)]
    base = _sampler_passes(rows, sets)
    print(f"\n| [{rows}, {VOCAB}] bf16 | reference us | Triton us | reference / Triton |\n|---|---:|---:|---:|")
    for n in TOP_N:
        for inv in (False, True):
            old = graph_call_us([lambda s=s, n=n, inv=inv: log_probs_of(s[0], s[1], n, inv) for s in sets], 4)
            new = graph_call_us([lambda s=s, n=n, inv=inv: log_probs_of(s[0], s[1], n, inv, triton=True)
                                for s in sets], 8)
            label = f"log-probs top-{n}" + (" batch-invariant" if inv else "")
            print(f"| {label} | {old:.1f} | {new:.1f} | {old / new:.1f}x |")
    for name, fns in base.items():
        print(f"| sampler: {name} | | {graph_call_us(fns, 4):.1f} | |")


def sweep(rows: int) -> None:
    """The kernels always compute the top 20 (MAX_TOP_N): one time per launch setting."""
    sets = [_inputs(rows, seed=rows + i) for i in range(4)]
    print(f"\n| log-probs launch [{rows}, {VOCAB}]: chunk / warps | us | same top ids as the default |\n|---|---:|---|")
    ref = triton_log_probs.log_probs(*sets[0], 20)
    for chunk in (2048, 4096, 8192):
        for warps in (4, 8, 16):
            kw = dict(chunk=chunk, num_warps=warps)
            same = torch.equal(triton_log_probs.log_probs(*sets[0], 20, **kw)[2], ref[2])
            us = graph_call_us([lambda s=s: triton_log_probs.log_probs(*s, 20, **kw) for s in sets], 8)
            print(f"| {chunk} / {warps} | {us:.1f} | {same} |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128])
    parser.add_argument("--sweep", action="store_true")


def run(args: argparse.Namespace) -> None:
    for r in args.rows:
        times(r)
    if args.sweep:
        sweep(max(args.rows))
