"""What the nested graph sampling variants and their log-prob twins cost (graph_plan.py): a
step replays the smallest variant covering it, so a top-p step runs the FILTERED graph (top-k
and min-p passes launched, every row skipping their work) and a greedy step with log-probs runs
GREEDY's log-prob twin (argmax, log-probs with top-20), not FULL (penalties, draw, log-probs).
Each path is the engine's ``SampleLauncher.sample_with_log_probs`` captured in a CUDA graph at
[rows, 151,936] bf16 logits (the Triton sampler reads the model dtype); median of replays
between CUDA events. A column a case cannot replay prints "-".

    python scripts/gpu_check.py graph-variants [--rows 128] [--iters 40]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cuda_timing import graph_replay, median_ms  # noqa: E402
from megatron_async.inference.contexts.sampling_state import SamplingStateSlots  # noqa: E402
from megatron_async.inference.device import DeviceFacade  # noqa: E402
from megatron_async.inference.text_generation_controllers.graph_plan import (  # noqa: E402
    SamplingVariant, variant_flags,
)
from megatron_async.inference.text_generation_controllers.sample_launcher import SampleLauncher  # noqa: E402

V = 151_936
NO_FILTER = (False, False, False)
ROWS = {  # case: (temperature, top_k, top_p, exact flags (any_random, filters, log_probs))
    "greedy": (0.0, 1, 0.0, (False, NO_FILTER, False)),
    "greedy + log-probs": (0.0, 1, 0.0, (False, NO_FILTER, True)),
    "temperature 0.8": (0.8, 0, 0.0, (True, NO_FILTER, False)),
    "t 0.8 + log-probs": (0.8, 0, 0.0, (True, NO_FILTER, True)),
    "top_p 0.95": (0.8, 0, 0.95, (True, (False, True, False), False)),
    "top_p + log-probs": (0.8, 0, 0.95, (True, (False, True, False), True)),
    "top_k 50": (0.8, 50, 0.0, (True, (True, False, False), False)),
}
COLUMNS = [(v, False) for v in SamplingVariant] + [(v, True) for v in SamplingVariant if v != SamplingVariant.FULL]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    R, dev = args.rows, torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (0.3 * torch.randn(R, V, generator=gen, device="cuda")).to(torch.bfloat16)
    state = SamplingStateSlots(R, V, DeviceFacade(dev))
    state.ensure_allocated()
    sampler = SampleLauncher("triton", dev, state)
    print(f"rows {R}, vocab {V}: ms per step, sampler (+ log-probs) in a CUDA graph")
    print(f"{'case':<22}{'exact flags':>12}" + "".join(f"{v.value + '+lp' * lp:>16}" for v, lp in COLUMNS))
    for case, (t, k, p, exact) in ROWS.items():
        g = SimpleNamespace(
            temperature=torch.full((R,), t, device=dev), top_k=torch.full((R,), k, dtype=torch.int64, device=dev),
            top_p=torch.full((R,), p, device=dev), min_p=torch.zeros(R, device=dev),
            seed=torch.arange(R, device=dev) * 7919, sample_position=torch.full((R,), 100, device=dev),
            sampling_slot=torch.full((R,), R, dtype=torch.int64, device=dev),  # the padding slot: no penalty
            presence_penalty=torch.zeros(R, device=dev), frequency_penalty=torch.zeros(R, device=dev),
            repetition_penalty=torch.ones(R, device=dev), suppress_stop=torch.zeros(R, dtype=torch.bool, device=dev))

        base = sampler(logits, g, R, *exact[:2], False)

        def timed(any_random, filters, pen, lp, top_n):
            shape = SimpleNamespace(any_sampling=any_random, filters=filters, any_penalties=pen, any_log_probs=lp,
                                    max_top_n=top_n)

            def step():  # the engine's step: greedy + log-probs takes its tokens from the log-prob pass
                return sampler.sample_with_log_probs(logits, g, R, shape, False)[0]
            assert torch.equal(step(), base), case  # a larger variant draws the same tokens
            return median_ms(graph_replay(step), args.iters)

        cells = [f"{timed(*exact[:2], False, exact[2], 0):12.3f}"]
        for v, lp in COLUMNS:
            f = variant_flags(v, V, lp)
            covers = ((f.any_sampling or not exact[0]) and all(a or not b for a, b in zip(f.filters, exact[1]))
                      and (f.any_log_probs or not exact[2]))
            cells.append(f"{timed(f.any_sampling, f.filters, f.any_penalties, f.any_log_probs, f.max_top_n):16.3f}"
                         if covers else f"{'-':>16}")
        print(f"{case:<22}" + "".join(cells))


if __name__ == "__main__":
    main()
