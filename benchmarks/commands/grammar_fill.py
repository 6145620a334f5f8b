"""The host's grammar mask fill per step: rows of the structured benchmark's schema on the Qwen3-sized
synthetic vocabulary, each step accepting one landed token a row and filling the next masks (what
GrammarMasks.fill does: accept_landed, fill_masks), by fill threads; llguidance requests copied
from one template (as they were) against one template per thread, and xgrammar. No GPU.

Every configuration advances the same rows by the same tokens (random allowed ones, never the
end), so each fills the same masks (checked). Process CPU time beside the wall time says how
many cores a fill kept busy.

    python -m benchmarks grammar-fill                       # 128 rows, 1 / 2 / 8 threads
    python -m benchmarks grammar-fill --threads 1 8 16 --rows 128 --steps 40 --repeats 3
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def configs(threads: list[int], backends: list[str]):
    """(label, backend kind, threads, one template)."""
    for kind in backends:
        for t in threads:
            if kind == "guidance":
                yield f"llguidance, one template, {t} threads", "guidance", t, True
                yield f"llguidance, template per thread, {t} threads", "guidance", t, False
            else:
                yield f"xgrammar, {t} threads", "xgrammar", t, False


def run(args) -> tuple[dict[str, list[tuple[float, float]]], dict[str, int]]:
    """Per configuration: (mean wall, mean CPU seconds a step) of each run, and its templates."""
    import torch

    from benchmarks.commands.structured import SCHEMA
    from benchmarks.synthetic_vocab import EOS_ID, synthetic_bpe
    from megatron_async.inference.structured.grammars import accept_landed, fill_masks
    from megatron_async.inference.structured.spec import StructuredOutputs
    from megatron_async.kernels.token_mask import allowed_reference

    tok, V, N = synthetic_bpe(), 151_936, args.rows
    spec = StructuredOutputs(json=SCHEMA)
    out: dict[str, list[tuple[float, float]]] = {}
    templates: dict[str, int] = {}
    for rep in range(args.repeats):
        for kind in args.backends:  # each library its own token stream: their masks may differ
            sets = {}
            for label, k, t, one in configs(args.threads, [kind]):
                if k == "guidance":
                    from megatron_async.inference.structured.guidance_backend import GuidanceBackend as cls
                else:
                    from megatron_async.inference.structured.xgrammar_backend import XGrammarBackend as cls
                b = cls(tok, [EOS_ID], V, threads=t)
                if one:
                    b.threads = 1  # every request copies family 0 (the executor keeps its t threads)
                sets[label] = [b.matcher(spec) for _ in range(N)]
                templates[label] = len({getattr(g, "family", 0) for g in sets[label]})
            bm = {k: torch.zeros(N, (V + 31) // 32, dtype=torch.int32) for k in sets}
            rng, toks, per = random.Random(rep), None, {k: [] for k in sets}
            for _ in range(args.steps):
                for label, gs in sets.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    if toks is not None:
                        assert all(accept_landed(gs, [[t] for t in toks]))
                    fill_masks(gs, list(range(N)), bm[label])
                    per[label].append((time.perf_counter() - w0, time.process_time() - c0))
                first = next(iter(bm.values()))
                assert all(torch.equal(first, b) for b in bm.values()), "the configurations' masks differ"
                allowed = allowed_reference(first, torch.arange(N, dtype=torch.int32), V)
                toks = [rng.choice([t for t in allowed[i].nonzero().flatten().tolist() if t != EOS_ID] or [EOS_ID])
                        for i in range(N)]
            for label, xs in per.items():
                out.setdefault(label, []).append((statistics.mean(w for w, _ in xs), statistics.mean(c for _, c in xs)))
    return out, templates


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--backends", nargs="+", default=["guidance", "xgrammar"], choices=["guidance", "xgrammar"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration, interleaved (median)")
    args = p.parse_args(argv)
    out, templates = run(args)
    rows = []
    print(f"\n| configuration | fill ms / step | us / row | CPU us / row |  ({args.rows} rows, {args.steps} steps, "
          f"median of {args.repeats} runs)")
    print("|---|---:|---:|---:|")
    for label, runs in out.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        rows.append({"configuration": label, "templates": templates[label], "ms": 1e3 * wall, "cpu_ms": 1e3 * cpu})
        print(f"| {label} | {1e3 * wall:.2f} | {1e6 * wall / args.rows:.1f} | {1e6 * cpu / args.rows:.1f} |")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
