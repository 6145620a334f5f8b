"""Hugging Face peers for the benchmark: one checkpoint shared with the engine, HF ``generate``
(static batches) and HF continuous batching (``generate_batch``'s manager)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_async.models.default_model import DEFAULT_CONFIGS
from megatron_async.tools.workload import WorkloadRequest


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


def save_default_checkpoint(name: str, path: str | Path, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Path:
    """Build the built-in model ``name`` as a transformers model (HF's own random init, seeded),
    ``save_pretrained`` it, and return the directory: the engine and HF then load the same weights."""
    import transformers

    _quiet_transformers()
    cfg = dict(DEFAULT_CONFIGS[name])
    arch = cfg.pop("architectures")[0]
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = [arch]
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 0.6B parameters on the host is slow
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    del model
    return Path(path)


def load_hf_model(path: str | Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.no_grad()
def run_hf_generate(model, requests: list[WorkloadRequest], batch_size: int, deadline: float | None = None) -> PeerRun:
    """Static batching: requests in order, ``batch_size`` at a time, left-padded, greedy; each batch
    runs to its longest output (EOS off), and only each request's own length is counted."""
    device = next(model.parameters()).device
    warm = torch.tensor([requests[0].prompt[:16]], device=device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, eos_token_id=None,
                   pad_token_id=0)  # CUDA context, cuBLAS handles and kernels: outside the timed span
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
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        gen = out[:, width:].tolist()
        for i, r in enumerate(chunk):
            outputs[b + i] = gen[i][: r.output_len]
    run.wall_time = time.perf_counter() - t0
    return run


def continuous_batching_available(model) -> bool:
    return hasattr(model, "generate_batch") and hasattr(model, "continuous_batching_context_manager")


def _cb_config(device: torch.device, requests: list[WorkloadRequest]):
    """None (HF's auto sizing from free GPU memory) on CUDA; a small fixed pool on CPU, where
    the auto sizing is slow and meaningless."""
    if device.type == "cuda":
        return None
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    longest = max(len(r.prompt) + r.output_len for r in requests)
    page = 16
    return ContinuousBatchingConfig(page_size=page, num_blocks=len(requests) * -(-longest // page) + 4,
                                    max_batch_tokens=max(256, longest), max_requests_per_batch=len(requests))


@torch.no_grad()
def run_hf_continuous_batching(model, requests: list[WorkloadRequest], deadline: float | None = None) -> PeerRun:
    """HF continuous batching (the manager behind ``generate_batch``), one request each with its
    own ``max_new_tokens``, greedy, EOS off. Warm-up (graph capture) is outside the timed span."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=max(r.output_len for r in requests))
    outputs: list[list[int] | None] = [None] * len(requests)
    run = PeerRun(outputs, 0.0)
    with model.continuous_batching_context_manager(generation_config=gen_config,
                                                   continuous_batching_config=_cb_config(device, requests),
                                                   block=True, timeout=30) as manager:
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
