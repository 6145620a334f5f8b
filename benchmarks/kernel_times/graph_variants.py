"""What the nested graph sampling variants and their log-prob twins cost (graph_plan.py): a step
replays the smallest variant covering it, so a top-p decode step runs the NUCLEUS graph (a top-k
one runs FILTERED: its top-k stage launched, rows without top-k skipping the work), and a greedy step with log-probs runs GREEDY's
log-prob twin (argmax, log-probs with top-20), not FULL (penalties, draw, log-probs). Each path is
the engine's ``SampleLauncher.sample_with_log_probs`` captured in a CUDA graph at [rows, 151,936]
bf16 logits (the Triton sampler reads the model dtype); median of replays between CUDA events. A
column a case cannot replay prints "-", one whose tokens differ from the plain draw's ends in "!"
(the assertion is tests/unit_tests/inference/test_sampling_variants.py's).

    python -m benchmarks kernel-times graph-variants [--rows 128] [--iters 40]"""
from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import graph_replay, median_ms
from tests.helpers.sampling_variant_cases import (
    STEPS, VARIANTS, covers, exact_shape, launcher, step_rows, variant_shape,
)

V = 151_936


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--iters", type=int, default=40)


def run(args: argparse.Namespace) -> None:
    R = args.rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (0.3 * torch.randn(R, V, generator=gen, device="cuda")).to(torch.bfloat16)
    sampler = launcher("triton", R, V, "cuda")
    print(f"rows {R}, vocab {V}: ms per step, sampler (+ log-probs) in a CUDA graph")
    print(f"{'case':<22}{'exact flags':>12}" + "".join(f"{v.value + '+lp' * lp:>16}" for v, lp in VARIANTS))
    for case, (t, k, p, exact) in STEPS.items():
        g = step_rows(R, t, k, p, "cuda")
        base = sampler(logits, g, R, exact[0], exact[1], False)

        def timed(shape, width: int) -> str:
            def step():  # the engine's step: greedy + log-probs takes its tokens from the log-prob pass
                return sampler.sample_with_log_probs(logits, g, R, shape, False)[0]
            same = torch.equal(step(), base)  # a larger variant draws the same tokens
            return f"{median_ms(graph_replay(step), args.iters):.3f}{'' if same else '!'}".rjust(width)

        cells = [timed(exact_shape(exact), 12)]
        cells += [timed(variant_shape(v, lp, V), 16) if covers(v, lp, V, exact) else f"{'-':>16}" for v, lp in VARIANTS]
        print(f"{case:<22}" + "".join(cells))
