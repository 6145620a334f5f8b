#!/usr/bin/env python
"""An RL loop whose trainer drives the engines through a client, from its own process.

    python examples/rl_client_loop.py                         # CPU: a coordinator and 2 tiny engines, ~1 minute
    python examples/rl_client_loop.py --engines 4 --iterations 3
    python examples/rl_client_loop.py --coordinator tcp://HOST:PORT --model CKPT   # engines already running

The engine job is other processes: a coordinator (``python -m megatron_async.coordinator``) and
``--engines`` engines that joined it (``python -m megatron_async.serve --join``), started here
unless ``--coordinator`` names a running one. This process is the trainer; it only holds a
``SyncInferenceClient``. Every iteration:
  1. rollouts: GRPO groups (``--samples`` seeded samples of each prompt, placed on one engine);
  2. once part of them finished, ``pause_engines("keep")``: every engine lands its launch in flight
     and runs nothing; ``suspend_engines()`` frees their memory (a trainer would train now),
     ``resume_engines(("weights",))`` brings the weights back;
  3. refit: the trainer writes new weights (here: the checkpoint's, perturbed) and
     ``update_weights(path=...)`` copies them into every engine in place;
     ``resume_engines(("kv_cache",))``, ``set_generation_epoch(10 * (i + 1))``: the version
     stamped on every token from now on (whatever version the update gave);
  4. ``unpause_engines()``: the rollouts still running continue (partial rollouts).
Checks (exit code 1 on a failure): each token's epoch (``RequestOutput.weight_versions``) is the
epoch set when it was generated (rollouts finished before a pause carry only the old one, those
submitted after it only the new one, the others old then new), and a greedy probe changes with
the refit.
"""
from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.client import SyncInferenceClient  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", default=None, help="a running coordinator (default: start one and the engines)")
    p.add_argument("--model", default=None, help="checkpoint the engines serve (default: the built-in tiny one, "
                                                 "written to a temp dir)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (one GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool of each engine started here, in blocks (default: the engine's; on CPU a 1 GB pool, "
                        "zeroed at start and at every resume)")
    return p.parse_args(argv)


def start_engine_job(model: str, engines: int, num_kv_blocks: int | None = None) -> tuple[list[subprocess.Popen], str]:
    """A coordinator and ``engines`` engines serving ``model`` (CPU), as a user would start them:
    (the processes, the coordinator's address)."""
    from megatron_async.dp_engine.join import spawn_coordinator

    coordinator, address = spawn_coordinator("tcp://127.0.0.1:0", "longest_prefix")
    pool = [] if num_kv_blocks is None else ["--num-kv-blocks", str(num_kv_blocks)]
    procs = [coordinator] + [subprocess.Popen(
        [sys.executable, "-m", "megatron_async.serve", "--join", address, "--engine-name", f"engine{i}", "--model", model,
         "--device", "cpu", "--prefix-caching", "--enable-suspend", "--max-requests", "16", *pool],
        stdout=subprocess.PIPE, text=True, cwd=ROOT) for i in range(engines)]
    for proc in procs[1:]:  # each prints one line once it registered
        if not proc.stdout.readline().startswith("megatron_async.serve: engine "):
            stop(procs)
            raise RuntimeError("an engine did not start")
    return procs, address


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(30)


def refit(source: str, target: Path, step: int) -> str:
    """New weights for the engines: ``source``'s tensors, a little perturbed (the trainer's step)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(step)
    for f in Path(source).iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in tensors.items()},
                      target / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, target / f.name)
    return str(target)


def epoch(iteration: int) -> int:
    """The generation epoch of the weights after ``iteration`` refits."""
    return 10 * iteration


def check_epochs(outs, before: int, after: int, finished_before: set[int], started_after: set[int]) -> list[str]:
    """Each rollout's tokens: ``before`` then ``after`` (a partial rollout), never anything else."""
    bad = []
    for o in outs:
        v = o.weight_versions
        if o.request_id in finished_before:
            ok = set(v) == {before}
        elif o.request_id in started_after:
            ok = set(v) == {after}
        else:
            ok = v == sorted(v) and set(v) <= {before, after}
        if not ok or len(v) != len(o.generated_tokens):
            bad.append(f"request {o.request_id}: versions {v}")
    return bad


def iteration(client: SyncInferenceClient, it: int, args, rng: random.Random, source: str, tmp: Path) -> list[str]:
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(8, 24))] for _ in range(args.num_prompts)]
    waiting = []
    for p in prompts:
        params = [SamplingParams(temperature=1.0, seed=rng.randrange(2**62), ignore_eos=True,
                                 num_tokens_to_generate=rng.randrange(args.max_new_tokens // 4, args.max_new_tokens + 1))
                  for _ in range(args.samples)]
        waiting += client.add_group(p, params)
    while sum(f.done() for f in waiting) < len(waiting) // 2:
        time.sleep(0.005)
    probe = SamplingParams(top_k=1, num_tokens_to_generate=8)
    client.pause_engines("keep")
    finished_before = {f.result().request_id for f in waiting if f.done()}
    before_probe = client.add_request(prompts[0], probe)  # queued while paused: it runs after the refit
    client.suspend_engines()
    client.resume_engines(("weights",))
    client.update_weights(path=refit(source, tmp / f"step{it + 1}", it + 1))
    client.resume_engines(("kv_cache",))
    client.set_generation_epoch(epoch(it + 1))
    late = client.add_request(prompts[0], probe)
    client.unpause_engines()
    outs = [f.result(300) for f in waiting]
    probe_out, late_out = before_probe.result(300), late.result(300)
    bad = check_epochs(outs + [probe_out, late_out], epoch(it), epoch(it + 1), finished_before,
                       {probe_out.request_id, late_out.request_id})
    print(f"iteration {it}: {len(outs)} rollouts ({len(finished_before)} before the pause, "
          f"{sum(len(set(o.weight_versions)) > 1 for o in outs)} across it), epochs {epoch(it)} -> {epoch(it + 1)}, "
          f"{'ok' if not bad else 'FAILED'}")
    return bad


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            import torch

            from megatron_async.models.default_checkpoint import save_default_checkpoint

            model = str(save_default_checkpoint("tiny", Path(tmp) / "step0", torch.device("cpu"), torch.float32))
        procs, address = ([], args.coordinator) if args.coordinator else start_engine_job(model, args.engines, args.num_kv_blocks)
        try:
            client = SyncInferenceClient(address)
            failures, source = [], model
            probe = [1, 2, 3, 4, 5, 6, 7, 8]
            first = client.generate([probe], SamplingParams(top_k=1, num_tokens_to_generate=8))[0]
            for it in range(args.iterations):
                failures += iteration(client, it, args, rng, source, Path(tmp))
                source = str(Path(tmp) / f"step{it + 1}")
            last = client.generate([probe], SamplingParams(top_k=1, num_tokens_to_generate=8))[0]
            if last.generated_tokens == first.generated_tokens or set(last.weight_versions) != {epoch(args.iterations)}:
                failures.append(f"the refits did not reach the engines: {first} / {last}")
            client.close()
        finally:
            stop(procs)
    for line in failures:
        print("FAILED:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
