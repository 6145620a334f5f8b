"""LLM: the offline API. Builds the parallel state, model (loaded by model_loading.py), context,
model runner (``runner``) and engine, and serves them through ``generate`` (generation.py), a
coordinator (``listen`` / ``join``), weight updates and ``close``."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import replace

import torch

from megatron_async.config import InferenceConfig
from megatron_async.inference import gc_pauses, nvtx, triton_builds, triton_workers
from megatron_async.inference.communication.zmq_communicator import ZMQCommunicator
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron_async.inference.engines.rank_roles import rank_role
from megatron_async.inference.memory_planning import CudaMemoryReader, MemoryPlan, MemoryPlanError
from megatron_async.inference.memory_profiling import profile_memory_plan
from megatron_async.inference.memory_suspend import WEIGHTS, make_suspend_backend
from megatron_async.inference.request import RequestOutput, SamplingParams
from megatron_async.inference.startup_profile import StartupProfile
from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner
from megatron_async.generation import run_prompts
from megatron_async.kernels.backends import KernelBackends
from megatron_async.model_loading import check_batch_invariant, eos_ids, load_model, parse_dtype
from megatron_async.models.lora import LoRAAdapters
from megatron_async.parallel.p2p_all_reduce import check_p2p_possible, with_p2p_all_reduce
from megatron_async.parallel.p2p_exchange import with_p2p_exchange
from megatron_async.parallel.state import ParallelState

log = logging.getLogger("megatron_async")


def _ranks_config(config: InferenceConfig) -> InferenceConfig:
    """A TP / EP rank's config: no adaptive speculation (ranks schedule alike, never from their own
    timings)."""
    return replace(config, speculative_adaptive=False)


class LLM:
    def __init__(
        self,
        model: str | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        inference_config: InferenceConfig | None = None,
        default_model: str = "tiny",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        drafter=None,
        listen: str | None = None,
        join: str | None = None, role: str = "mixed",  # role: "mixed" | "prefill" | "decode" (docs/DISAGGREGATION.md)
        quantization: str | None = None,  # "fp8": FP8 linears at load (models/quantization.py)
    ):
        """``listen`` (``tcp://HOST:PORT``, loopback unless MEGATRON_ASYNC_CLIENT_SECRET is set, or
        ``ipc://PATH``): start a data-parallel coordinator there and serve this engine through it;
        ``join``: serve it through the coordinator at that address. Either way the engine runs on a
        thread of its own and takes requests from ``megatron_async.client.InferenceClient``s (not
        ``generate``); ``coordinator`` holds the service, ``close()`` ends it.

        ``tensor_parallel_size`` > 1: run as one rank of a torchrun job of that many
        processes. Every rank builds its shard of the model (GPT or hybrid) and its share of the
        KV cache / Mamba states; rank 0 alone accepts requests (``engine.add_request``) and
        ``generate`` returns the same outputs on every rank.

        ``expert_parallel_size`` > 1: as many data-parallel engines (one per rank, each with its
        own KV cache and requests; MoE experts split across them). Rank 0 alone accepts requests
        and routes each to a rank by ``InferenceConfig.dp_routing`` (load, prefix affinity); its
        ``engine.step()`` returns every rank's results; ``generate`` returns all outputs, in prompt order, on every rank. Both > 1:
        T x E ranks, ``expert_parallel_size`` data-parallel engines each run by a TP group of
        ``tensor_parallel_size`` ranks (replicas of one engine). FP8 checkpoints load in FP8 as they are."""
        t0 = time.perf_counter()
        self.startup = StartupProfile(cache_dir=triton_builds.cache_dir() if triton_builds.install() else None)
        """Where the start-up went (phases, Triton builds; startup_profile.py)."""
        self.config = inference_config or InferenceConfig()
        self.config.validate()
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        if tensor_parallel_size > 1 or expert_parallel_size > 1:  # ranks must schedule alike: no decisions from own timings
            if self.config.speculative_adaptive:
                raise ValueError("speculative_adaptive decides from each rank's own step times: not under TP / EP")
            self.config = _ranks_config(self.config)
        self.config = self.config.for_device(self.device.type)  # a copy where a default depends on the device
        self.quantization = quantization  # checked when the model is built (Fp8Config.resolve)
        self.memory_plan: MemoryPlan | None = None
        """How the KV pool was sized on CUDA when the config gives no size (see memory_planning.py)."""
        self.tensor_parallel_size, self.expert_parallel_size = tensor_parallel_size, expert_parallel_size
        self.communicator: ZMQCommunicator | None = None
        self.parallel = ParallelState()
        with self.startup.phase("join"):  # compile workers, the torchrun process group
            self._start_up = self._join(tensor_parallel_size, expert_parallel_size)
        try:
            with self.startup.phase("communicators"):  # P2P buffers, the ranks' host consensus
                self._communicators()
            with self._start_up:  # the compile workers end with the start-up
                self._build(model, default_model, seed, drafter)
            self.startup.total_seconds = time.perf_counter() - t0
            self.coordinator = None
            if listen is not None or join is not None:
                from megatron_async.dp_engine.join import CoordinatorService

                self.coordinator = CoordinatorService(self, listen, join, role)
        except BaseException:
            self._start_up.close()
            self.close()  # every rank fails the same way at load (a shape that does not divide): leave cleanly
            raise

    def _communicators(self) -> None:
        """The job's first collective, the TP all-reduce's and the EP exchange's P2P buffers, and
        the ranks' host-side consensus, each a part of the start-up's phase."""
        comm, part = self.config.communication(), self.startup.part
        if self.parallel.is_distributed:
            with part("first collective"):  # the job's group connects (NCCL: its communicator)
                self.parallel.connect(self.device)
        if self.parallel.tp_size > 1:
            with part("TP all-reduce"):
                self.parallel = with_p2p_all_reduce(self.parallel, comm.tp_all_reduce, comm.p2p_all_reduce_max_bytes,
                                                    self.device, fused_norm=comm.tp_fused_norm)
        if self.parallel.ep_size > 1:
            with part("EP exchange"):
                self.parallel = with_p2p_exchange(self.parallel, comm.ep_p2p_exchange, self.device)
        if self.parallel.is_distributed:
            with part("host consensus"):
                self.communicator = ZMQCommunicator.from_rendezvous(
                    self.parallel.rendezvous_store(), self.parallel.global_rank, self.parallel.world_size,
                    shared_memory=comm.consensus_shared_memory, spin_us=comm.consensus_spin_us)

    def _join(self, tensor_parallel_size: int, expert_parallel_size: int) -> contextlib.ExitStack:
        """Start the start-up's Triton compile workers (they fork before CUDA starts: ``set_device``
        here, the P2P buffers after), then join the torchrun job when there is one. Returns what
        ends the workers (after the start-up, or when it fails)."""
        workers = contextlib.ExitStack()
        workers.enter_context(triton_workers.running(self.device, self.config.startup_build_threads,
                                                     self.config.startup_compile_workers))
        try:
            check_p2p_possible(self.config.communication().tp_all_reduce, tensor_parallel_size, self.device)
            if tensor_parallel_size > 1 or expert_parallel_size > 1:
                if self.device.type == "cuda":  # one GPU per rank
                    self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                    torch.cuda.set_device(self.device)
                self.parallel = ParallelState.from_torchrun(tensor_parallel_size, self.device, expert_parallel_size)
        except BaseException:
            workers.close()
            raise
        return workers

    def _build(self, model: str | None, default_model: str, seed: int, drafter=None) -> None:
        nvtx.set_enabled(self.config.nvtx_ranges)
        choice = self.config.kernels()
        kernels = KernelBackends.from_choice(choice, self.device)
        self.attention_backend, self.mamba_backend = kernels.attention, kernels.mamba
        reader = CudaMemoryReader(self.device) if self.device.type == "cuda" else None
        allocated_before = reader.read().allocated if reader else 0
        suspend = make_suspend_backend(self.device) if self.config.enable_suspend else None
        with suspend.region(WEIGHTS) if suspend else contextlib.nullcontext(), self.startup.phase("load"):
            self.model, self.tokenizer = load_model(model, default_model, seed, self.device, self.dtype, self.parallel,
                                                    self.quantization, reader)  # engine.suspend frees the weights
        self.model.eval()
        self.model.kernels = kernels  # this model's kernels, not the process's
        if self._flashinfer_prefill(choice):  # (its long-tile test reads the kernels above)
            self.model.kernels = replace(kernels, flashinfer_prefill=True)
        if self.config.enable_lora:  # adapter slots before graphs, warm-up and the snapshot layout
            LoRAAdapters.attach(self.model, self.config.lora())
        if choice.batch_invariant:
            check_batch_invariant(self.model, self.device)
        self._fit_max_sequence_length()
        self.model.reserve_positions(self.config.max_sequence_length)
        stop_ids = eos_ids(model, self.model, self.tokenizer)
        facade = DeviceFacade(self.device, suspend)
        if self.config.num_speculative_tokens > 0:  # before the context: MTP heads add KV layers to the pool
            drafter = self._drafter(drafter)
        elif drafter is not None:
            raise ValueError("a drafter needs InferenceConfig.num_speculative_tokens > 0")
        if reader and self._plans_memory():
            weights = reader.read().allocated - allocated_before
            probe = DeviceFacade(self.device)  # the probe's pools stay out of the suspendable regions
            with self.startup.phase("memory profile"):
                self.memory_plan = profile_memory_plan(self.config, self.model, probe, self.dtype, weights, reader,
                                                   self.parallel.ep_size, drafter)
            self.config = replace(self.config, num_kv_blocks=self.memory_plan.num_blocks)
            log.info("%s", self.memory_plan.describe())
        self.startup.begin("engine")
        self.context = DynamicInferenceContext(self.config.cache_sizing(), self.model, facade, self.dtype,
                                               choice.batch_invariant, self._long_tile_min_query(choice))
        if self.context.spec is not None:
            self.context.spec.set_drafter(drafter)
        self.runner = ModelRunner(self.model, self.context, choice, stop_ids, expert_parallel=self.parallel.ep_size > 1)
        self.runner.prebuilt_shapes = self.memory_plan.prebuilt_shapes if self.memory_plan else frozenset()
        if self.config.cuda_graphs and facade.is_cuda:
            self.runner.graphs = self._graph_runner()
        ranks = rank_role(self.communicator, self.parallel.dp_size, self.parallel.tp_size)
        self.engine = DynamicInferenceEngine(self.runner, self.context, self.config.scheduling(),
                                             self.config.speculation(), self.tokenizer, ranks=ranks)
        self.startup.end()
        warms_up = facade.is_cuda and (self.config.startup_warmup
                                       or self.parallel.ep_size > 1 and self.config.cuda_graphs)
        if warms_up:
            # Expert parallelism always captures here: every rank at once (collectives inside).
            try:
                rep = self.engine.warmup()
            except torch.OutOfMemoryError:
                if self.memory_plan is None:
                    raise
                raise MemoryPlanError(f"CUDA out of memory in the startup warm-up: the planned {self.memory_plan.describe()} "
                                      "left too little; lower gpu_memory_utilization or max_tokens") from None
            self.startup.add_warmup(rep)
            log.info("warm-up: %.1f s, %d eager steps, %d CUDA graphs (%d without an eager run first, %d captured "
                     "again after one), %d Triton builds, %.2f GiB reserved", rep.seconds, rep.eager_steps,
                     rep.graphs_captured, rep.captures_without_eager_run, rep.capture_retries, rep.triton_builds,
                     rep.memory_bytes / 2**30)
        # startup's garbage goes now, not as a full collection inside the first serving steps
        # (the benchmark collects before each timed run; the main job and the server rely on this)
        if self.config.gc_freeze:  # (one collection, then what survives stays out of serving's collections)
            gc_pauses.settle()
        elif warms_up:
            gc.collect()
        gc_pauses.watch()

    def _graph_runner(self):
        """Decode graphs always; mixed-step graphs on Triton attention (the varlen kernel reads row lengths
        from the snapshot) and, for hybrid models, on the Mamba backends with packed kernels (TRITON /
        MAMBA_SSM: their grids depend only on the padded sizes; the torch reference would lay every row out
        to the padded token count); speculative verify graphs on Triton attention (the torch path would
        gather every row's whole KV table in a graph, sized for max_sequence_length). Expert parallelism: a
        collective runner (decode graphs, and mixed graphs of FULL sampling for steps above a decode batch,
        captured by every rank at once in the warm-up; see ``CudaGraphRunner``). Logits-only graphs for steps with grammar rows when a grammar library is
        installed and structured outputs are not off."""
        from megatron_async.inference.text_generation_controllers.cuda_graphs import CudaGraphRunner

        triton_attention = self.model.kernels.triton_attention or self.config.batch_invariant
        mamba_ok = self.context.mamba is None or self.model.kernels.triton_mamba
        mixed = self.config.cuda_graph_mixed_steps and mamba_ok and triton_attention
        from megatron_async.inference.structured.grammars import any_installed

        logits_only = self.config.structured_outputs_backend != "off" and any_installed()  # steps with grammar rows
        return CudaGraphRunner(self.runner, self.config.graph_sizing(), mixed=mixed, collective=self.parallel.ep_size > 1,
                               verify=triton_attention, logits_only=logits_only, lora_free=self.context.lora_skips,
                               long_tile_min=self.context.long_tile_min_query)

    def _long_tile_min_query(self, choice) -> int:
        """Query tokens of a step's longest row from which it runs the long prefill tiles (0: never):
        the switch on, Triton attention (or batch-invariant mode's kernel, whose tiles change no
        bits, with a table where it splits such steps) on a device where they pay, one engine
        (data-parallel ranks replay one agreed graph, so they keep one tile class)."""
        if not (choice.long_prefill_tiles and (choice.batch_invariant or self.model.kernels.triton_attention)
                and self.parallel.ep_size == 1):
            return 0
        from megatron_async.kernels.triton_invariant_attention import splits_long_steps
        from megatron_async.kernels.triton_prefill_common import LONG_TILE_MIN_QUERY, long_tiles_pay

        if choice.batch_invariant and not splits_long_steps(self.device, self.config.max_sequence_length):
            return 0

        return LONG_TILE_MIN_QUERY if long_tiles_pay(self.device) else 0

    def _flashinfer_prefill(self, choice) -> bool:
        """Whether long-tile steps run their long rows on FlashInfer's FA3 kernel: the switch on, the
        long tiles on (``_long_tile_min_query``), not batch-invariant (its own kernel) and the kernel
        ready here (``flashinfer_prefill.ready``)."""
        if not (choice.flashinfer_prefill and not choice.batch_invariant and self._long_tile_min_query(choice)):
            return False
        from megatron_async.kernels import flashinfer_prefill

        with self.startup.phase("FA3 prefill kernel"):  # FlashInfer's first build of it takes minutes
            return flashinfer_prefill.ready(self.device, self.dtype, self.model.kv_cache_spec().head_dim)

    def _plans_memory(self) -> bool:
        """CUDA without a KV size in the config: the pool is planned from measured memory."""
        return self.device.type == "cuda" and self.config.num_kv_blocks is None and self.config.buffer_size_gb is None

    def _drafter(self, drafter):
        from megatron_async.inference.speculative.factory import build_drafter

        return drafter if drafter is not None else build_drafter(self.config.speculation(), self.model)

    def _fit_max_sequence_length(self) -> None:
        """A model cannot attend beyond its ``max_position_embeddings``: a larger
        ``max_sequence_length`` is clamped to it, with a warning (the caller's config object is
        not changed; ``self.config`` is a copy then). Requests longer than that are rejected."""
        limit = getattr(self.model, "max_position_embeddings", None)
        if limit is not None and self.config.max_sequence_length > limit:
            log.warning("max_sequence_length %d exceeds the model's max_position_embeddings %d: clamped to %d",
                        self.config.max_sequence_length, limit, limit)
            self.config = replace(self.config, max_sequence_length=limit)

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the job (always True without TP / EP): the rank that prints and writes."""
        return self.parallel.is_leader

    def close(self) -> None:
        """End the grammar worker (a fill in flight holds the process's GIL switch interval), then
        leave the TP / EP group (no-op without). CUDA graphs go first: a graph that captured NCCL
        collectives holds a reference on the communicator, and ncclCommDestroy waits for them."""
        if self.config.gc_freeze:  # (this engine's cycles collectable again)
            gc_pauses.thaw()
        if getattr(self, "coordinator", None) is not None:
            self.coordinator.close()
            self.coordinator = None
        if getattr(self, "engine", None) is not None:
            self.engine.masks.close()
        runner = getattr(self, "runner", None)
        if runner is not None and runner.graphs is not None:
            runner.graphs.release()
            runner.graphs = None
        if self.communicator is not None:
            self.communicator.close()
            self.communicator = None
        self.parallel.destroy()

    def update_weights(self, weights, version: int | None = None, recompute_kv: bool = True, *,
                       weights_format: str | None = None) -> int:
        """Copy ``weights`` into the model in place and return the new weight version.

        ``weights``: (HF name, full tensor) pairs (a trainer's named parameters; any subset of
        the checkpoint's tensors), a checkpoint directory, or Megatron-Core tensors: (name,
        tensor) pairs of a Megatron-Core model's ``named_parameters()`` / ``state_dict()`` (fused
        layouts: ``linear_qkv``, ``linear_fc1``, ...) or (name, tensor, ``Shard``) triples of its
        TP / EP / PP shards (``megatron_async.weight_transfer.Shard``), every rank's shards
        together. ``weights_format``: "hf", "megatron" or None (detected from the names). Under
        TP / EP every rank calls this with the same weights and keeps its part. Everything is
        checked before anything is copied (``WeightUpdateError``, nothing changed). Parameter
        storage stays where it is, so captured CUDA graphs replay the new values. ``version``: an
        int >= 0 (None: the current version + 1; it is 0 after loading); each generated token
        records the version that produced it (``RequestOutput.weight_versions``). Prefix-cache
        entries computed before are never hit again. Call it between ``step()``s, e.g. while
        ``pause_generation("keep")``. ``recompute_kv`` (default): requests holding KV computed
        with the old weights recompute it before their next token (the launch in flight lands
        first), so every later token is exactly what the new weights give; False keeps their KV
        (no recompute; later tokens then attend to old-weight keys and values)."""
        return self.engine.weights.update(weights, version, recompute_kv, weights_format)

    def load_lora(self, name: str, path_or_tensors) -> None:
        """Load a LoRA adapter as ``name`` (``SamplingParams.lora``): a PEFT directory, a mapping of
        PEFT-named tensors (scale 1), (adapter config dict, mapping), or ``prepare_lora``'s result
        (then only its install runs: a few stream-ordered copies, no wait for the device). Checked
        whole first (``LoRAError``, nothing changed). Under TP every rank calls it alike."""
        self.engine.lora.load(name, path_or_tensors)

    def prepare_lora(self, path_or_tensors):
        """Read, check and stage an adapter for ``load_lora`` without touching the engine's state:
        call it on another thread while the engine steps, then ``load_lora(name, prepared)``
        between two steps (``LoRAError`` here for a refused adapter)."""
        return self.engine.lora.prepare(path_or_tensors)

    def unload_lora(self, name: str) -> None:
        """Free adapter ``name``; refused (``LoRAError``) while unfinished requests use it."""
        self.engine.lora.unload(name)

    def update_lora(self, name: str, tensors) -> int:
        """Rewrite adapter ``name`` in place (checked like ``load_lora``); returns the new weight version."""
        return self.engine.lora.update(name, tensors)

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; ``outs[i]`` belongs to ``prompts[i]``.

        A single string, or a single list of token ids, is one prompt. A prompt that can never
        be served gets an output with ``finish_reason="error"`` and ``error`` set, and the
        others still run. Requests added earlier with ``engine.add_request`` are not touched:
        they advance while these run, and their outputs come from the engine's next ``step()``."""
        return run_prompts(self.engine, self.communicator, self.parallel, prompts, sampling_params)
