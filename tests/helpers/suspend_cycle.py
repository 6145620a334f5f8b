"""One RL-style suspend cycle on a built-in model on CUDA, measured (the GPU test and
``python -m benchmarks suspend-resume`` run it in a process started with torch-memory-saver's preload
library, so graph pools are released too):

1. an uninterrupted greedy run of the prompts (the reference tokens);
2. the same prompts again, paused ("keep") mid-decode, suspend(("weights", "kv_cache")) with the
   weights kept on host, resume both (the full resume time);
3. paused again later, suspend with the weights dropped, resume(("weights",)), update_weights
   with every weight from device tensors (the same values: the model's seeded weights),
   resume(("kv_cache",));
4. the run ends: tokens must equal the reference, graphs replayed after each resume and none was
   captured again.

    python -m tests.helpers.suspend_cycle --default-model qwen3-0.6b [--json PATH]
    torchrun --nproc-per-node 2 -m tests.helpers.suspend_cycle --tensor-parallel-size 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

BOTH = ("weights", "kv_cache")


@dataclass
class SuspendCycle:
    model: str
    weight_bytes: int = 0
    kv_bytes: int = 0
    graph_pool_bytes: int = 0
    freed_bytes: int = 0
    """Device memory that came free at suspend, as ``torch.cuda.mem_get_info`` sees it."""
    suspend_s: float = 0.0
    full_resume_s: float = 0.0
    """resume(("weights", "kv_cache")) with the weights kept on host."""
    update_weights_s: float = 0.0
    """update_weights of every weight from device tensors (after resume(("weights",)) of dropped weights)."""
    resume_weights_dropped_s: float = 0.0
    resume_kv_s: float = 0.0
    graph_replays: list[int] = field(default_factory=list)
    """EngineStats.graph_replays at the first suspend, after the first cycle, at the end."""
    graph_captures_after_warmup: int = 0
    tokens_equal: bool = False
    kept_requests: int = 0
    """Requests holding KV at the first suspend."""

    @property
    def tagged_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.graph_pool_bytes

    @property
    def freed_fraction(self) -> float:
        return self.freed_bytes / self.tagged_bytes if self.tagged_bytes else 0.0


def graph_pool_bytes(llm) -> int:
    graphs = llm.runner.graphs
    if graphs is None or graphs._pool is None:
        return 0
    pool = tuple(graphs._pool)
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool)


def _free() -> int:
    if not torch.cuda.is_available():  # a CPU smoke run: no device memory to read
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def _pause(eng, outs: dict, steps: int, leader: bool) -> None:
    """Every rank steps alike; rank 0 pauses, each rank lands its in-flight launch once paused."""
    for _ in range(steps):
        outs.update((o.request_id, o) for o in eng.step().finished)
    if leader:
        eng.pause_generation("keep")
    while not eng.is_paused:
        outs.update((o.request_id, o) for o in eng.step().finished)
    outs.update((o.request_id, o) for o in eng.step().finished)  # the in-flight launch lands


def run_cycle(default_model: str = "qwen3-0.6b", num_requests: int = 32, prompt_len: int = 128,
              output_len: int = 64, dtype: str = "bfloat16", device: str = "cuda", tensor_parallel_size: int = 1,
              expert_parallel_size: int = 1, **config) -> SuspendCycle:
    """Under torchrun (TP / EP) every rank runs it: rank 0 adds, pauses and resumes generation,
    every rank suspends and resumes its own memory; the report is this rank's (``tokens_equal``:
    rank 0's view, which holds every request's outputs)."""
    from megatron_async import LLM, InferenceConfig, SamplingParams
    from megatron_async.models.default_model import DEFAULT_CONFIGS, random_hf_weights

    llm = LLM(None, device=device, dtype=dtype, default_model=default_model,
              inference_config=InferenceConfig(enable_suspend=True, cuda_graphs=device == "cuda", **config),
              tensor_parallel_size=tensor_parallel_size, expert_parallel_size=expert_parallel_size)
    eng, st = llm.engine, llm.engine.stats
    leader = llm.parallel.global_rank == 0
    gen = torch.Generator().manual_seed(0)
    vocab = llm.model.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_requests)]
    params = SamplingParams(top_k=1, num_tokens_to_generate=output_len, ignore_eos=True)
    reference = [o.generated_tokens for o in llm.generate(prompts, params)]

    rep = SuspendCycle(default_model, eng.memory.tagged_bytes("weights"), eng.memory.tagged_bytes("kv_cache"),
                       graph_pool_bytes(llm))
    rids = [eng.add_request(p, params) for p in prompts] if leader else []
    outs: dict = {}
    _pause(eng, outs, 4, leader)
    rep.kept_requests = sum(bool(r.block_ids) for r in eng.context.active.values())
    rep.graph_replays.append(st.graph_replays)
    before = _free()
    rep.suspend_s = _timed(lambda: eng.suspend(BOTH))
    rep.freed_bytes = _free() - before
    rep.full_resume_s = _timed(lambda: eng.resume(BOTH))
    if leader:
        eng.resume_generation()

    _pause(eng, outs, output_len // 3, leader)
    rep.graph_replays.append(st.graph_replays)
    eng.suspend(BOTH, keep_weights_on_host=False)
    rep.resume_weights_dropped_s = _timed(lambda: eng.resume(("weights",)))
    std = DEFAULT_CONFIGS[default_model]["initializer_range"]
    weights = list(random_hf_weights(llm.model, std, 0))  # the trainer's device tensors: the same values
    rep.update_weights_s = _timed(lambda: llm.update_weights(weights))
    del weights
    rep.resume_kv_s = _timed(lambda: eng.resume(("kv_cache",)))
    if leader:
        eng.resume_generation()
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step().finished)
    rep.graph_replays.append(st.graph_replays)
    rep.graph_captures_after_warmup = st.graph_captures_after_warmup
    rep.tokens_equal = [outs[r].generated_tokens for r in rids] == reference if leader else True
    llm.close()
    return rep


def main(argv: list[str] | None = None) -> SuspendCycle:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the logic (no memory numbers)")
    p.add_argument("--buffer-size-gb", type=float, default=None, help="KV pool (default: what memory planning gives)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="under torchrun")
    p.add_argument("--expert-parallel-size", type=int, default=1, help="under torchrun")
    p.add_argument("--json", default=None, help="also write the report here (rank 0's)")
    args = p.parse_args(argv)
    config = {} if args.buffer_size_gb is None else {"buffer_size_gb": args.buffer_size_gb}
    rep = run_cycle(args.default_model, args.num_requests, args.prompt_len, args.output_len, args.dtype, args.device,
                    args.tensor_parallel_size, args.expert_parallel_size, **config)
    body = {**asdict(rep), "tagged_bytes": rep.tagged_bytes, "freed_fraction": rep.freed_fraction}
    rank = int(os.environ.get("RANK", 0))
    print(json.dumps({"rank": rank, **body}))
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(body, f, indent=1)
    return rep


if __name__ == "__main__":
    main(sys.argv[1:])
