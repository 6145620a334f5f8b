"""Hugging Face peers for the benchmark: one checkpoint shared with the engine, HF ``generate``
(static batches; dynamic cache, or static cache which HF compiles with torch.compile) and HF
continuous batching (``generate_batch``'s manager), each at settings sized like the engine and
warmed on the same twin workload as the engine."""
from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_async.cli.workload import WorkloadRequest


@dataclass(frozen=True)
class Sampling:
    """The workload's sampling: greedy, or temperature + top-p (HF draws from one seeded
    generator, so its sampled tokens cannot match the engine's per-request draws)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def generate_kwargs(self) -> dict:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


@dataclass
class PeerRun:
    outputs: list[list[int] | None]
    """Generated tokens per workload request, truncated to its own output length (None: not run)."""
    wall_time: float
    timed_out: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs if o is not None)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def does_not_fit(path: str | Path, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why HF cannot hold the checkpoint's weights on a CUDA ``device`` (None: it can)."""
    if device.type != "cuda":
        return None
    from megatron_async.models.checkpoint import resolve_dtype, safetensors_files

    stored = resolve_dtype(None, json.loads((Path(path) / "config.json").read_text())).itemsize
    weights = sum(f.stat().st_size for f in safetensors_files(path)) * dtype.itemsize // stored
    free, total = torch.cuda.mem_get_info(device)
    if weights > free:
        return (f"HF does not fit this device: its weights need {weights / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
                f"of {total / 2**30:.1f} GiB")
    return None


def load_hf_model(path: str | Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.no_grad()
def run_hf_generate(model, requests: list[WorkloadRequest], batch_size: int, sampling: Sampling,
                    deadline: float | None = None, static_cache: bool = False) -> PeerRun:
    """Static batching: requests in order, ``batch_size`` at a time, left-padded; each batch runs
    to its longest output (EOS off), and only each request's own length is counted.
    ``static_cache``: HF's static KV cache, with which ``generate`` compiles the decode forward
    (torch.compile) on CUDA; a new batch shape recompiles, so warm up on the same shapes."""
    device = next(model.parameters()).device
    extra = {"cache_implementation": "static"} if static_cache else {}
    torch.manual_seed(sampling.seed)
    outputs: list[list[int] | None] = [None] * len(requests)
    run = PeerRun(outputs, 0.0)
    t0 = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        if deadline is not None and time.perf_counter() > deadline:
            run.timed_out = True
            break
        chunk = requests[b:b + batch_size]
        width = max(len(r.prompt) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        new = max(r.output_len for r in chunk)
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, eos_token_id=None,
                             pad_token_id=0, **sampling.generate_kwargs(), **extra)
        gen = out[:, width:].tolist()
        for i, r in enumerate(chunk):
            outputs[b + i] = gen[i][: r.output_len]
    run.wall_time = time.perf_counter() - t0
    return run


def continuous_batching_available(model) -> bool:
    return hasattr(model, "generate_batch") and hasattr(model, "continuous_batching_context_manager")


def cb_config(device: torch.device, requests: list[WorkloadRequest], max_requests: int, max_tokens: int,
              memory_fraction: float):
    """Continuous batching sized like the engine: the same most requests and tokens per batch;
    on CUDA the KV pool is HF's auto sizing at the engine's share of memory, on CPU a small
    fixed pool (the auto sizing is slow there). Fields this transformers lacks are left out."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    want = {"max_batch_tokens": max_tokens, "max_requests_per_batch": max_requests}
    if device.type == "cuda":
        want["max_memory_percent"] = memory_fraction
    else:
        longest = max(len(r.prompt) + r.output_len for r in requests)
        want.update(page_size=16, num_blocks=min(len(requests), max_requests) * -(-longest // 16) + 4,
                    max_batch_tokens=max(max_tokens, longest))
    known = inspect.signature(ContinuousBatchingConfig).parameters
    return ContinuousBatchingConfig(**{k: v for k, v in want.items() if k in known})


@torch.no_grad()
def run_hf_continuous_batching(model, requests: list[WorkloadRequest], warmup: list[WorkloadRequest], sampling: Sampling,
                               cb, deadline: float | None = None) -> PeerRun:
    """HF continuous batching (the manager behind ``generate_batch``), one request each with its
    own ``max_new_tokens``, EOS off, configured by ``cb`` (see ``cb_config``). The ``warmup``
    requests run first through the same manager (its graphs and compiles), outside the timed span."""
    from transformers import GenerationConfig

    gen_config = GenerationConfig(eos_token_id=-1, pad_token_id=0, max_new_tokens=max(r.output_len for r in requests),
                                  **sampling.generate_kwargs())
    torch.manual_seed(sampling.seed)
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb,
                                                   block=True, timeout=30) as manager:
        if warmup:
            _collect(manager, warmup, None)
        return _collect(manager, requests, deadline)


def _collect(manager, requests: list[WorkloadRequest], deadline: float | None) -> PeerRun:
    outputs: list[list[int] | None] = [None] * len(requests)
    run = PeerRun(outputs, 0.0)
    t0 = time.perf_counter()
    index = {manager.add_request(r.prompt, max_new_tokens=r.output_len): i for i, r in enumerate(requests)}
    done = 0
    while done < len(requests):
        if deadline is not None and time.perf_counter() > deadline:
            run.timed_out = True
            break
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching thread stopped early")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"HF continuous batching failed a request: {result.error}")
            outputs[index[result.request_id]] = list(result.generated_tokens)
            done += 1
    run.wall_time = time.perf_counter() - t0
    return run
