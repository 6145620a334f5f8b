"""Sort-free Triton sampler vs the torch reference on CUDA at a 151,936-token vocabulary:
token equality on fresh bf16-valued logits, then device time per step (each sampler captured
in a CUDA graph, as decode runs it; median of many replays between CUDA events) for greedy,
temperature, top-k, top-p, min-p and penalties: reference, the Triton sampler of another
checkout (``--before``, e.g. main's, side by side) and this one; with ``--tuning``, this one's
launch variants; each threshold stage's rows are counted by how they finished (candidate
buffer or whole-row search).

    python scripts/gpu_check.py sampler-kernels [--rows 128 256] [--iters 50] [--seeds 3] \
        [--before ../main/megatron_async/kernels/triton_sampling.py] [--tuning]

Logit shapes: "spread" = N(0, 3^2) (a nucleus of thousands of tokens), "flat" = N(0, 0.3^2)
(a random-weight model: top-p 0.95 keeps most of the vocabulary), "peaked" = N(0, 2^2) with
five tokens raised by 12 (a confident trained model)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cuda_timing import graph_replay, median_ms  # noqa: E402
from megatron_async.inference.text_generation_controllers import sampling as ref  # noqa: E402
from megatron_async.kernels import triton_sampling  # noqa: E402

V = 151_936
CASES = {  # name: (temperature, top_k, top_p, min_p, penalties)
    "greedy": (0.0, 0, 0.0, 0.0, False),
    "temperature": (0.8, 0, 0.0, 0.0, False),
    "top_k=50": (0.8, 50, 0.0, 0.0, False),
    "top_p=0.95": (0.8, 0, 0.95, 0.0, False),
    "min_p=0.05": (0.8, 0, 0.0, 0.05, False),
    "k+p+min_p": (0.8, 200, 0.9, 0.02, False),
    "penalties+top_p": (0.8, 0, 0.95, 0.0, True),
}


def make_logits(R: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    scale = {"spread": 3.0, "flat": 0.3, "peaked": 2.0}[kind]
    x = scale * torch.randn(R, V, generator=gen, device="cuda")
    if kind == "peaked":
        x.scatter_add_(1, torch.randint(0, V, (R, 5), generator=gen, device="cuda"), torch.full((R, 5), 12.0, device="cuda"))
    return x.to(torch.bfloat16).float()  # bf16 logits -> float32, as the model's lm head gives


def row_params(R: int, case, gen: torch.Generator, mixed: bool) -> ref.RowParams:
    t, k, p, mp, _ = case
    dev = dict(device="cuda")
    params = ref.RowParams(torch.full((R,), t, **dev), torch.full((R,), k, dtype=torch.int64, **dev),
                           torch.full((R,), p, **dev), torch.full((R,), mp, **dev),
                           torch.randint(0, 2**62, (R,), generator=gen, **dev), torch.randint(0, 4096, (R,), generator=gen, **dev))
    if mixed:  # every row its own parameters, greedy and tiny temperatures included
        u = lambda: torch.rand(R, generator=gen, **dev)  # noqa: E731
        params.temperature.copy_(torch.where(u() < 0.1, 0.0, torch.where(u() < 0.1, 1e-4, u() * 1.5 + 0.05)))
        params.top_k.copy_(torch.where(u() < 0.5, 0, (u() * 400).long()))
        params.top_p.copy_(torch.where(u() < 0.4, 0.0, u()))
        params.min_p.copy_(torch.where(u() < 0.6, 0.0, u() * 0.2))
    return params


def penalty_rows(R: int, gen: torch.Generator) -> ref.PenaltyRows:
    dev = dict(device="cuda")
    counts = torch.zeros(R + 1, V, dtype=torch.int32, **dev)
    counts.scatter_add_(1, torch.randint(0, V, (R + 1, 512), generator=gen, **dev), torch.ones(R + 1, 512, dtype=torch.int32, **dev))
    prompt = torch.zeros(R + 1, V, dtype=torch.bool, **dev)
    prompt.scatter_(1, torch.randint(0, V, (R + 1, 1024), generator=gen, **dev), True)
    stop = torch.zeros(R + 1, V, dtype=torch.bool, **dev)
    stop[:, :3] = True
    return ref.PenaltyRows(torch.randperm(R, generator=gen, **dev), torch.full((R,), 0.5, **dev), torch.full((R,), 0.5, **dev),
                           torch.full((R,), 1.2, **dev), torch.arange(R, **dev) % 2 == 0, counts, prompt, stop)


def fast(logits, params, pen, any_filter, probe=None, **tune):
    if pen is not None:
        logits = triton_sampling.apply_penalties(logits, pen.slot, pen.counts, pen.prompt_mask, pen.stop_mask,
                                                 pen.presence, pen.frequency, pen.repetition, pen.suppress_stop)
    return triton_sampling.sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seed,
                                  params.position, any_filter, probe=probe, **tune)


def load_before(path: str | None):
    """The ``triton_sampling`` module of another checkout (its own signature: inv_t, greedy, keys)."""
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("triton_sampling_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(logits, params, pen, any_filter):
        if pen is not None:
            logits = mod.apply_penalties(logits, pen.slot, pen.counts, pen.prompt_mask, pen.stop_mask, pen.presence,
                                         pen.frequency, pen.repetition, pen.suppress_stop)
        inv_t, greedy = ref.inverse_temperature(params.temperature)
        keys = ref.row_keys(params.seed, params.position)
        return mod.sample(logits, inv_t, greedy, params.top_k, params.top_p, params.min_p, keys, any_filter)
    return run


def reference(logits, params, pen, any_filter):
    if pen is not None:
        logits = ref.apply_penalties_reference(logits, pen)
    return ref.sample_reference(logits, params, any_filter)


def graph_ms(fn, iters: int) -> float:
    """Median device time of one replay of ``fn`` captured in a CUDA graph."""
    replay = graph_replay(fn)
    ms = median_ms(replay, iters)
    del replay
    torch.cuda.empty_cache()  # each graph keeps a private pool; the reference's is ~1 GB at 256 rows
    return ms


def step_flags(params: ref.RowParams) -> tuple[bool, bool, bool]:
    """Whether some row uses top-k / top-p / min-p, as the engine's step flags say."""
    return (bool(((params.top_k > 0) & (params.top_k < V)).any()), bool(((params.top_p > 0) & (params.top_p < 1)).any()),
            bool((params.min_p > 0).any()))


def check_tokens(rows: list[int], seeds: int, before) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = equal = equal_before = equal16 = equal_flags = 0
    finished = torch.zeros(4, dtype=torch.int64)
    for R in rows:
        for kind in ("spread", "flat", "peaked"):
            for name, case in CASES.items():
                for s in range(seeds):
                    logits = make_logits(R, kind, gen)
                    params = row_params(R, case, gen, mixed=s % 2 == 1)
                    pen = penalty_rows(R, gen) if case[4] else None
                    probe = []
                    a, b = fast(logits, params, pen, True, probe), reference(logits, params, pen, True)
                    # with the step's own flags (as the engine launches it): no top-k row -> top-p draws first
                    flags = step_flags(params)
                    a_flags = fast(logits, params, pen, flags)
                    if not torch.equal(a_flags, b):
                        print(f"MISMATCH step flags {flags} rows={R} {kind} {name} seed={s}: "
                              f"{(a_flags != b).sum().item()} rows")
                    equal_flags += int((a_flags == b).sum())
                    # the engine hands the sampler the LM head's bf16 logits (exact in float32)
                    a16 = fast(logits.to(torch.bfloat16), params, pen, True)
                    if not torch.equal(a16, b):
                        print(f"MISMATCH bf16 input rows={R} {kind} {name} seed={s}: {(a16 != b).sum().item()} rows")
                    equal16 += int((a16 == b).sum())
                    for ph in probe:
                        finished += torch.bincount(ph.long().cpu(), minlength=4)
                    total += R
                    equal += int((a == b).sum())
                    if before is not None:
                        equal_before += int((before(logits, params, pen, True) == b).sum())
                    if not torch.equal(a, b):
                        print(f"MISMATCH rows={R} {kind} {name} seed={s}: {(a != b).sum().item()} rows differ")
    print(f"tokens equal fast vs reference: {equal}/{total} rows (bf16 logits in: {equal16}/{total}; "
          f"the step's own filter flags: {equal_flags}/{total})"
          + (f"; before vs reference: {equal_before}/{total}" if before is not None else ""))
    print(f"threshold stages' rows: whole-row search {finished[0]}, candidate buffer {finished[1] + finished[2]}, "
          f"filter off {finished[3]}")


def timing(rows: list[int], iters: int, before) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    print("\n| rows | case | logits | reference ms | before ms | fast ms, search first | fast ms | fast ms, bf16 in "
          "| fast rows: buffer / whole-row / kept draw |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---|")
    for R in rows:
        for kind in ("spread", "flat"):
            logits = make_logits(R, kind, gen)
            low = logits.to(torch.bfloat16)
            for name, case in CASES.items():
                params, pen = row_params(R, case, gen, False), penalty_rows(R, gen) if case[4] else None
                filt = (case[1] > 0, 0 < case[2] < 1, case[3] > 0)  # as the engine's step flags
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


VARIANTS = [  # chunk, hist_block, pivots, cap, num_warps
    (8192, 256, 16, 4096, 4), (8192, 128, 16, 4096, 4), (8192, 256, 16, 4096, 8), (4096, 128, 16, 4096, 4),
    (8192, 256, 8, 8192, 4), (16384, 512, 16, 4096, 8), (8192, 256, 16, 2048, 4),
]


def tuning(R: int, iters: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    print(f"\nfast-path variants at {R} rows (ms; chunk, hist_block, pivots, cap, num_warps):")
    for name in ("temperature", "top_k=50", "top_p=0.95", "k+p+min_p"):
        for kind in ("spread", "flat"):
            logits = make_logits(R, kind, gen)
            params = row_params(R, CASES[name], gen, False)
            case = CASES[name]
            filt = (case[1] > 0, 0 < case[2] < 1, case[3] > 0)
            expected = reference(logits, params, None, any(filt))
            line = []
            for chunk, hist_block, piv, cap, warps in VARIANTS:
                tune = dict(chunk=chunk, hist_block=hist_block, pivots=piv, cap=cap, num_warps=warps)
                assert torch.equal(fast(logits, params, None, filt, **tune), expected)
                line.append(f"{graph_ms(lambda: fast(logits, params, None, filt, **tune), iters):.3f}")
            print(f"  {name:12s} {kind:6s}: " + "  ".join(f"{v}={t}" for v, t in zip(VARIANTS, line)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--before", default=None, help="another checkout's kernels/triton_sampling.py, timed side by side")
    ap.add_argument("--tuning", action="store_true", help="time this sampler's launch variants too")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    before = load_before(args.before)
    check_tokens(args.rows, args.seeds, before)
    if args.tuning:
        tuning(args.rows[0], args.iters)
    timing(args.rows, args.iters, before)


if __name__ == "__main__":
    main()
