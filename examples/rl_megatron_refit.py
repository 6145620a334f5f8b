#!/usr/bin/env python
"""Refit from a Megatron-Core training job: trainer processes take optimizer steps on a Megatron-Core
GPTModel and send its weights, under Megatron-Core's names and TP shards, to the engine, which
generates with them; the engine's log-probs are checked against the trainer's own forward.

    python examples/rl_megatron_refit.py                       # CPU: a gloo transfer group
    python examples/rl_megatron_refit.py --transport ipc       # shared memory on CPU, CUDA IPC with --device cuda
    python examples/rl_megatron_refit.py --trainer-tp 2        # two trainer ranks, each sends its own shards
    python examples/rl_megatron_refit.py --trainer hf          # without megatron-core: the HF model, sent in
                                                               # Megatron-Core's layout (--trainer-tp shards)
Every step:
  1. the trainer sends its weights: ``megatron_tensors(model)`` -> ``build_manifest`` -> the engine's
     ``update_weights_from_distributed(manifest)`` while every trainer rank runs ``send`` (or
     ``ipc.Sharer().share`` -> ``update_weights_from_ipc``);
  2. the engine generates rollouts with the log-prob of every token (``weight_versions`` = the step);
  3. the trainer recomputes those log-probs with its forward: the largest difference is reported;
  4. one optimizer step on the rollouts (maximise their log-likelihood: a stand-in for an RL loss).
Exits 1 if a difference exceeds ``--tolerance`` or a token's weight version is not its step's.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # megatron_gpt.py beside this file

from megatron_async.models.default_model import DEFAULT_CONFIGS  # noqa: E402
from megatron_async.weight_transfer import (  # noqa: E402
    NameMap, Shard, build_manifest, free_port, init_transfer_group, ipc, megatron_from_hf, megatron_names_of,
    megatron_tensors, merge, owned, send,
)

PROMPTS = [[5, 17, 99, 3, 250], [42, 7, 7, 600], [1, 2, 3, 4, 5, 6]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=["auto", "megatron", "hf"], default="auto",
                   help="auto: Megatron-Core where it is installed, else the HF model")
    p.add_argument("--trainer-tp", type=int, default=2)
    p.add_argument("--transport", choices=["distributed", "ipc"], default="distributed")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tolerance", type=float, default=None, help="default: 2e-5 on CPU, 1e-3 on CUDA")
    args = p.parse_args(argv)
    if args.trainer == "auto":
        import importlib.util

        args.trainer = "megatron" if importlib.util.find_spec("megatron") else "hf"
    args.tolerance = args.tolerance or (2e-5 if args.device == "cpu" else 1e-3)
    if args.device != "cpu" and args.trainer == "megatron":
        args.trainer_tp = 1  # one GPU: trainer and engine share it
    return args


# ------------------------------------------------------------------------------ trainer side
class Trainer:
    """One trainer rank: the model, its optimizer, its forward and the tensors it sends."""

    def __init__(self, args, rank: int, ports: dict):
        self.args, self.rank, self.cfg = args, rank, DEFAULT_CONFIGS["tiny"]
        self.arch = self.cfg["architectures"][0]
        self.device = torch.device(args.device)
        if args.transport == "ipc" and self.device.type == "cpu":
            mp.set_sharing_strategy("file_system")  # shared memory the engine process can map by name
        if args.trainer == "megatron":
            import megatron_gpt
            from megatron.core import parallel_state

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
            dist.init_process_group("gloo", rank=rank, world_size=args.trainer_tp)
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.trainer_tp)
            self.model = megatron_gpt.build_gpt(self.cfg, seed=1, device=self.device)
            self.forward = lambda ids: megatron_gpt.logits(self.model, ids)
        else:
            import transformers

            cfg = transformers.Qwen3Config(**{k: v for k, v in self.cfg.items() if k not in ("architectures", "model_type")})
            torch.manual_seed(1)
            self.model = transformers.Qwen3ForCausalLM(cfg).to(self.device).float()
            self.forward = lambda ids: self.model(torch.tensor([ids], device=self.device)).logits[0].float()
        if args.transport == "ipc" and self.device.type == "cpu":
            for p in self.model.parameters():
                p.data.share_memory_()  # the optimizer updates them in place, in shared memory
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr)

    def items(self) -> list[tuple]:
        """(Megatron-Core name, tensor, Shard) this rank sends."""
        if self.args.trainer == "megatron":
            return megatron_tensors(self.model, architecture=self.arch)
        from megatron_async.models.gpt import build_gpt

        dims = build_gpt(self.cfg, torch.float32, "meta").megatron_dims()
        names, hf = NameMap.for_arch(self.arch), {n: p.detach() for n, p in self.model.named_parameters()}
        out = []
        for r in range(self.args.trainer_tp):  # every shard from this one process
            shard = Shard(tp_rank=r, tp_size=self.args.trainer_tp)
            mnames = megatron_names_of(names, hf, dims, shard)
            tensors = megatron_from_hf(names, dims, hf, mnames, shard)
            out += owned([(n, t, shard) for n, t in tensors.items()], self.arch)
        if self.args.transport == "ipc" and self.device.type == "cpu":
            for _, t, _ in out:
                t.share_memory_()  # fresh tensors each step: into shared memory before they are shared
        return out

    def log_probs(self, prompt: list[int], tokens: list[int], grad: bool = False) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            lp = torch.log_softmax(self.forward(prompt + tokens), -1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1, device=lp.device)
        return lp[positions, torch.tensor(tokens, device=lp.device)]

    def step(self, rollouts: list) -> None:
        self.optimizer.zero_grad()
        loss = -torch.stack([self.log_probs(p, t, grad=True).mean() for p, t, _ in rollouts]).mean()
        loss.backward()
        if self.args.trainer == "megatron" and self.args.trainer_tp > 1:
            # q / k norms are replicated but each TP rank applies them to its own heads: their full
            # gradient is the sum over ranks (Megatron-Core's finalize_model_grads does this too)
            from megatron.core import parallel_state

            for name, param in self.model.named_parameters():
                if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                    dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
        self.optimizer.step()


def trainer_main(rank: int, args, ports: dict) -> None:
    trainer = Trainer(args, rank, ports)
    store = dist.TCPStore("127.0.0.1", ports["store"], is_master=False, timeout=timedelta(seconds=300))
    senders = args.trainer_tp if args.trainer == "megatron" else 1
    group, sharer = None, ipc.Sharer()  # the sharer gives a storage's entry again while it lives (ipc.py)
    if args.transport == "distributed":
        backend = "nccl" if args.device != "cpu" and torch.cuda.device_count() > 1 else "gloo"
        group = init_transfer_group("127.0.0.1", ports["transfer"], rank, senders + 1, backend)
    for step in range(1, args.steps + 1):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()  # the optimizer's writes are done before anyone reads them
        items = trainer.items()
        if group is not None:
            store.set(f"manifest/{step}/{rank}", build_manifest(items, args.bucket_bytes, rank, version=step).to_json())
            send(group, merge([store.get(f"manifest/{step}/{r}").decode() for r in range(senders)]), items)
        else:
            store.set(f"payload/{step}/{rank}", json.dumps(sharer.share(items)))
        rollouts = json.loads(store.get(f"rollouts/{step}"))  # the engine answered: its copies are done
        diffs = [(trainer.log_probs(p, t) - torch.tensor(lp, device=trainer.device)).abs().max().item()
                 for p, t, lp in rollouts]
        if rank == 0:
            store.set(f"check/{step}", json.dumps(max(diffs)))
        trainer.step(rollouts)


# ------------------------------------------------------------------------------ engine side
def engine_main(args, ports: dict, store) -> list[tuple[int, float, bool]]:
    from megatron_async import LLM, SamplingParams

    llm = LLM(default_model="tiny", device=args.device, dtype="float32")
    senders = args.trainer_tp if args.trainer == "megatron" else 1
    if args.transport == "distributed":
        backend = "nccl" if args.device != "cpu" and torch.cuda.device_count() > 1 else "gloo"
        llm.engine.init_weight_transfer("127.0.0.1", ports["transfer"], senders, senders + 1, backend)
    params = SamplingParams(num_tokens_to_generate=args.new_tokens, temperature=1.0, seed=0, ignore_eos=True,
                            return_log_probs=True)
    report = []
    for step in range(1, args.steps + 1):
        if args.transport == "distributed":
            manifests = [store.get(f"manifest/{step}/{r}").decode() for r in range(senders)]
            version = llm.engine.update_weights_from_distributed(merge(manifests))
        else:
            payloads = [json.loads(store.get(f"payload/{step}/{r}")) for r in range(senders)]
            version = llm.engine.update_weights_from_ipc(payloads, version=step)
        outs = llm.generate(PROMPTS, params)
        store.set(f"rollouts/{step}", json.dumps([(p, o.generated_tokens, o.generated_log_probs)
                                                  for p, o in zip(PROMPTS, outs)]))
        versions_ok = version == step and all(o.weight_versions == [step] * len(o.generated_tokens) for o in outs)
        report.append((step, json.loads(store.get(f"check/{step}")), versions_ok))
    return report


def watch_trainers(procs: list, done: threading.Event) -> None:
    """A trainer that fails ends the run at once: the engine would otherwise wait for its weights
    until the store's timeout."""
    while not done.wait(0.2):
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed:
            print(f"FAILED: trainer exit codes {[p.exitcode for p in failed]}", file=sys.stderr, flush=True)
            os._exit(1)


def stop_trainers(procs: list, timeout: float) -> None:
    """Wait for the trainers to exit (terminate those still running after ``timeout``). Polls the exit
    status rather than ``join``: a trainer sharing CPU tensors starts torch_shm_manager, which inherits
    the pipe ``join`` waits on and keeps it open for a minute after the trainer is gone."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while p.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if p.is_alive():
            p.terminate()  # its exit code stays None or becomes negative: main() reports it failed
            while p.is_alive() and time.monotonic() < deadline + 5:
                time.sleep(0.02)


def main(argv=None) -> int:
    args = parse_args(argv)
    ports = {"trainer": free_port(), "transfer": free_port(), "store": free_port()}
    store = dist.TCPStore("127.0.0.1", ports["store"], is_master=True, timeout=timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=trainer_main, args=(r, args, ports), daemon=True)
             for r in range(args.trainer_tp if args.trainer == "megatron" else 1)]
    for p in procs:
        p.start()
    done = threading.Event()
    threading.Thread(target=watch_trainers, args=(procs, done), daemon=True).start()
    try:
        report = engine_main(args, ports, store)
    finally:
        done.set()
        stop_trainers(procs, timeout=60)
    print(f"trainer: {args.trainer} (TP {args.trainer_tp}), transport: {args.transport}, device: {args.device}")
    print("| step | max abs log-prob diff (engine vs trainer) | weight versions |")
    print("|---|---|---|")
    for step, diff, versions_ok in report:
        print(f"| {step} | {diff:.2e} | {'ok' if versions_ok else 'WRONG'} |")
    failed = [r for r in report if r[1] > args.tolerance or not r[2]] or [p for p in procs if p.exitcode != 0]
    if failed:
        print(f"FAILED: {failed} (tolerance {args.tolerance})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
