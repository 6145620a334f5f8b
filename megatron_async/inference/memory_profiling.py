"""Measure what ``plan_kv_pool`` needs on a GPU, once the weights are loaded and before the KV
pool exists: a probe context of two KV blocks (bookkeeping, sampler and Mamba state at their
real sizes) runs the largest step the configuration allows on a padding snapshot (every token
writes the dummy block, so two blocks suffice): ``max_tokens`` tokens over ``max_requests`` rows,
every row sampled with penalties, filters, log-probs and top-n. Its peak over the tensors that
stay is the step's workspace (activations, logits, MoE buffers, sampler). The CUDA graph pools
are estimated as one more such peak: graphs share one private pool, the largest captured step
needs what the eager one did, and the eager allocator keeps its own cached peak beside it."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from megatron_async.config import GraphSizing, InferenceConfig
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.memory_planning import DeviceMemoryReader, MemoryPlan, plan_kv_pool
from megatron_async.inference.text_generation_controllers.graph_plan import (
    SamplingVariant, decode_batch_sizes, splits_sampling,
)
from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner
from megatron_async.inference.text_generation_controllers.kernel_list import build_share, prebuild_listed
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport, shape_key
from megatron_async.inference.text_generation_controllers.warmup import (
    can_prebuild, eager_shapes, warm_token_mask, warmup_shape,
)

log = logging.getLogger("megatron_async")

EP_PEAK_SHARE = 0.05
"""Expert parallelism runs no eager probe step (its MoE exchanges need every rank's agreement):
the step's peak is taken as this share of the device memory instead."""


def peak_step_shape(runner: ModelRunner):
    """The largest step: ``max_tokens`` over ``max_requests`` rows, every row sampled with every feature."""
    ctx = runner.context
    rows = min(ctx.max_requests, ctx.max_tokens)
    return warmup_shape(ctx.max_tokens, rows, False, SamplingVariant.FULL, runner.model.vocab_size)


@torch.inference_mode()
def measure_peak_step(runner: ModelRunner, reader: DeviceMemoryReader,
                      warmup: bool = False) -> tuple[int, PrebuildReport | None]:
    """Bytes the largest step allocates above the tensors that stay, and how its kernels were built
    (None: one by one). ``warmup``: the same dry pass also builds the kernels of the warm-up's eager
    shapes (``warmup.eager_shapes`` on this probe context), one pass of compiles instead of two;
    the warm-up checks two of them on the real context (``kernel_prebuild.prebuild``'s ``built_before``)."""
    ctx, shape = runner.context, peak_step_shape(runner)
    built = None
    if can_prebuild(runner, runner.build_threads):  # its kernels built at once, not one by one
        shapes = [(shape, 0)] + (eager_shapes(runner) if warmup else [])
        built = prebuild_listed(runner, shapes, runner.build_threads,
                                also=(lambda: warm_token_mask(runner)) if warmup else None, share=build_share(runner))
    ctx.gpu_view.buffer.copy_(ctx.padding_snapshot(shape.num_rows, shape.num_tokens).to(ctx.device.device))
    reader.reset_peak()
    before = reader.read().allocated
    runner.compute_step(shape)
    return reader.read().peak_allocated - before, built


def profile_memory_plan(config: InferenceConfig, model, facade: DeviceFacade, dtype: torch.dtype, weights: int,
                        reader: DeviceMemoryReader, ep_size: int = 1, drafter=None) -> MemoryPlan:
    """The KV pool for ``config`` (neither ``num_kv_blocks`` nor ``buffer_size_gb`` set) on the
    device ``reader`` reads, given ``weights`` bytes already allocated for the model; with the
    start-up warm-up on, the probe's dry pass builds the warm-up's kernels too (``prebuilt_shapes``).
    Distributed runs: every rank calls it; all take the smallest pool (TP ranks share one schedule)."""
    kernels = config.kernels()
    probe = DynamicInferenceContext(replace(config, num_kv_blocks=2).cache_sizing(), model, facade, dtype,
                                    kernels.batch_invariant)
    if probe.spec is not None:
        probe.spec.set_drafter(drafter)
    runner = ModelRunner(model, probe, kernels)
    probe.sampling_state.ensure_allocated()
    probe_kv = sum(t.nbytes for t in probe.kv_caches)
    resident = reader.read().allocated - probe_kv - weights
    built = None
    if ep_size == 1:
        peak, built = measure_peak_step(runner, reader, warmup=config.startup_warmup)
    else:
        peak = int(EP_PEAK_SHARE * reader.read().total)
    bytes_per_block = probe_kv // probe.num_kv_blocks
    itemsize = dtype.itemsize if runner.sampler.reads_model_dtype else 4  # the logits the sampler reads
    decode_logits = decode_logits_bytes(config.graph_sizing(), model.vocab_size * itemsize, ep_size > 1,
                                        probe.lora_skips)
    graphs = peak + decode_logits if config.cuda_graphs else 0
    del runner, probe
    reader.release_cached()
    now = reader.read()
    plan = plan_kv_pool(
        total=now.total, utilization=config.gpu_memory_utilization, others=now.total - now.free - now.reserved,
        weights=weights, resident=resident, peak_step=peak, graph_pools=graphs,
        bytes_per_block=bytes_per_block, block_size=config.block_size_tokens,
        max_sequence_length=config.max_sequence_length, max_requests=config.max_requests)
    if built is not None:
        plan = replace(plan, probe_build=built.describe(),
                       prebuilt_shapes=frozenset(shape_key(s) for s in built.covered))
    return _agree(plan)


def decode_logits_bytes(config: GraphSizing, row_bytes: int, collective: bool, lora_free: bool = False) -> int:
    """What a plain engine's decode forward graphs keep as their outputs (``ModelRunner.graph_logits``):
    [rows, V] logits for every decode size, ``row_bytes`` a row (engines that capture whole steps: none);
    ``lora_free``: twice, the LoRA-free twins' too (graph_plan.py)."""
    if not splits_sampling(config):
        return 0
    return sum(decode_batch_sizes(config)) * row_bytes * (2 if lora_free and not collective else 1)


def _agree(plan: MemoryPlan) -> MemoryPlan:
    """The smallest pool of all ranks (each measured its own device)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return plan
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    n = torch.tensor([plan.num_blocks], device=device)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MIN)
    return replace(plan, num_blocks=int(n.item()))


def builtin_weight_bytes(name: str, dtype: torch.dtype, parallel=None, quantization: str | None = None) -> int:
    """Bytes of a built-in model's weights and buffers on this rank, from a build on the meta device."""
    from megatron_async.models.default_model import DEFAULT_CONFIGS
    from megatron_async.models.gpt import build_gpt
    from megatron_async.models.quantization import Fp8Config

    if name not in DEFAULT_CONFIGS:
        return 0  # build_default_model names the choices
    model = build_gpt(DEFAULT_CONFIGS[name], dtype, torch.device("meta"), parallel, Fp8Config.resolve(quantization, None))
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
