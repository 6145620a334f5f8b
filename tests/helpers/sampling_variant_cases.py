"""Steps of one sampling kind against every nested graph sampling variant (graph_plan.py) that
covers them, for the variant tests and ``python -m benchmarks kernel-times graph-variants``: a
step replays the smallest variant covering it, so a top-p step runs the NUCLEUS graph, a top-k
one FILTERED (its top-k stage launched, rows without top-k skipping the work), and a greedy step
with log-probs runs GREEDY's log-prob twin, not FULL. Each path is ``SampleLauncher.sample_with_log_probs`` as the
engine's step calls it."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_async.inference.contexts.sampling_state import SamplingStateSlots
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.text_generation_controllers.graph_plan import SamplingVariant, variant_flags
from megatron_async.inference.text_generation_controllers.sample_launcher import SampleLauncher

NO_FILTER = (False, False, False)
STEPS = {  # case: (temperature, top_k, top_p, exact flags (any_random, filters, log_probs))
    "greedy": (0.0, 1, 0.0, (False, NO_FILTER, False)),
    "greedy + log-probs": (0.0, 1, 0.0, (False, NO_FILTER, True)),
    "temperature 0.8": (0.8, 0, 0.0, (True, NO_FILTER, False)),
    "t 0.8 + log-probs": (0.8, 0, 0.0, (True, NO_FILTER, True)),
    "top_p 0.95": (0.8, 0, 0.95, (True, (False, True, False), False)),
    "top_p + log-probs": (0.8, 0, 0.95, (True, (False, True, False), True)),
    "top_k 50": (0.8, 50, 0.0, (True, (True, False, False), False)),
}
VARIANTS = [(v, False) for v in SamplingVariant] + [(v, True) for v in SamplingVariant if v != SamplingVariant.FULL]
"""Every captured variant: (variant, its log-prob twin)."""


def launcher(backend: str, rows: int, vocab: int, device: str) -> SampleLauncher:
    state = SamplingStateSlots(rows, vocab, DeviceFacade(torch.device(device)))
    state.ensure_allocated()
    return SampleLauncher(backend, torch.device(device), state)


def step_rows(rows: int, temperature: float, top_k: int, top_p: float, device: str) -> SimpleNamespace:
    """The step snapshot's sampling rows (every row the same), on the padding slot: no penalty."""
    dev = dict(device=device)
    return SimpleNamespace(
        temperature=torch.full((rows,), temperature, **dev), top_k=torch.full((rows,), top_k, dtype=torch.int64, **dev),
        top_p=torch.full((rows,), top_p, **dev), min_p=torch.zeros(rows, **dev),
        seed=torch.arange(rows, **dev) * 7919, sample_position=torch.full((rows,), 100, **dev),
        sampling_slot=torch.full((rows,), rows, dtype=torch.int64, **dev),
        presence_penalty=torch.zeros(rows, **dev), frequency_penalty=torch.zeros(rows, **dev),
        repetition_penalty=torch.ones(rows, **dev), suppress_stop=torch.zeros(rows, dtype=torch.bool, **dev))


def shape(any_random: bool, filters: tuple[bool, bool, bool], penalties: bool, log_probs: bool,
          top_n: int) -> SimpleNamespace:
    """The StepShape fields the sampler reads."""
    return SimpleNamespace(any_sampling=any_random, filters=filters, any_penalties=penalties, any_log_probs=log_probs,
                           max_top_n=top_n)


def exact_shape(exact: tuple) -> SimpleNamespace:
    """The step's own flags, no top-n."""
    return shape(exact[0], exact[1], False, exact[2], 0)


def variant_shape(variant: SamplingVariant, log_probs: bool, vocab: int) -> SimpleNamespace:
    f = variant_flags(variant, vocab, log_probs)
    return shape(f.any_sampling, f.filters, f.any_penalties, f.any_log_probs, f.max_top_n)


def covers(variant: SamplingVariant, log_probs: bool, vocab: int, exact: tuple) -> bool:
    """Whether the variant's graph can replay a step with these exact flags."""
    f = variant_flags(variant, vocab, log_probs)
    return ((f.any_sampling or not exact[0]) and all(a or not b for a, b in zip(f.filters, exact[1]))
            and (f.any_log_probs or not exact[2]))
