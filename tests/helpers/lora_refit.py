"""Rank functions of the LoRA refit test: a trainer process sends new weights of an adapter (as a
Megatron-Core trainer's TP shards over a gloo transfer group, then PEFT-named through IPC handles:
shared memory on the CPU, CUDA IPC on a GPU) to an engine process that serves a request of that
adapter meanwhile; and the in-process reference that updates the adapter with ``update_lora`` at
the same step."""
from __future__ import annotations

import json
from datetime import timedelta

import torch

from megatron_async.config import InferenceConfig
from megatron_async.dp_engine.engine_ops import Deferred, run_admin_op
from megatron_async.inference.request import SamplingParams
from megatron_async.llm import LLM
from megatron_async.weight_transfer import Shard, build_manifest, init_transfer_group, ipc, send
from tests.helpers.lora_adapters import megatron_shards, peft_named, random_modules

PROMPT = [5, 17, 99, 3, 42, 7]
NEW, STEPS_BEFORE = 10, 4
BUCKET = 4 << 10  # several buckets, the larger B tensors in row pieces


def greedy() -> SamplingParams:
    return SamplingParams(num_tokens_to_generate=NEW, temperature=0.0, ignore_eos=True, return_log_probs=True,
                          lora="a")


def engine(device: str = "cpu") -> LLM:
    llm = LLM(default_model="tiny", device=device, seed=0, inference_config=InferenceConfig(
        num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8))
    llm.load_lora("a", peft_named(random_modules(llm, False, seed=1)))
    return llm


def versions(llm) -> tuple[dict, dict]:
    """The adapter's second weights as the trainer's TP=2 shards, its third PEFT-named."""
    return random_modules(llm, False, seed=2), random_modules(llm, False, seed=3)


def manifest_of(llm):
    second, _ = versions(llm)
    items = [(n, t, Shard(r, 2)) for r, shard in enumerate(megatron_shards(llm, second, False, 2))
             for n, t in shard.items()]
    return build_manifest(items, BUCKET, weights_format="megatron"), items


def _output(out) -> tuple:
    return out.generated_tokens, out.generated_log_probs, out.weight_versions


def serve_through(llm, update) -> tuple:
    """One request of the adapter: ``STEPS_BEFORE`` steps, ``update()`` (between two steps), the rest."""
    rid = llm.engine.add_request(PROMPT, greedy())
    done = []
    for _ in range(STEPS_BEFORE):
        done += llm.engine.step().finished
    assert not done, "the request ended before the update"
    result = update()
    outs = {o.request_id: o for o in llm.engine.run_until_done()}
    return result, _output(outs[rid])


def reference(device: str = "cpu") -> tuple:
    llm = engine(device)
    second, third = versions(llm)
    _, during = serve_through(llm, lambda: llm.update_lora("a", peft_named(second)))
    llm.update_lora("a", peft_named(third))
    return during, [_output(o) for o in llm.generate([PROMPT], greedy())]


def refit_rank(rank: int, world: int, port: int, store_port: int, device: str = "cpu"):
    store = torch.distributed.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=timedelta(seconds=60))
    llm = engine(device)
    manifest, items = manifest_of(llm)
    if rank == 0:  # the trainer
        group = init_transfer_group("127.0.0.1", port, 0, world, "gloo", timeout_s=60)
        send(group, manifest, items)
        torch.multiprocessing.set_sharing_strategy("file_system")
        third = {n: t.to(device) for n, t in peft_named(versions(llm)[1])[1].items()}
        for t in third.values():
            if device == "cpu":
                t.share_memory_()
        store.set("payload", json.dumps(ipc.share(list(third.items()), weights_format="hf")))
        store.wait(["copied"])
        return "sent"
    joined = llm.engine.init_weight_transfer("127.0.0.1", port, 1, world, backend="gloo")  # (one GPU: no NCCL pair)
    before = llm.engine.weight_version

    def update():
        outcome = run_admin_op(llm.engine, None, "update_lora_from_distributed",
                               {"lora_name": "a", "metadata": manifest.to_json()})
        assert isinstance(outcome, Deferred)  # the wait for the senders ran off this thread
        return outcome.settle()

    (status, body), during = serve_through(llm, update)
    payload = store.get("payload").decode()
    refused = run_admin_op(llm.engine, None, "update_lora_from_ipc", {"lora_name": "zzz", "handles": payload})
    ipc_status, ipc_body = run_admin_op(llm.engine, None, "update_lora_from_ipc", {"lora_name": "a", "handles": payload})
    store.set("copied", "1")
    after = [_output(o) for o in llm.generate([PROMPT], greedy())]
    return joined, before, (status, body), during, (ipc_status, ipc_body), after, refused
