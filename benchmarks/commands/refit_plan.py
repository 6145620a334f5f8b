"""Host time of a first weight update's plan, from metadata on a CPU: the Megatron-Core manifest of
the qwen3-0.6b shape (trainer TP 1) and of the qwen3-8b shape (trainer TP 4) planned against an
engine model built on the meta device, by phase, as ``update_weights_from_ipc`` /
``update_weights_from_distributed`` plan an update whose metadata is new.

Phases: ``table`` the model's lookups (``TargetTable``: built at engine start, not part of an
update), ``slabs`` (``weight_slabs``: Megatron names and shards -> boxes of HF tensors),
``check`` (names, shapes, dtypes, overlaps, coverage counted), ``verify``, ``program`` (the
destination views of every copy), ``plan`` their sum; ``parse`` (an IPC payload of the manifest
validated, its cache key built: every update) and ``bind`` (the trainer's tensors and the
source views of every copy: ``ipc.views``, ``CopyProgram.bind``) are the rest of a first IPC
update's host work before its copy; ``cached`` finds the plan of a repeated update.

Each round runs a fresh process per tree (no memo kept between runs: each run starts as a new
process's first update does) and takes the median of ``--reps`` runs; the table gives the median
over rounds. ``--against DIR``: another checkout measured in the same rounds, alternating (a tree
without ``TargetTable`` plans through the same ``weight_slabs`` / ``WeightPlan`` calls).

    OMP_NUM_THREADS=1 python -m benchmarks refit-plan [--reps 7] [--rounds 3] [--against DIR] [--profile]
"""
from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = (("qwen3-0.6b", 1), ("qwen3-8b", 4))
PHASES = ("table", "slabs", "check", "verify", "program", "plan", "parse", "bind", "cached")


def payload(metas: list[tuple]) -> dict:
    """An IPC payload of ``metas`` in one storage (handles that are never opened)."""
    fake = base64.b64encode(b"\0" * 64).decode()
    tensors, offset = [], 0
    for name, shape, dtype, shard in metas:
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * shape[d + 1]
        tensors.append({"name": name, "storage": 0, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                        "stride": stride, "storage_offset": offset, "tp_rank": shard.tp_rank, "tp_size": shard.tp_size})
        offset += math.prod(shape)
    storage = {"kind": "cpu_shm", "manager": fake, "handle": fake, "nbytes": 2 * offset}
    return {"weights_format": "megatron", "storages": [storage], "tensors": tensors}


def measure(tree: str, reps: int, profile: bool) -> list[dict]:
    """This process plans with the package of ``tree``: medians (ms) of ``reps`` runs per shape."""
    sys.path.insert(0, tree)
    import torch

    from megatron_async.models import megatron_layouts, weight_update
    from megatron_async.models.default_model import DEFAULT_CONFIGS
    from megatron_async.models.gpt import build_gpt
    from megatron_async.models.slab_loading import WeightPlan
    from megatron_async.weight_transfer import ipc
    try:
        from megatron_async.models.weight_targets import TargetTable
    except ImportError:  # a tree from before the table: every plan asks the model
        TargetTable = None
    spec = importlib.util.spec_from_file_location("plan_reference", ROOT / "tests" / "helpers" / "plan_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)

    def first_update(model, metas, handles, storage) -> dict[str, float]:
        getattr(megatron_layouts, "_BOXES", {}).clear()
        t = [time.perf_counter()]
        table = TargetTable(model).warm() if TargetTable else None
        t.append(time.perf_counter())
        slabs, inputs = weight_update.weight_slabs(model, metas, "megatron")
        t.append(time.perf_counter())
        plan = WeightPlan(model, require_all=False, **({"table": table} if table else {}))
        plan.check(slabs)
        t.append(time.perf_counter())
        plan.verify()
        t.append(time.perf_counter())
        program = plan.program(slabs, inputs, len(metas))
        t.append(time.perf_counter())
        fmt, storages, tensors = ipc.parse(handles)
        hash(("ipc", fmt, tuple(ipc.storage_key(s) for s in storages),
              tuple((x["name"], x["storage"], x["dtype"], tuple(x["shape"]), tuple(x["stride"]), x["storage_offset"],
                     x.get("tp_rank"), x.get("tp_size")) for x in tensors)))
        t.append(time.perf_counter())
        program.bind(ipc.views([storage], tensors))
        t.append(time.perf_counter())
        ms = dict(zip(("table", "slabs", "check", "verify", "program", "parse", "bind"),
                      (1e3 * (b - a) for a, b in zip(t, t[1:]))))
        ms["plan"] = sum(ms[k] for k in ("slabs", "check", "verify", "program"))
        return ms

    rows = []
    for shape, tp in SHAPES:
        model = build_gpt(DEFAULT_CONFIGS[shape], torch.bfloat16, torch.device("meta"), None)
        metas = reference.trainer_metas(model, [reference.Shard(tp_rank=r, tp_size=tp) for r in range(tp)])
        handles = payload(metas)
        storage = torch.empty(handles["storages"][0]["nbytes"] // 2, dtype=torch.bfloat16, device="meta")
        runs = [first_update(model, metas, handles, storage.untyped_storage()) for _ in range(reps)]
        row = {k: statistics.median(r[k] for r in runs) for k in PHASES if k != "cached"}
        if TargetTable is None:
            row["table"] = float("nan")
        row.update(shape=shape, tp=tp, tensors=len(metas), cached=float("nan"))
        if TargetTable:  # the cache of this tree: get(model, key, metas, format)
            cache, key = weight_update.CopyPlanCache(), ("bench", tuple(metas))
            row["copies"] = sum(map(len, cache.get(model, key, metas, "megatron")[1].pairs))
            cached = []
            for _ in range(reps):
                t0 = time.perf_counter()
                cache.get(model, key, metas, "megatron")
                cached.append(1e3 * (time.perf_counter() - t0))
            row["cached"] = statistics.median(cached)
            if profile:
                import cProfile
                import pstats
                megatron_layouts._BOXES.clear()
                prof = cProfile.Profile()
                prof.runcall(weight_update.CopyPlanCache().get, model, ("profile",), metas, "megatron")
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
        rows.append(row)
    return rows


def alternate(script: str, trees: dict[str, str], rounds: int, args: list[str]) -> dict[str, list]:
    """Per round, ``script --child TREE ARGS`` in a fresh process per tree (the first tree first in
    even rounds, last in odd ones): per tree, the JSON each run printed last."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, list] = {name: [] for name in trees}
    for k in range(rounds):
        for name, tree in (trees.items() if k % 2 == 0 else reversed(trees.items())):
            out = subprocess.run([sys.executable, script, "--child", tree, *args], env=env, check=True, text=True,
                                 stdout=subprocess.PIPE, cwd=tree).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    return results


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", help="another checkout, measured in the same rounds")
    p.add_argument("--profile", action="store_true", help="cProfile one plan of each shape (to stderr)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.reps, args.profile)))
        return {}
    trees = {"this tree": str(ROOT)}
    if args.against:
        trees["--against"] = str(Path(args.against).resolve())
    results = alternate(__file__, trees, args.rounds, ["--reps", str(args.reps)] + ["--profile"] * args.profile)
    print(f"\nload average {os.getloadavg()[0]:.1f}; medians over {args.rounds} rounds of {args.reps} runs, ms\n")
    print("| tree | shape | trainer TP | tensors | " + " | ".join(PHASES) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(PHASES))
    for (shape, _), i in zip(SHAPES, range(len(SHAPES))):
        for name, rounds in results.items():
            rows = [r[i] for r in rounds]
            med = {k: statistics.median(r[k] for r in rows) for k in PHASES}
            print(f"| {name} | {shape} | {rows[0]['tp']} | {rows[0]['tensors']} | "
                  + " | ".join("-" if med[k] != med[k] else f"{med[k]:.2f}" for k in PHASES) + " |")
    return results


if __name__ == "__main__":
    main()
