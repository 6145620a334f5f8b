"""engine.suspend / resume on CUDA: tagged bytes, bytes freed as torch.cuda.mem_get_info sees them, suspend
time, full resume time, update_weights of every weight from device tensors, and token identity with an
uninterrupted run (tests/helpers/suspend_cycle.py), in a process started with torch-memory-saver's
preload library so CUDA graph pools are released too. Needs torch-memory-saver (scripts/serve_wheels.sh
carries its wheel in .whl/).

    python -m benchmarks suspend-resume [--default-model qwen3-0.6b] [--out DIR] [--no-preload]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-model", default="qwen3-0.6b")
    p.add_argument("--out", default="suspend")
    p.add_argument("--no-preload", action="store_true", help="without LD_PRELOAD: graph pools stay resident")
    p.add_argument("--timeout", type=float, default=400.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if not args.no_preload:
        from megatron_async.inference.memory_suspend import preload_env

        env = preload_env(env)
    report = out / "suspend.json"
    with (out / "suspend.log").open("w") as log:
        done = subprocess.run([sys.executable, "-m", "tests.helpers.suspend_cycle", "--default-model",
                               args.default_model, "--json", str(report)], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode:
        raise SystemExit(f"suspend cycle failed (rc {done.returncode}): see {out / 'suspend.log'}")
    r = json.loads(report.read_text())
    print(f"\n| {args.default_model}, graphs{'' if args.no_preload else ', LD_PRELOAD'} | value | target |")
    print("|---|---:|---:|")
    print(f"| tagged bytes (weights / KV+states / graph pool) | {r['tagged_bytes'] / GiB:.2f} GiB "
          f"({r['weight_bytes'] / GiB:.2f} / {r['kv_bytes'] / GiB:.2f} / {r['graph_pool_bytes'] / GiB:.2f}) | |")
    print(f"| freed at suspend (mem_get_info) | {r['freed_bytes'] / GiB:.2f} GiB = {100 * r['freed_fraction']:.1f} % "
          "| >= 90 % |")
    print(f"| suspend (weights kept on host) | {r['suspend_s']:.3f} s | |")
    print(f"| full resume (weights from host + KV) | {r['full_resume_s']:.3f} s | <= 2 s |")
    print(f"| update_weights, all weights from device tensors | {r['update_weights_s']:.3f} s | <= 0.5 s |")
    print(f"| resume dropped weights / resume KV | {r['resume_weights_dropped_s']:.3f} s / {r['resume_kv_s']:.3f} s | |")
    print(f"| tokens == uninterrupted run; requests kept | {r['tokens_equal']}; {r['kept_requests']} | True |")
    print(f"| graph replays at the cycles; captures after warm-up | {r['graph_replays']}; "
          f"{r['graph_captures_after_warmup']} | rising; 0 |")
    return r


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
