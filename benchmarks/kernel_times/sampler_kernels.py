"""The sort-free Triton sampler against the torch reference on CUDA at a 151,936-token vocabulary
(``--vocab``: another, e.g. the hybrid's 32,000):
device time per step (each sampler captured in a CUDA graph, as decode runs it; median of many
replays between CUDA events) for greedy, temperature, top-k, top-p, min-p and penalties:
reference, the Triton sampler of another checkout (``--before``, e.g. main's, side by side) and
this one; with ``--tuning``, this one's launch variants. Each threshold stage's rows are counted
by how they finished (candidate buffer or whole-row search). A token-equality count on fresh
logits comes first, for orientation: the assertions are
tests/unit_tests/kernels/test_triton_sampling_gpu.py's. Logit shapes: tests/helpers/sampler_cases.py.

    python -m benchmarks kernel-times sampler-kernels [--rows 128 256] [--iters 50] [--seeds 3] \
        [--vocab 151936] [--before ../main/megatron_async/kernels/triton_sampling.py] [--tuning]"""
from __future__ import annotations

import argparse
import importlib.util

import torch

from benchmarks.cuda_timing import graph_replay, median_ms
from tests.helpers.sampler_cases import (
    CASES, KINDS, TUNINGS, case_filters, fast, make_logits, penalty_rows, reference, row_params, step_flags,
)

VOCAB = 151_936  # Qwen3's


def load_before(path: str | None):
    """The ``triton_sampling`` module of another checkout, called with this tree's signature (the
    raw per-row tensors). Its own kernels run; what it imports from the package (the threshold
    search, the top-p candidate, the noise) resolves to this tree's: for a change inside those,
    time each tree in its own process instead."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("triton_sampling_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(logits, params, pen, any_filter):
        if pen is not None:
            logits = mod.apply_penalties(logits, pen.slot, pen.counts, pen.prompt_mask, pen.stop_mask, pen.presence,
                                         pen.frequency, pen.repetition, pen.suppress_stop)
        return mod.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
                          params.position, any_filter)
    return run


def graph_ms(fn, iters: int) -> float:
    """Median device time of one replay of ``fn`` captured in a CUDA graph."""
    replay = graph_replay(fn)
    ms = median_ms(replay, iters)
    del replay
    torch.cuda.empty_cache()  # each graph keeps a private pool; the reference's is ~1 GB at 256 rows
    return ms


def count_equal(rows: list[int], seeds: int, before, V: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = equal = equal_before = equal16 = equal_flags = 0
    finished = torch.zeros(4, dtype=torch.int64)
    for R in rows:
        for kind in KINDS:
            for case in CASES.values():
                for s in range(seeds):
                    logits = make_logits(R, V, kind, gen)
                    params = row_params(R, case, gen, mixed=s % 2 == 1)
                    pen = penalty_rows(R, V, gen) if case[4] else None
                    probe = []
                    expected = reference(logits, params, pen, True)
                    equal += int((fast(logits, params, pen, True, probe) == expected).sum())
                    equal_flags += int((fast(logits, params, pen, step_flags(params, V)) == expected).sum())
                    equal16 += int((fast(logits.to(torch.bfloat16), params, pen, True) == expected).sum())
                    for ph in probe:
                        finished += torch.bincount(ph.long().cpu(), minlength=4)
                    total += R
                    if before is not None:
                        equal_before += int((before(logits, params, pen, True) == expected).sum())
    print(f"tokens equal fast vs reference: {equal}/{total} rows (bf16 logits in: {equal16}/{total}; "
          f"the step's own filter flags: {equal_flags}/{total})"
          + (f"; before vs reference: {equal_before}/{total}" if before is not None else ""))
    print(f"threshold stages' rows: whole-row search {finished[0]}, candidate buffer {finished[1] + finished[2]}, "
          f"filter off {finished[3]}")


def timing(rows: list[int], iters: int, before, V: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\n| rows | case | logits | reference ms | before ms | fast ms, search first | fast ms | fast ms, bf16 in "
          "| fast rows: buffer / whole-row / kept draw |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---|")
    for R in rows:
        for kind in ("spread", "flat"):
            logits = make_logits(R, V, kind, gen)
            low = logits.to(torch.bfloat16)
            for name, case in CASES.items():
                params, pen = row_params(R, case, gen, False), penalty_rows(R, V, gen) if case[4] else None
                filt = case_filters(case)  # as the engine's step flags
                paths = ""
                if case[0] == 0.0:  # all greedy: the engine takes argmax (plus penalties) only
                    t_before = t_ref = t_fast = t_search = graph_ms(lambda: logits.argmax(-1), iters)
                    t_low = graph_ms(lambda: low.argmax(-1), iters)
                else:
                    t_before = float("nan") if before is None else graph_ms(lambda: before(logits, params, pen, filt), iters)
                    t_ref = graph_ms(lambda: reference(logits, params, pen, any(filt)), iters)
                    t_fast = graph_ms(lambda: fast(logits, params, pen, filt), iters)
                    t_search = graph_ms(lambda: fast(logits, params, pen, filt, candidate_first=False), iters)
                    t_low = graph_ms(lambda: fast(low, params, pen, filt), iters)
                    probe = []
                    fast(logits, params, pen, filt, probe)
                    if probe:
                        ph = torch.cat(probe).cpu()
                        paths = f"{int(((ph == 1) | (ph == 2)).sum())} / {int((ph == 0).sum())} / {int((ph == 3).sum())}"
                print(f"| {R} | {name} | {kind} | {t_ref:.3f} | {t_before:.3f} | {t_search:.3f} | {t_fast:.3f} "
                      f"| {t_low:.3f} | {paths} |")


def tuning(R: int, iters: int, V: int) -> None:
    """ms per launch variant; "!" marks one that drew other tokens than the reference."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    print(f"\nfast-path variants at {R} rows (ms; chunk, hist_block, pivots, cap, num_warps):")
    for name in ("temperature", "top_k=50", "top_p=0.95", "k+p+min_p"):
        for kind in ("spread", "flat"):
            logits = make_logits(R, V, kind, gen)
            params = row_params(R, CASES[name], gen, False)
            filt = case_filters(CASES[name])
            expected = reference(logits, params, None, any(filt))
            line = []
            for chunk, hist_block, piv, cap, warps in TUNINGS:
                tune = dict(chunk=chunk, hist_block=hist_block, pivots=piv, cap=cap, num_warps=warps)
                same = torch.equal(fast(logits, params, None, filt, **tune), expected)
                line.append(f"{graph_ms(lambda: fast(logits, params, None, filt, **tune), iters):.3f}{'' if same else '!'}")
            print(f"  {name:12s} {kind:6s}: " + "  ".join(f"{v}={t}" for v, t in zip(TUNINGS, line)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--before", default=None, help="another checkout's kernels/triton_sampling.py, timed side by side")
    parser.add_argument("--tuning", action="store_true", help="time this sampler's launch variants too")
    parser.add_argument("--vocab", type=int, default=VOCAB)


def run(args: argparse.Namespace) -> None:
    before = load_before(args.before)
    count_equal(args.rows, args.seeds, before, args.vocab)
    if args.tuning:
        tuning(args.rows[0], args.iters, args.vocab)
    timing(args.rows, args.iters, before, args.vocab)
