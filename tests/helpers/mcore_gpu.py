"""Megatron-Core on CUDA against the engine on the same GPU (test_megatron_reference_gpu.py): a
GPTModel built as a training job builds it (one process, an NCCL world of one,
``initialize_model_parallel(1, 1)``, ``model_parallel_cuda_manual_seed``, initialised on the GPU, bf16
in ``Float16Module``; examples/megatron_gpt.py), its weights given to an engine on the same GPU in
the trainer's own process (``update_weights``, colocated) or from another process
(``update_weights_from_ipc``), and the comparison of ``mcore_reference``, the CPU tests' too. With
``device="cpu"`` the same flows run on CPU (gloo, shared-memory IPC; test_megatron_reference.py)."""
from __future__ import annotations

import json
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from examples import megatron_gpt
from tests.helpers.mcore_cpu import TinyShape, write_engine_checkpoint
from tests.helpers.mcore_reference import (
    PROMPT, RefitCheck, against_fresh, engine_log_probs, hf_tensors, log_probs_of, max_diff, refit, sent_items,
    unwrap,
)
from tests.helpers.multiprocess import free_port, run_ranks

CFG = dict(block_size_tokens=16, num_kv_blocks=64, max_requests=4, max_tokens=64, max_sequence_length=128)
"""CUDA graphs on (CUDA's default): the updated weights must reach the captured graphs."""
ROUTER_MARGIN = 2.0 ** -4
"""bf16 MoE: the smallest gap kept between a token's k-th and (k+1)-th router logit in
Megatron-Core's forward. Router logits here reach about 4, where one bf16 ulp is 2^-5; two bf16
forwards that round at different points may pick different experts for a token within a few ulps
of a tie, which is rounding, not a layout error. Seeds are tried in turn until every decision of
the prompt is at least this far from a tie."""
SEEDS = range(3, 23)


def init_trainer_world(device: str) -> None:
    """This process as a one-rank Megatron-Core job on GPU 0 (run_ranks sets MASTER_ADDR / PORT)."""
    from megatron.core import parallel_state

    if device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)


def leave_trainer_world() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def router_margin(model, ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th router logit over every token and MoE layer
    of Megatron-Core's forward of ``ids`` (inf without experts)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    gaps = [math.inf]
    for r in routers:
        def gating(x, _orig=r.gating, _k=r.topk):
            logits = _orig(x)
            top = logits.float().topk(_k + 1, dim=-1).values
            gaps.append((top[..., _k - 1] - top[..., _k]).min().item())
            return logits
        r.gating = gating  # TopKRouter.forward calls self.gating
    try:
        with torch.no_grad():
            megatron_gpt.logits(model, ids)
    finally:
        for r in routers:
            del r.gating
    return min(gaps)


def trainer_model(shape: TinyShape, dtype: torch.dtype, device: str):
    """(the GPTModel on ``device``, its seed); bf16 MoE: the first seed whose routing of ``PROMPT``
    keeps ``ROUTER_MARGIN``."""
    for seed in SEEDS:
        model = megatron_gpt.build_gpt(shape.hf_config(), seed=seed, device=device, dtype=dtype).eval()
        if dtype == torch.float32 or router_margin(model, PROMPT) >= ROUTER_MARGIN:
            return model, seed
    raise RuntimeError(f"no seed in {SEEDS} routes the prompt {ROUTER_MARGIN} away from a tie")


def float32_log_probs(model, shape: TinyShape, device: str) -> list[float]:
    """Megatron-Core's float32 forward of ``model``'s (bf16) weights: the exact values both bf16
    forwards round away from."""
    twin = megatron_gpt.build_gpt(shape.hf_config(), device=device, dtype=torch.float32).eval()
    with torch.no_grad():
        for (name, p), (twin_name, q) in zip(unwrap(model).named_parameters(), twin.named_parameters(), strict=True):
            assert name == twin_name, (name, twin_name)
            q.copy_(p)
        return log_probs_of(megatron_gpt.logits(twin, PROMPT))


def engine(path: Path, dtype: str, device: str):
    from megatron_async import LLM, InferenceConfig

    return LLM(str(path), device=device, dtype=dtype, inference_config=InferenceConfig(**CFG))


def reference(model, shape: TinyShape, dtype: torch.dtype, device: str) -> tuple[list[float], list[float] | None]:
    """(Megatron-Core's prompt log-probs, those of its float32 forward of the same weights for bf16)."""
    with torch.no_grad():
        want = log_probs_of(megatron_gpt.logits(model, PROMPT))
    return want, None if dtype == torch.float32 else float32_log_probs(model, shape, device)


def colocated_rank(rank: int, world: int, shape: TinyShape, dtype_name: str, te: bool, root: Path,
                   device: str = "cuda") -> RefitCheck:
    """run_ranks, one rank: trainer and engine in one process on one GPU (a hybrid engine):
    ``update_weights`` from the trainer's parameters (GPU tensors, Megatron-Core names), then a fresh
    engine loaded from the equivalent HF checkpoint."""
    init_trainer_world(device)
    dtype = getattr(torch, dtype_name)
    model, seed = trainer_model(shape, dtype, device)
    want, exact = reference(model, shape, dtype, device)
    llm = engine(write_engine_checkpoint(shape, root / "engine"), dtype_name, device)
    check = refit(llm, lambda: llm.update_weights(sent_items(model, te)), want)
    fresh = engine(write_engine_checkpoint(shape, root / "hf", tensors=hf_tensors(model)), dtype_name, device)
    against_fresh(check, llm, fresh, want)
    if device == "cuda":
        check.graph_replays = llm.engine.stats.graph_replays
    if exact is not None:
        check.mcore_vs_float32, check.engine_vs_float32 = max_diff(want, exact), max_diff(engine_log_probs(llm), exact)
    check.seed = seed
    llm.close()
    fresh.close()
    leave_trainer_world()
    return check


def _ipc_trainer(rank: int, world: int, shape: TinyShape, te: bool, port: int, device: str) -> int:
    """run_ranks, one rank: the trainer shares its bf16 parameters and keeps them until the engine
    answered."""
    from megatron_async.weight_transfer import ipc

    init_trainer_world(device)
    model, seed = trainer_model(shape, torch.bfloat16, device)
    want, exact = reference(model, shape, torch.bfloat16, device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    if device == "cuda":
        torch.cuda.synchronize()
    else:  # shared memory the engine process maps by name
        torch.multiprocessing.set_sharing_strategy("file_system")
        for p in model.parameters():
            p.data.share_memory_()
    store.set("payload", json.dumps({"handles": ipc.share(sent_items(model, te)), "want": want, "exact": exact,
                                     "seed": seed}))
    store.wait(["done"])
    leave_trainer_world()
    return seed


def ipc_refit(shape: TinyShape, te: bool, root: Path, device: str = "cuda", timeout_s: float = 300.0) -> RefitCheck:
    """The engine here, the trainer in another process on the same GPU: ``update_weights_from_ipc``."""
    llm = engine(write_engine_checkpoint(shape, root / "engine"), "bfloat16", device)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=timeout_s))
    box: dict = {}

    def trainer():
        try:
            box["seed"] = run_ranks(_ipc_trainer, 1, shape, te, port, device, timeout_s=timeout_s)[0]
        except BaseException as e:  # raised below, in the test's thread
            box["error"] = e

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    while not store.check(["payload"]):
        if not thread.is_alive():
            raise box.get("error") or RuntimeError("the trainer ended without sharing its weights")
        time.sleep(0.1)
    payload = json.loads(store.get("payload"))
    try:
        check = refit(llm, lambda: llm.engine.update_weights_from_ipc(payload["handles"]), payload["want"])
        check.engine_vs_float32 = max_diff(engine_log_probs(llm), payload["exact"])
        check.mcore_vs_float32, check.seed = max_diff(payload["want"], payload["exact"]), payload["seed"]
        llm.engine.weights.release_ipc()
    finally:
        store.set("done", "1")
        thread.join(timeout_s)
        llm.close()
    if "error" in box:
        raise box["error"]
    return check
