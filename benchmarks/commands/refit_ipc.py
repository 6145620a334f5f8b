"""update_weights_from_ipc on one GPU, colocated: a trainer process shares a model's weights under
Megatron-Core names, in one flat bf16 buffer and in a storage per tensor (``--layouts``), and the
engine copies them in place; the first update (plan, mapping) and the next ones (plan cached,
storages kept) by layout, against one device copy of the same bytes (measured) and the copy floor
(2 x bytes / 3 TB/s), and whether the tokens equal the same weights given in-process
(tests/helpers/refit_ipc_gpu.py). ``REFIT_PROFILE=DIR``: each first update runs under cProfile
(``DIR/<model>-<layout>-first.pstats`` and ``.txt``, the top 40 by cumulative time); its ms is
then marked as not comparable.

    python -m benchmarks refit-ipc [--models qwen3-0.6b qwen3-8b] [--layouts flat separate] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET_MS = {"qwen3-0.6b": 20.0, "qwen3-8b": 100.0}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    p.add_argument("--layouts", nargs="+", choices=["flat", "separate"], default=["flat", "separate"])
    p.add_argument("--updates", type=int, default=7)
    p.add_argument("--repeats", type=int, default=5, help="updates shared afresh, and with foreach lists")
    p.add_argument("--out", default="refit_ipc")
    p.add_argument("--timeout", type=float, default=400.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for model in args.models:
        for layout in args.layouts:
            name = f"{model}-{layout}"
            path = out / f"{name}.json"
            with (out / f"{name}.log").open("w") as log:
                done = subprocess.run([sys.executable, "-m", "tests.helpers.refit_ipc_gpu", "--default-model", model,
                                       "--layout", layout, "--updates", str(args.updates), "--repeats", str(args.repeats),
                                       "--json", str(path)],
                                      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
            if done.returncode:
                raise SystemExit(f"{name}: refit cycle failed (rc {done.returncode}): see {out / (name + '.log')}")
            reports.append(json.loads(path.read_text()))
    print("\n| model | layout | weights | first | later (Sharer, default kernel) | later, shared afresh | later, foreach "
          "| one copy | later / one copy | target | change, moved, stale refused; tokens equal |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in reports:
        print(f"| {r['model']} | {r['layout']} | {r['weight_bytes'] / 2**30:.2f} GiB | {r['first_ms']:.1f} ms | "
              f"{_median(r['hot_ms']):.2f} ms | {_median(r['fresh_ms']):.2f} ms | {_median(r['foreach_ms']):.2f} ms | "
              f"{r['copy_ms']:.2f} ms | {_median(r['hot_ms']) / r['copy_ms']:.2f}x | first <= {TARGET_MS.get(r['model'], 20.0):.0f} ms, "
              f"later <= 2.5x | {r['change_arrived']}, {r['moved_arrived']}, {r['stale_refused']}; "
              f"{r['tokens_equal'] and r['moved_tokens_equal']} |")
    for r in reports:  # where the engine's host time went (WeightReceiver.last_ipc_ms), and the launches
        print(f"{r['model']} {r['layout']}: kernels taken {r['kernels']}, lists per update {r['launches']}; {r['tensors']} tensors in "
              f"{r['entries']} storage entries, {r['mapped']} mapped")
        for what, phases in r["phases"].items():
            note = " (under cProfile: not comparable)" if what == "first" and r.get("profiled") else ""
            print(f"{r['model']} {r['layout']} {what} update{note}, ms: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    return reports


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
