"""The engine's host work in update_weights_from_ipc on a CPU: a qwen3-0.6b-shape bf16 engine on
the CPU takes the weights a trainer shares in shared memory under Megatron-Core names (one flat
buffer, as ``python -m benchmarks refit-ipc`` shares it on a GPU), by phase
(``WeightReceiver.last_ipc_ms``): the first update (payload parsed, plan built, storage mapped,
sources bound) and the later ones (the same tensors shared again), without the copy itself.

Each round runs a fresh process per tree (the first update is a new engine's first) and the table
gives medians over rounds; ``--against DIR``: another checkout measured in the same rounds,
alternating. The copy (``launch``) is left out of "host": on a CPU it is the copy itself (the
first one maps the fresh shared memory's pages).

    OMP_NUM_THREADS=1 python -m benchmarks refit-shm [--rounds 3] [--updates 4] [--against DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script in each child
from benchmarks.commands.refit_plan import alternate  # noqa: E402

PHASES = ("parse", "plan", "open", "bind", "launch", "sync", "finish")


def measure(tree: str, updates: int) -> list[dict]:
    """This process's engine (the package of ``tree``): ``last_ipc_ms`` of each update."""
    sys.path.insert(0, tree)
    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")
    from megatron_async import LLM, InferenceConfig
    from megatron_async.weight_transfer import ipc
    from tests.helpers.refit_ipc_gpu import trainer_items

    cfg = InferenceConfig(num_kv_blocks=16, max_requests=2, max_sequence_length=128)
    llm = LLM(default_model="qwen3-0.6b", device="cpu", dtype="bfloat16", inference_config=cfg)
    m = llm.model
    flat, items = trainer_items(m.hf_shapes(), m.megatron_dims(), m.spec.name, "cpu")
    flat.share_memory_()  # the views again, over the shared storage
    items = [(n, flat[v.storage_offset(): v.storage_offset() + v.numel()].view(v.shape), s) for n, v, s in items]
    out = []
    for _ in range(updates):
        payload = json.loads(json.dumps(ipc.share(items)))  # as a trainer's JSON arrives
        llm.engine.update_weights_from_ipc(payload)
        out.append(dict(llm.engine.weights.last_ipc_ms))
    llm.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--against", help="another checkout, measured in the same rounds")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.updates)))
        return {}
    trees = {"this tree": str(ROOT)}
    if args.against:
        trees["--against"] = str(Path(args.against).resolve())
    runs = alternate(__file__, trees, args.rounds, ["--updates", str(args.updates)])
    print(f"\nload average {os.getloadavg()[0]:.1f}; medians over {args.rounds} rounds (a fresh engine each), ms\n")
    print("| tree | update | host (no copy) | " + " | ".join(PHASES) + " |")
    print("|---|---|---:|" + "---:|" * len(PHASES))
    for name, rounds in runs.items():
        for what, pick in (("first", lambda r: [r[0]]), ("later", lambda r: r[1:])):
            rows = [u for r in rounds for u in pick(r)]
            med = {k: statistics.median(u.get(k, float("nan")) for u in rows) for k in PHASES}
            host = statistics.median(sum(v for k, v in u.items() if k != "launch") for u in rows)
            print(f"| {name} | {what} | {host:.2f} | " + " | ".join(f"{med[k]:.2f}" for k in PHASES) + " |")
    return runs


if __name__ == "__main__":
    main()
