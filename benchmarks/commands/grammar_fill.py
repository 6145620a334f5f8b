"""The host's grammar mask fill per step: rows of the structured benchmark's schema on the Qwen3-sized
synthetic vocabulary, each step accepting one landed token a row and filling the next masks (what
GrammarMasks.fill does: accept_landed, fill_masks), by fill threads. llguidance: requests copied
from one template; from one template per thread with the rows given to the executor as dealt
(round robin over the templates) and grouped by template; from the engine's templates per thread,
grouped (guidance_backend.py); and xgrammar. No GPU.

Every configuration advances the same rows by the same tokens (random allowed ones, never the
end), so each fills the same masks (checked). Process CPU time beside the wall time says how
many cores a fill kept busy. A first run, not recorded, warms the templates (each template's
lexer builds its states as its copies first meet them; a serving engine's templates are warm).
``--seconds`` bounds a run: the steps stop (every configuration
at the same step) once the budget is spent or a document is complete, and the table says how
many ran.

    python -m benchmarks grammar-fill                       # 128 rows, 1 / 2 / 8 threads, ~35 s
    python -m benchmarks grammar-fill --threads 1 4 8 16 --backends guidance --seconds 90
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def configs(threads: list[int], backends: list[str], beside_ms: float):
    """(label, backend kind, threads, templates a spec keeps (None: the engine's), rows as dealt
    (else grouped by template), switch interval of a fill on a worker beside ``beside_ms`` of
    engine-thread Python, or None: the fill alone)."""
    from megatron_async.inference.engines.grammar_masks import FILL_SWITCH_INTERVAL_S
    from megatron_async.inference.structured.guidance_backend import TEMPLATES_PER_THREAD

    for kind in backends:
        for t in threads:
            if kind == "guidance":
                name = f"llguidance, {TEMPLATES_PER_THREAD} templates per thread, {t} threads"
                yield f"llguidance, one template, {t} threads", kind, t, 1, False, None
                yield f"llguidance, one template per thread, rows as dealt, {t} threads", kind, t, t, True, None
                yield f"llguidance, one template per thread, {t} threads", kind, t, t, False, None
            else:
                name = f"xgrammar, {t} threads"
            yield name, kind, t, None, False, None
            if beside_ms > 0:
                for interval in (0.005, FILL_SWITCH_INTERVAL_S):
                    yield f"{name}, beside {beside_ms:g} ms of Python, switch interval {1e3 * interval:g} ms", kind, t, \
                        None, False, interval


def beside(work_s: float, interval: float, pool, fill) -> tuple[float, float]:
    """``fill`` on ``pool``'s thread while this thread runs ``work_s`` of Python (the engine
    thread scheduling the next launch), the GIL switch interval ``interval``: (step seconds, the
    seconds this thread then waited for the fill)."""
    from benchmarks.commands.gil_switch import busy

    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        t0 = time.perf_counter()
        job = pool.submit(fill)
        busy(work_s)
        t1 = time.perf_counter()
        job.result()
        t2 = time.perf_counter()
    finally:
        sys.setswitchinterval(old)
    return t2 - t0, t2 - t1


@contextlib.contextmanager
def rows_as_dealt(on: bool):
    """The executor given the rows in the order they come (the engine groups them by template)."""
    from megatron_async.inference.structured import guidance_backend

    grouped = guidance_backend._grouped
    if on:
        guidance_backend._grouped = lambda gs: list(range(len(gs)))
    try:
        yield
    finally:
        guidance_backend._grouped = grouped


def backend(kind: str, tok, eos: int, vocab: int):
    if kind == "guidance":
        from megatron_async.inference.structured.guidance_backend import GuidanceBackend as cls
    else:
        from megatron_async.inference.structured.xgrammar_backend import XGrammarBackend as cls
    return cls(tok, [eos], vocab, threads=1)


def with_threads(base, threads: int):
    """A backend as ``base`` built with ``threads`` fill threads, sharing its tokenizer (and
    xgrammar's compiled grammars): its own executor, and its own templates (llguidance)."""
    import copy
    import threading

    b = copy.copy(base)
    if b.name == "guidance":
        import llguidance

        from megatron_async.inference.structured.guidance_backend import TEMPLATES_PER_THREAD

        b.executor, b.families = llguidance.LLExecutor(num_threads=threads), threads * TEMPLATES_PER_THREAD
        b._templates, b._texts, b._lock = type(base._templates)(), type(base._texts)(), threading.Lock()
    else:
        import xgrammar as xgr

        b.batch = xgr.BatchGrammarMatcher(max_threads=threads)
    return b


def next_tokens(bitmask, eos: int, vocab: int, rng) -> list[int] | None:
    """A random allowed token a row, never ``eos``; None once a row allows nothing else (its
    document is complete). Reads only a row's nonzero words (most rows allow one token)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    toks = []
    for row in bitmask:
        words = row.nonzero().flatten()
        bits = ((row[words].unsqueeze(-1) >> shifts) & 1).nonzero()
        ids = [t for t in (words[bits[:, 0]] * 32 + bits[:, 1]).tolist() if t != eos and t < vocab]
        if not ids:
            return None
        toks.append(rng.choice(ids))
    return toks


def run(args) -> tuple[dict[str, list[tuple[float, float]]], dict[str, int], list[int]]:
    """Per configuration: (mean wall, mean CPU seconds a step) of each run, its templates, and
    the steps each run measured."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from benchmarks.commands.structured import SCHEMA
    from benchmarks.synthetic_vocab import EOS_ID, synthetic_bpe
    from megatron_async.inference.structured.grammars import accept_landed, fill_masks
    from megatron_async.inference.structured.spec import StructuredOutputs

    tok, V, N = synthetic_bpe(), 151_936, args.rows
    spec = StructuredOutputs(json=SCHEMA)
    out: dict[str, list[tuple[float, float]]] = {}
    templates: dict[str, int] = {}
    steps_run, pool, backends = [], ThreadPoolExecutor(1), {}
    for rep in range(args.repeats + 1):  # run 0 warms the templates' lexers (as a serving engine's are), unrecorded
        for kind in args.backends:  # each library its own token stream: their masks may differ
            sets, dealt, interval = {}, {}, {}
            for label, k, t, families, as_dealt, beside_interval in configs(args.threads, [kind], args.beside_ms):
                if label not in backends:
                    if k not in backends:  # the library's tokenizer, built once (~1 s each at this vocabulary)
                        backends[k] = backend(k, tok, EOS_ID, V)
                    backends[label] = b = with_threads(backends[k], t)
                    if families is not None:
                        b.families = families  # the executor keeps its t threads
                sets[label], dealt[label] = [backends[label].matcher(spec) for _ in range(N)], as_dealt
                interval[label] = beside_interval
                templates[label] = len({getattr(g, "family", 0) for g in sets[label]})
            bm = {k: torch.zeros(N, (V + 31) // 32, dtype=torch.int32) for k in sets}
            rng, toks, per = random.Random(rep), None, {k: [] for k in sets}
            stop = time.perf_counter() + args.seconds / ((args.repeats + 1) * len(args.backends))  # this run's share
            for step in range(args.steps):
                if step and time.perf_counter() > stop:
                    break
                for label, gs in sets.items():
                    def fill(gs=gs, label=label):
                        if toks is not None:
                            assert all(accept_landed(gs, [[t] for t in toks]))
                        fill_masks(gs, list(range(N)), bm[label])

                    with rows_as_dealt(dealt[label]):
                        if interval[label] is not None:
                            per[label].append(beside(args.beside_ms / 1e3, interval[label], pool, fill))
                            continue
                        w0, c0 = time.perf_counter(), time.process_time()
                        fill()
                        per[label].append((time.perf_counter() - w0, time.process_time() - c0))
                first = next(iter(bm.values()))
                assert all(torch.equal(first, b) for b in bm.values()), "the configurations' masks differ"
                toks = next_tokens(first, EOS_ID, V, rng)
                if toks is None:
                    break
            if rep == 0:
                continue
            steps_run.append(len(next(iter(per.values()))))
            for label, xs in per.items():
                out.setdefault(label, []).append((statistics.mean(w for w, _ in xs), statistics.mean(c for _, c in xs)))
    pool.shutdown()
    return out, templates, steps_run


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--backends", nargs="+", default=["guidance", "xgrammar"], choices=["guidance", "xgrammar"])
    p.add_argument("--steps", type=int, default=40, help="at most this many steps a run")
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration, interleaved (median)")
    p.add_argument("--beside-ms", type=float, default=2.0, help="engine-thread Python a fill on the worker runs beside "
                   "(the engine's configurations, both switch intervals; 0: none)")
    p.add_argument("--seconds", type=float, default=30.0,
                   help="time budget of the steps, all runs together (building the grammars comes on top)")
    args = p.parse_args(argv)
    out, templates, steps_run = run(args)
    rows = []
    print(f"\n| configuration | fill ms / step | us / row | CPU us / row |  ({args.rows} rows, {min(steps_run)}-"
          f"{max(steps_run)} steps a run, median of {args.repeats} runs; beside: step ms, the engine thread's wait "
          f"after its own Python in the next column)")
    print("|---|---:|---:|---:|")
    for label, runs in out.items():
        a, b = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        if "beside" in label:
            rows.append({"configuration": label, "templates": templates[label], "ms": 1e3 * a, "wait_ms": 1e3 * b})
            print(f"| {label} | {1e3 * a:.2f} | waited {1e3 * b:.2f} ms | |")
            continue
        rows.append({"configuration": label, "templates": templates[label], "ms": 1e3 * a, "cpu_ms": 1e3 * b})
        print(f"| {label} | {1e3 * a:.2f} | {1e6 * a / args.rows:.1f} | {1e6 * b / args.rows:.1f} |")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
