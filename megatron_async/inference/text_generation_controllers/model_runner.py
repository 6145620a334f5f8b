"""ModelRunner: the device side of a step. It never changes a request.

``prepare`` has the context assemble a planned step into the step buffer and picks its CUDA
graph; ``launch`` enqueues all device work of it (H2D of the buffer, forward, sampling, the
D2H copy of the samples); ``collect`` waits for a launch's samples and hands them over as
plain host lists, which the request book lands. Serial = launch then collect. Launch-ahead =
launch N+1, then collect N while the device runs N+1. Within a launch the only device->host
traffic is the asynchronous copy of the samples into a pinned buffer followed by an event;
decode input ids of the next launch are gathered on the device from ``last_samples``, never
via the host."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_async.config import KernelChoice
from megatron_async.inference import triton_workers
from megatron_async.inference.async_pipeline import HostSamples, PendingLaunch
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.device import copy_to_host
from megatron_async.inference.nvtx import nvtx_range
from megatron_async.inference.routed_experts import RoutingRecorder
from megatron_async.inference.speculative.plain_steps import PlainStepSelector
from megatron_async.inference.speculative.policy import SpecPolicy
from megatron_async.inference.speculative.verify import SpecVerifier
from megatron_async.inference.step_plan import ALONE, StepAgreement, StepPlan
from megatron_async.inference.text_generation_controllers.prompt_scoring import PromptScoring, wants_prompt_scoring
from megatron_async.inference.text_generation_controllers.sample_launcher import SampleLauncher
from megatron_async.inference.text_generation_controllers.token_mask_buffers import TokenMaskBuffers
from megatron_async.inference.text_generation_controllers.warmup import WarmupReport, run_warmup
from megatron_async.kernels import fused_ops
from megatron_async.models.base import CausalLM
from megatron_async.step_shape import StepShape


class StepLogits(NamedTuple):
    """A step's forward, up to the logits of its samples (``ModelRunner.forward_logits``)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    """The hidden states (speculative decoding reads them; None after a logits-only graph)."""
    input_ids: torch.Tensor | None
    batch: object | None
    spec: bool
    """Speculative decoding's machinery runs in this step."""


class _SamplingTail(NamedTuple):
    """What a launch awaiting its grammar masks keeps for its sampling (``finish_launch``)."""

    shape: StepShape
    fwd: StepLogits
    routing: bool
    """Its rows' routing is copied to the host with the samples."""


@dataclass
class PreparedStep:
    """A planned step assembled in the step buffer, ready to launch (``ModelRunner.prepare``)."""

    plan: StepPlan
    shape: StepShape
    graph: object | None
    """The CUDA graph it replays (None: eager)."""
    speculative: bool
    """It runs speculative decoding's machinery (spec inputs, acceptance, the drafter)."""
    dp_num_tokens: int = 0
    """Data-parallel ranks: what this step's MoE exchanges pad to (``StepAgreement.max_tokens``)."""
    prompt_scoring: PromptScoring | None = None
    """Rows scoring their prompt (prompt_scoring.py): the step runs eager."""


class ModelRunner:
    def __init__(self, model: CausalLM, context: DynamicInferenceContext, kernels: KernelChoice,
                 eos_ids: tuple[int, ...] = (), expert_parallel: bool = False):
        """``kernels``: the sampling backend and batch-invariant mode. ``expert_parallel``: MoE layers exchange tokens across EP ranks, so every forward
        carries ``ep_num_tokens`` (from the step's ``StepAgreement``)."""
        self.model = model
        self.context = context
        self.device = context.device
        self.eos_ids = tuple(eos_ids)
        """Token ids that end a request without its own termination_id (all of them stop)."""
        self.batch_invariant = kernels.batch_invariant
        self.build_threads = triton_workers.build_threads(kernels.startup_build_threads)
        """Threads that build the warm-up's Triton kernels at once (0: one by one as steps meet them)."""
        self.kernel_lists = kernels.startup_kernel_lists
        """Keep and use the lists of the warm-up's kernels beside Triton's cache (kernel_list.py)."""
        self.prebuilt_shapes: frozenset = frozenset()
        """Warm-up shapes whose kernels the memory profile's dry pass built (``MemoryPlan.prebuilt_shapes``)."""
        R = context.max_requests
        S = context.max_samples  # config.max_samples, and the graphs' spare padding row
        dev = self.device.device
        # Samples of the latest launch, read by the next launch's decode rows (fixed address);
        # graph padding rows write past the real rows, up to the snapshot's spare row.
        self.last_samples = torch.zeros(S, dtype=torch.int64, device=dev)
        self.spec = SpecVerifier(context.spec, context.block_size) if context.spec is not None else None
        self.spec_steps = PlainStepSelector() if self.spec is not None else None
        """Speculative decoding: which steps run the plain engine's step (``bind_spec_policy``)."""
        self.accepted = torch.zeros(context.max_rows, dtype=torch.int64, device=dev)
        """Speculative decoding: drafts accepted per row of the latest launch (fixed address;
        a graph's spare padding row writes one too)."""
        self.host_wait: str | None = None
        """How ``collect`` waits for a launch's samples: "spin" (a core polls, the host wakes at
        once), "block" (the thread sleeps until the device signals) or None: block on launches
        made ahead of the previous step's bookkeeping (a launch is then queued behind the one
        waited for, so waking a little later idles nothing), spin on the others."""
        self._host_ring = [self._host_buffers(S, R) for _ in range(3)]
        self._host_views: dict[tuple[int, int], torch.Tensor] = {}  # (ring slot, samples) -> tokens view
        self._ring = 0
        self.graphs = None  # CudaGraphRunner, when enabled
        self.expert_parallel = expert_parallel
        self._dummy_snapshot: torch.Tensor | None = None
        self.sampler = SampleLauncher(kernels.sampling_backend, dev, context.sampling_state)
        self.routing = RoutingRecorder.for_model(model, context.gpu_view.input_ids.shape[0], self.device)
        """MoE models: where the layers record routing (graphs always, eager steps when a row asks)."""
        self.token_masks: TokenMaskBuffers | None = None
        """Grammar token masks of the steps that have grammar rows (allocated by the first one)."""
        self._mask_host: tuple | None = None  # (launch, its host bitmask, row map): mask_buffers
        self._graph_logits: torch.Tensor | None = None  # the logits-only graphs' shared output (graph_logits)
        self.lora_free_steps = 0
        """Launched steps whose forward ran without the LoRA ops (no row had an adapter)."""

    def _host_buffers(self, S: int, R: int) -> dict[str, torch.Tensor]:
        pin = self.device.is_cuda
        return {
            "tokens": torch.zeros(S, dtype=torch.int64, pin_memory=pin),
            "log_probs": torch.zeros(S, dtype=torch.float32, pin_memory=pin),
            "accepted": torch.zeros(R, dtype=torch.int64, pin_memory=pin),
        }

    def bind_spec_policy(self, policy: SpecPolicy) -> None:
        """Speculative decoding: steps where no row drafts now or (by ``policy``) next run the
        plain engine's step. Not under expert parallelism: every rank runs the drafter's
        collectives in every step."""
        if self.spec_steps is not None:
            self.spec_steps = PlainStepSelector(policy)

    # ------------------------------------------------------------------ device side
    def prepare(self, plan: StepPlan, agreed: StepAgreement = ALONE) -> PreparedStep:
        """The context assembles ``plan`` into the next step buffer (raises RequestStepError for
        a request whose values break it: nothing changed); the graph it replays, padded for.
        ``agreed``: the data-parallel ranks' agreement on this step."""
        ctx = self.context
        use_graphs = self.graphs is not None and not agreed.eager
        spec = self.spec_steps is not None and (self.spec_steps.speculative(plan) or self.expert_parallel)
        # verify steps that may replay a verify graph are laid out uniformly (its width per row)
        width = self.graphs.plan.verify_width(plan) if use_graphs else 0
        with nvtx_range("initialize_attention_state"):
            shape = ctx.initialize_attention_state(plan, verify_width=width)
        graph = scoring = None
        if not shape.is_decode_only and wants_prompt_scoring(plan):  # never a decode-only step
            scoring, use_graphs = PromptScoring(plan), False
        if use_graphs:
            graph = self.graphs.lookup(shape, min_rows=agreed.max_tokens, min_variant=agreed.variant, spec=spec)
        if graph is not None:
            k = graph.key
            spec |= k.spec  # a graph with the machinery runs it (correct for any step's layout)
            ctx.pad_for_graph(shape.num_tokens, shape.num_rows, k.num_tokens, k.num_rows, k.verify_width)
        if self.spec_steps is not None:
            self.spec_steps.launched(plan, spec, shape.is_decode_only)
        return PreparedStep(plan, shape, graph, spec, agreed.max_tokens, scoring)

    @torch.inference_mode()
    def launch(self, step: PreparedStep, step_id: int, overlapped: bool, timed: bool) -> PendingLaunch:
        """Enqueue the device work of a prepared (and committed) step. A step with grammar rows
        is enqueued up to its logits: ``finish_launch`` enqueues its sampling once the host has
        filled the token masks (``PendingLaunch.awaiting_masks``)."""
        ctx, plan, shape, graph, spec = self.context, step.plan, step.shape, step.graph, step.speculative
        asked = self.routing is not None and self.routing.asked(plan.rows, ctx.active, ctx.active_version)
        start_ev = end_ev = None
        if timed and self.device.is_cuda:
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record()
        t0 = time.perf_counter()
        with nvtx_range("transfer_bookkeeping_to_gpu"):
            ctx.transfer_bookkeeping_to_gpu()
        if graph is not None:
            with nvtx_range("forward_pass"):
                graph.replay()
        outputs = tail = None
        if shape.any_grammar:
            fwd = graph.logits(shape.num_samples) if graph is not None else self.forward_logits(
                shape, spec, step.dp_num_tokens, step.prompt_scoring, record_routing=asked)
            tail = _SamplingTail(shape, fwd, asked)
        elif graph is not None:
            outputs = graph.outputs(shape.num_samples, shape.any_log_probs, shape.max_top_n)
        else:
            outputs = self.compute_step(shape, spec, step.dp_num_tokens, step.prompt_scoring, record_routing=asked)
        if ctx.mamba is not None:
            ctx.mamba.after_forward()
        if ctx.lora_skips and (graph.key.no_lora if graph is not None else not shape.any_lora):
            self.lora_free_steps += 1
        pending = PendingLaunch(
            step_id=step_id, rows=list(plan.rows), is_decode_only=plan.is_all_decode,
            num_tokens=shape.num_tokens, overlapped=overlapped, host_tokens=None, host_log_probs=None,
            host_top_n_vals=None, host_top_n_ids=None, event=None, launch_time=t0,
            timing_events=(start_ev, end_ev) if start_ev is not None else (), sample_base=shape.sample_base,
            prompt_scoring=step.prompt_scoring, awaiting_masks=tail)
        if tail is None:
            self._copy_results(pending, shape, spec, outputs, asked)
        return pending

    def mask_buffers(self, pending: PendingLaunch) -> tuple[torch.Tensor, torch.Tensor]:
        """The host int32 buffers of the grammar masks of ``pending`` (awaiting them): the bitmask
        and the row map, all -1; the next of the ring, taken once per launch."""
        if self._mask_host is None or self._mask_host[0] is not pending:
            if self.token_masks is None:
                self.token_masks = TokenMaskBuffers(self.context.max_samples, self.model.vocab_size, self.device)
            self._mask_host = (pending, *self.token_masks.host(pending.awaiting_masks.shape.num_samples))
        return self._mask_host[1], self._mask_host[2]

    @torch.inference_mode()
    def finish_launch(self, pending: PendingLaunch, fill) -> None:
        """Enqueue the sampling of a launch that awaits its grammar masks: ``fill(bitmask,
        row_map)`` (``mask_buffers``) writes them and returns the bitmask rows it used; they are
        copied to the device, and the sampling reads them."""
        bitmask, row_map = self.mask_buffers(pending)
        tail, pending.awaiting_masks, self._mask_host = pending.awaiting_masks, None, None
        shape, S = tail.shape, tail.shape.num_samples
        num_rows = fill(bitmask, row_map)
        masks = self.token_masks.to_device(num_rows, S) if num_rows else None
        outputs = self.sample_tail(shape, tail.fwd, masks)
        self._copy_results(pending, shape, tail.fwd.spec, outputs, tail.routing)

    def _host_tokens(self, num_samples: int) -> torch.Tensor:
        """The current host ring slot's first ``num_samples`` tokens (a view kept per slot and
        size: slicing costs tens of microseconds of Python inside a step)."""
        key = (self._ring, num_samples)
        view = self._host_views.get(key)
        if view is None:
            view = self._host_views[key] = self._host_ring[self._ring]["tokens"][:num_samples]
        return view

    def _copy_results(self, pending: PendingLaunch, shape: StepShape, spec: bool, outputs, routing: bool) -> None:
        """Enqueue the copies of a launch's samples into the next pinned host buffers, and its event."""
        tokens, log_probs, top_vals, top_ids = outputs
        self._ring = (self._ring + 1) % len(self._host_ring)
        host = self._host_ring[self._ring]
        R, S = shape.num_rows, shape.num_samples
        with nvtx_range("transfer_samples_to_cpu"):
            pending.host_tokens = self._host_tokens(S)
            pending.host_tokens.copy_(tokens, non_blocking=True)
            if spec:  # a plain step accepts nothing
                pending.host_accepted = host["accepted"][:R]
                pending.host_accepted.copy_(self.accepted[:R], non_blocking=True)
            if log_probs is not None:
                pending.host_log_probs = host["log_probs"][:S]
                pending.host_log_probs.copy_(log_probs, non_blocking=True)
            if top_vals is not None:
                pending.host_top_n_vals, pending.host_top_n_ids = copy_to_host(top_vals), copy_to_host(top_ids)
            if pending.prompt_scoring is not None:
                pending.prompt_scoring.copy_to_host()
            if routing:
                pending.routed_experts = self.routing.copy_to_host(pending.rows, shape)
            pending.event = self.device.event(blocking=pending.overlapped if self.host_wait is None
                                              else self.host_wait == "block")
            self.device.record(pending.event)
        if pending.timing_events:
            pending.timing_events[1].record()

    def compute_step(self, shape: StepShape, spec: bool | None = None, dp_num_tokens: int = 0,
                     scoring: PromptScoring | None = None, record_routing: bool = True):
        """Forward + sample of one assembled step, reading only the GPU view (``forward_logits``
        then ``sample_tail``). Also the body that CUDA graphs capture (with padded decode and
        mixed shapes)."""
        return self.sample_tail(shape, self.forward_logits(shape, spec, dp_num_tokens, scoring, record_routing))

    def forward_logits(self, shape: StepShape, spec: bool | None = None, dp_num_tokens: int = 0,
                       scoring: PromptScoring | None = None, record_routing: bool = True) -> StepLogits:
        """The forward of one assembled step up to its samples' logits (what a logits-only graph
        captures). ``spec``: speculative decoding's machinery (spec inputs, acceptance, drafter)
        runs; False: the plain engine's step (plain_steps.py); None: whenever speculation is on.
        ``dp_num_tokens``: expert parallelism, the fewest tokens MoE exchanges pad to (a graph
        capture: 0, so its own padded tokens). ``scoring``: an eager step's prompt positions
        to score from the hidden states. ``record_routing``: MoE layers write the routing
        buffer (graphs always do; an eager step only when a row asked)."""
        ctx, g = self.context, self.context.gpu_view
        spec = self.spec is not None if spec is None else spec and self.spec is not None
        T, R, S = shape.num_tokens, shape.num_rows, shape.num_samples
        batch = ctx.forward_batch(shape)
        batch.ep_num_tokens = max(T, dp_num_tokens) if self.expert_parallel else None
        if record_routing and self.routing is not None:
            batch.routed_experts = self.routing.buffer
        prev = g.prev_sample_idx[:T]
        input_ids = fused_ops.resolve_input_ids(prev, self.last_samples, g.input_ids[:T])
        if spec:  # positions corrected in the view before the forward reads them
            input_ids = self.spec.prepare(g, T, R, S, input_ids)
        with nvtx_range("forward_pass"):
            hidden = self.model(input_ids, batch)
            logits = self.model.compute_logits(hidden[g.sample_token_idx[:S]], batch_invariant=self.batch_invariant,
                                               float32=not self.sampler.reads_model_dtype)
            if scoring is not None:
                scoring.compute(self.model, hidden, self.context.sampling_state.vocab_size, self.batch_invariant,
                                self.sampler.reads_model_dtype)
        return StepLogits(logits, hidden, input_ids, batch, spec)

    def graph_logits(self, shape: StepShape) -> torch.Tensor:
        """The logits-only graphs' body (forwards of sampling tails, steps with grammar rows):
        ``forward_logits`` of a plain step. A decode graph keeps its logits as its own output (no
        copy in every decode step; the decode sizes' rows add up to a few hundred, which the memory
        plan reserves: ``decode_logits_bytes``); a mixed graph copies them into one buffer every
        mixed graph shares (25 graphs of up to max_requests + 1 rows each would hold ~1 GB at a
        150k vocabulary). The buffer is allocated by the eager run before the first capture."""
        logits = self.forward_logits(shape, False).logits
        if shape.is_decode_only:
            return logits
        buf = self._graph_logits
        if buf is None or buf.dtype != logits.dtype:
            buf = self._graph_logits = torch.empty(self.context.max_rows, logits.shape[-1], dtype=logits.dtype,
                                                   device=logits.device)
        out = buf[: logits.shape[0]]
        out.copy_(logits)
        return out

    def sample_tail(self, shape: StepShape, fwd: StepLogits, masks=None):
        """Sampling of a step from its logits (``masks``: the grammar bitmask and row map on the
        device, or None), the samples into ``last_samples``, then speculative decoding's
        acceptance and drafter. Returns (tokens, log-probs, top-n values, top-n ids)."""
        ctx, g = self.context, self.context.gpu_view
        R, S = shape.num_rows, shape.num_samples
        with nvtx_range("sampling"):
            tokens, log_probs, top_vals, top_ids = self.sampler.sample_with_log_probs(
                fwd.logits, g, S, shape, self.batch_invariant, masks)
            self.last_samples[:S].copy_(tokens)
        if fwd.spec:
            with nvtx_range("speculative_verify"):
                out = self.spec.verify(g, R, fwd.input_ids, tokens, fwd.hidden, fwd.batch, self.accepted)
                self.model.commit_speculative(out)
                self.spec.store_drafts(out, ctx.spec.drafter.propose(out))
        elif self.spec is not None and ctx.spec.drafter.tracks_plain_steps:
            with nvtx_range("speculative_track"):
                ctx.spec.drafter.track(self.spec.plain_outputs(g, R, tokens, fwd.hidden, fwd.batch))
        return self.last_samples[:S], log_probs, top_vals, top_ids

    @torch.inference_mode()
    def dummy_forward(self, agreed: StepAgreement) -> None:
        """Data parallel: a forward with nothing to compute, so this rank's collectives match
        the ranks that launch real work. Padding rows only, writing only to the dummy KV block
        and the padding Mamba slot; the samples of a launch in flight stay intact. Its MoE
        layers pad to ``agreed.max_tokens``. In a step the ranks replay graphs it replays the
        agreed graph too (NCCL: captured or not must match across ranks), else one eager row.
        Speculative decoding: a verify step's MoE exchanges pad to the same agreed count (drafts
        included), and the drafter's own collectives are matched too (``match_collectives``)."""
        ctx = self.context
        replay = self.graphs is not None and not agreed.eager
        key = self.graphs.padding_key(max(1, agreed.max_tokens), agreed.variant) if replay else None
        rows, tokens = (key.num_rows, key.num_tokens) if key is not None else (1, 1)
        if self._dummy_snapshot is None or self._dummy_rows != (rows, tokens):
            snap = ctx.padding_snapshot(rows, tokens)
            self._dummy_snapshot = snap.pin_memory() if self.device.is_cuda else snap
            self._dummy_rows = (rows, tokens)
        ctx.gpu_view.buffer.copy_(self._dummy_snapshot, non_blocking=True)
        if replay:
            saved = self.last_samples.clone()  # the graph samples its padding rows into last_samples
            with nvtx_range("dummy_forward"):
                self.graphs.replay_padding(key)
            self.last_samples.copy_(saved)
            return
        shape = StepShape(num_tokens=rows, num_rows=rows, max_query_len=1, max_kv_len=1, is_decode_only=True,
                          any_sampling=False, any_top_k_top_p=False, max_top_n=0, any_log_probs=False)
        with nvtx_range("dummy_forward"):
            batch = ctx.forward_batch(shape)
            batch.ep_num_tokens = max(rows, agreed.max_tokens) if self.expert_parallel else None
            input_ids = ctx.gpu_view.input_ids[:rows]
            hidden = self.model(input_ids, batch)
            if self.spec is not None:  # the drafter's own collectives (MTP heads' MoE layers)
                ctx.spec.drafter.match_collectives(input_ids, hidden, batch)

    def warmup(self, agree=None) -> WarmupReport:
        """Build every reachable Triton kernel variant and capture every planned graph (warmup.py).
        Expert parallelism: only the graphs (decode, every variant, every rank together), no eager pass;
        ``agree``: the ranks' element-wise max of a list of ints (``SingleRank.max_over_ranks``)."""
        return run_warmup(self, eager=not self.expert_parallel, build_threads=self.build_threads,
                          built_before=self.prebuilt_shapes, agree=agree)

    # ------------------------------------------------------------------ host side
    def collect(self, pending: PendingLaunch) -> HostSamples:
        """Wait for ``pending``'s samples and hand them over as host lists (the request book
        lands them)."""
        self.device.wait_host(pending.event)
        step_time = None
        if pending.timing_events:
            s, e = pending.timing_events
            e.synchronize()
            step_time = s.elapsed_time(e) / 1000.0
        elif pending.launch_time and not self.device.is_cuda:
            step_time = time.perf_counter() - pending.launch_time
        with nvtx_range("active_request_mask"):
            return HostSamples(
                pending.host_tokens.tolist(),
                pending.host_log_probs.tolist() if pending.host_log_probs is not None else None,
                pending.host_top_n_ids.tolist() if pending.host_top_n_ids is not None else None,
                pending.host_top_n_vals.tolist() if pending.host_top_n_vals is not None else None,
                pending.host_accepted.tolist() if pending.host_accepted is not None else None,
                step_time, routed_experts=pending.routed_experts,
                prompt_scores=pending.prompt_scoring.collect() if pending.prompt_scoring is not None else None)
