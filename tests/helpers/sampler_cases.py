"""Sampler problems at a given vocabulary for the Triton sampler's GPU tests and timings
(``python -m benchmarks kernel-times sampler-kernels``): logit shapes, per-row parameters
(uniform per case, or every row its own), penalty rows, and both samplers behind one signature.

Logit kinds: "spread" = N(0, 3^2) (a nucleus of thousands of tokens at Qwen3's vocabulary),
"flat" = N(0, 0.3^2) (a random-weight model: top-p 0.95 keeps most of the vocabulary), "peaked"
= N(0, 2^2) with five tokens raised by 12 (a confident trained model); all rounded to bf16
values, as the LM head gives them."""
from __future__ import annotations

import torch

from megatron_async.inference.text_generation_controllers import sampling as ref
from megatron_async.kernels import triton_sampling

CASES = {  # name: (temperature, top_k, top_p, min_p, penalties)
    "greedy": (0.0, 0, 0.0, 0.0, False),
    "temperature": (0.8, 0, 0.0, 0.0, False),
    "top_k=50": (0.8, 50, 0.0, 0.0, False),
    "top_p=0.95": (0.8, 0, 0.95, 0.0, False),
    "min_p=0.05": (0.8, 0, 0.0, 0.05, False),
    "k+p+min_p": (0.8, 200, 0.9, 0.02, False),
    "penalties+top_p": (0.8, 0, 0.95, 0.0, True),
}
KINDS = ("spread", "flat", "peaked")
TUNINGS = [  # the fast path's launch variants: chunk, hist_block, pivots, cap, num_warps
    (2048, 256, 16, 4096, 4), (8192, 256, 16, 4096, 4), (8192, 128, 16, 4096, 4), (8192, 256, 16, 4096, 8), (4096, 128, 16, 4096, 4),
    (8192, 256, 8, 8192, 4), (16384, 512, 16, 4096, 8), (8192, 256, 16, 2048, 4),
]


def make_logits(R: int, V: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    dev = gen.device
    x = {"spread": 3.0, "flat": 0.3, "peaked": 2.0}[kind] * torch.randn(R, V, generator=gen, device=dev)
    if kind == "peaked":
        x.scatter_add_(1, torch.randint(0, V, (R, 5), generator=gen, device=dev), torch.full((R, 5), 12.0, device=dev))
    return x.to(torch.bfloat16).float()  # bf16 logits -> float32, as the model's lm head gives


def row_params(R: int, case: tuple, gen: torch.Generator, mixed: bool) -> ref.RowParams:
    """The case's parameters on every row; ``mixed``: every row its own (greedy and tiny
    temperatures included)."""
    t, k, p, mp, _ = case
    dev = dict(device=gen.device)
    params = ref.RowParams(torch.full((R,), t, **dev), torch.full((R,), k, dtype=torch.int64, **dev),
                           torch.full((R,), p, **dev), torch.full((R,), mp, **dev),
                           torch.randint(0, 2**62, (R,), generator=gen, **dev),
                           torch.randint(0, 4096, (R,), generator=gen, **dev))
    if mixed:
        u = lambda: torch.rand(R, generator=gen, **dev)  # noqa: E731
        params.temperature.copy_(torch.where(u() < 0.1, 0.0, torch.where(u() < 0.1, 1e-4, u() * 1.5 + 0.05)))
        params.top_k.copy_(torch.where(u() < 0.5, 0, (u() * 400).long()))
        params.top_p.copy_(torch.where(u() < 0.4, 0.0, u()))
        params.min_p.copy_(torch.where(u() < 0.6, 0.0, u() * 0.2))
    return params


def penalty_rows(R: int, V: int, gen: torch.Generator) -> ref.PenaltyRows:
    """Presence / frequency / repetition penalties over up to 512 generated and 1,024 prompt ids
    per row (rows in a shuffled slot order), stop ids suppressed on every other row."""
    dev = dict(device=gen.device)
    counts = torch.zeros(R + 1, V, dtype=torch.int32, **dev)
    counts.scatter_add_(1, torch.randint(0, V, (R + 1, 512), generator=gen, **dev),
                        torch.ones(R + 1, 512, dtype=torch.int32, **dev))
    prompt = torch.zeros(R + 1, V, dtype=torch.bool, **dev)
    prompt.scatter_(1, torch.randint(0, V, (R + 1, 1024), generator=gen, **dev), True)
    stop = torch.zeros(R + 1, V, dtype=torch.bool, **dev)
    stop[:, :3] = True
    return ref.PenaltyRows(torch.randperm(R, generator=gen, **dev), torch.full((R,), 0.5, **dev),
                           torch.full((R,), 0.5, **dev), torch.full((R,), 1.2, **dev), torch.arange(R, **dev) % 2 == 0,
                           counts, prompt, stop)


def fast(logits, params: ref.RowParams, pen: ref.PenaltyRows | None, filters, probe=None, **launch) -> torch.Tensor:
    """The Triton sampler (penalty kernel first when ``pen``); ``launch``: its launch settings."""
    if pen is not None:
        logits = triton_sampling.apply_penalties(logits, pen.slot, pen.counts, pen.prompt_mask, pen.stop_mask,
                                                 pen.presence, pen.frequency, pen.repetition, pen.suppress_stop)
    return triton_sampling.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
                                  params.position, filters, probe=probe, **launch)


def reference(logits, params: ref.RowParams, pen: ref.PenaltyRows | None, any_filter: bool) -> torch.Tensor:
    if pen is not None:
        logits = ref.apply_penalties_reference(logits, pen)
    return ref.sample_reference(logits, params, any_filter)


def step_flags(params: ref.RowParams, V: int) -> tuple[bool, bool, bool]:
    """Whether some row uses top-k / top-p / min-p, as the engine's step flags say."""
    return (bool(((params.top_k > 0) & (params.top_k < V)).any()), bool(((params.top_p > 0) & (params.top_p < 1)).any()),
            bool((params.min_p > 0).any()))


def case_filters(case: tuple) -> tuple[bool, bool, bool]:
    """The step flags of a case's uniform rows."""
    return case[1] > 0, 0 < case[2] < 1, case[3] > 0


def near_tie_case(R: int, V: int, gen: torch.Generator):
    """Rows whose two leading tokens a < b score within a few float32 ulps of each other (or
    equal) exactly, from the draw's own exact noise: logits 10 - g_a and 10 - g_b + d, every
    other token -40. The approximate noise alone would order such pairs at random; the exact
    scores decide. -> (logits [R, V] float32, params at temperature 1, expected tokens [R])."""
    from megatron_async.kernels.triton_gumbel import exact_noise

    dev = gen.device
    params = row_params(R, CASES["temperature"], gen, mixed=False)
    params.temperature.fill_(1.0)  # s = logits exactly
    logits = torch.full((R, V), -40.0, device=dev)
    ulp = 2.0 ** -20  # float32's spacing at 10
    noise = torch.stack([exact_noise(int(params.seed[r]), int(params.position[r]), V, dev) for r in range(R)])
    for r in range(R):
        a, b = sorted(torch.randperm(V, generator=gen, device=dev)[:2].tolist())
        d = (r % 9 - 4) * ulp  # -4 .. 4 ulps, 0 included (ties: the first index wins)
        logits[r, a] = 10.0 - noise[r, a]
        logits[r, b] = 10.0 - noise[r, b] + d
    return logits, params, (logits + noise).argmax(-1)
