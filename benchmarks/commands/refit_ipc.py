"""update_weights_from_ipc on one GPU, colocated: a trainer process shares a model's weights under
Megatron-Core names (one flat bf16 buffer) and the engine copies them in place; the first update
(plan, mapping) and the next ones (plan cached, storage kept), the copy floor (2 x bytes / 3 TB/s),
and whether the tokens equal the same weights given in-process (tests/helpers/refit_ipc_gpu.py).

    python -m benchmarks refit-ipc [--models qwen3-0.6b qwen3-8b] [--out DIR]
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
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--out", default="refit_ipc")
    p.add_argument("--timeout", type=float, default=400.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for model in args.models:
        path = out / f"{model}.json"
        with (out / f"{model}.log").open("w") as log:
            done = subprocess.run([sys.executable, "-m", "tests.helpers.refit_ipc_gpu", "--default-model", model,
                                   "--updates", str(args.updates), "--json", str(path)], cwd=ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=args.timeout)
        if done.returncode:
            raise SystemExit(f"{model}: refit cycle failed (rc {done.returncode}): see {out / (model + '.log')}")
        reports.append(json.loads(path.read_text()))
    print("\n| model | weights | first update | later updates (median) | floor | target | change arrived; tokens equal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in reports:
        hot = sorted(r["hot_ms"])[len(r["hot_ms"]) // 2]
        floor = 2 * r["weight_bytes"] / 3e12 * 1e3
        print(f"| {r['model']} | {r['weight_bytes'] / 2**30:.2f} GiB | {r['first_ms']:.1f} ms | {hot:.1f} ms | "
              f"{floor:.1f} ms | <= {TARGET_MS.get(r['model'], float('nan')):.0f} ms | "
              f"{r['change_arrived']}; {r['tokens_equal']} |")
    for r in reports:  # where the engine's host time went (WeightReceiver.last_ipc_ms)
        for what in ("first", "hot"):
            phases = ", ".join(f"{k} {v:.2f}" for k, v in r.get(f"{what}_phases", {}).items())
            print(f"{r['model']} {what} update, ms: {phases}")
    return reports


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
