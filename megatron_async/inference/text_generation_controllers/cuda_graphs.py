"""CUDA graphs of steps: one replay per ``GraphKey`` of the ``GraphPlan`` (graph_plan.py).

A step's replay is the whole device side of a step after the H2D copy: the gather of the
previous samples into input ids, the forward, sampling, log-probs and the write of the samples
into ``last_samples``, all reading the fixed-address ``ContextGPUView``. Launch-ahead replays
therefore chain back to back: the host only copies the next snapshot and replays. A plain
engine's decode and mixed steps replay two graphs: the forward of their sizes (the logits-only
graph, shared by every sampling variant) and the variant's sampling tail, which reads the
forward's logits from the buffer the logits-only graphs share (``split_sampling``; data-parallel
engines too: their collectives are all in the forward); speculative engines capture whole steps.

Decode graphs pad rows to a captured batch size; mixed graphs (prefill chunks + decode rows)
pad tokens to a captured token count and rows to the key's rows, the spare rows holding the
padding tokens. Padding writes K/V only to the dummy block (and the padding Mamba slot); the
varlen attention kernel reads every row's query span from ``cu_query_lens`` in the snapshot, and
its launch grid depends only on the padded sizes, so one capture serves any ragged batch.
Verify graphs (speculative decoding) take decode rows laid out W tokens and samples each
(graph_plan.py): the drafts' gather, the position correction of a launch in flight, the
forward (Mamba windows included), sampling, acceptance, the commit of the accepted Mamba
states and the drafter's proposal (n-gram lookup, MTP heads' forward) are all inside.

``emulate=True`` (CPU tests only): no capture; a replay runs the same padded step eagerly,
so the padding logic is checked where no graphs exist."""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

import torch

from megatron_async.config import GraphSizing
from megatron_async.inference.text_generation_controllers.capture_agreement import GraphCaptureFailed, capture_together
from megatron_async.inference.text_generation_controllers.graph_plan import (
    GraphKey, GraphPlan, SamplingVariant, splits_sampling, variant_flags, variant_index, variant_of_params,
)
from megatron_async.inference.text_generation_controllers.kernel_prebuild import caches_kept, end_failed_capture
from megatron_async.inference.text_generation_controllers.prompt_scoring import wants_prompt_scoring
from megatron_async.step_shape import StepShape

log = logging.getLogger("megatron_async")


@dataclass
class CapturedStep:
    key: GraphKey
    graph: torch.cuda.CUDAGraph | None
    shape: StepShape
    out: tuple | None = None
    runner: object | None = None  # emulation: the model runner whose compute_step a replay runs
    forward: CapturedStep | None = None
    """A sampling tail's forward: the logits-only graph of the step's sizes, replayed first (the
    forward is captured once per size, not once per sampling variant: ``CudaGraphRunner``)."""
    _views: tuple | None = field(default=None, repr=False, compare=False)
    """(the ``out`` they slice, {(samples, log-probs, top-n): ``outputs``' views}): a tensor slice
    costs tens of microseconds of Python inside a step, and a captured graph's outputs stay put."""

    @property
    def num_rows(self) -> int:
        return self.key.num_rows

    def replay(self) -> None:
        if self.forward is not None:
            self.forward.replay()
        if self.graph is not None:
            self.graph.replay()
        elif self.key.logits_only:
            self.out = (self.runner.graph_logits(self.shape),)
        elif self.forward is not None:
            self.out = self.runner.sample_tail(self.shape, self.forward.logits(self.shape.num_samples))
        else:
            self.out = self.runner.compute_step(self.shape, self.key.spec)

    def logits(self, num_samples: int):
        """A logits-only graph's output: the real samples' logits, as ``ModelRunner.forward_logits`` returns them."""
        from megatron_async.inference.text_generation_controllers.model_runner import StepLogits

        return StepLogits(self.out[0][:num_samples], None, None, None, False)

    def outputs(self, num_samples: int, log_probs: bool, top_n: int):
        """The real samples' tokens (one per real row; verify graphs: K + 1 per real row), and
        the log-probs / top-n the step asked for (a larger variant computes more: what no row
        asked for is not copied to the host)."""
        key = (num_samples, bool(log_probs or top_n), top_n)
        if self._views is None or self._views[0] is not self.out:
            self._views = (self.out, {})
        views = self._views[1].get(key)
        if views is None:
            views = self._views[1][key] = self._slice_outputs(num_samples, log_probs, top_n)
        return views

    def _slice_outputs(self, num_samples: int, log_probs: bool, top_n: int):
        tokens, lp, tv, ti = self.out
        n = num_samples
        lp = lp[:n] if lp is not None and (log_probs or top_n) else None
        if tv is None or top_n == 0:
            return tokens[:n], lp, None, None
        return tokens[:n], lp, tv[:n, :top_n], ti[:n, :top_n]


def graph_shape(key: GraphKey, max_sequence_length: int, vocab_size: int) -> StepShape:
    """The StepShape a key's graph is captured with (upper bounds for the length fields)."""
    f = variant_flags(key.variant, vocab_size, key.log_probs)
    W, R = key.verify_width, key.num_rows
    verify = dict(num_samples=R * W, sample_base=list(range(0, R * W, W)), num_drafts=[W - 1] * R,
                  verify_width=W) if W else {}
    max_query_len = 1 if key.decode_only else W or key.num_tokens
    return StepShape(
        num_tokens=key.num_tokens, num_rows=R, max_query_len=max_query_len,
        max_kv_len=max_sequence_length, is_decode_only=key.decode_only, any_sampling=f.any_sampling,
        any_top_k_top_p=any(f.filters), filters=f.filters, max_top_n=f.max_top_n, any_log_probs=f.any_log_probs,
        any_penalties=f.any_penalties, any_lora=not key.no_lora, long_tiles=key.long_tiles, **verify,
    )


def decode_key(rows: int, variant: SamplingVariant = SamplingVariant.GREEDY, spec: bool = False) -> GraphKey:
    """The key of the decode graph of ``rows`` (padded) rows and a sampling variant (``spec``:
    with speculative decoding's machinery)."""
    return GraphKey(rows, rows, True, variant, spec=spec)


class CudaGraphRunner:
    def __init__(self, model_runner, config: GraphSizing, mixed: bool = False,
                 variants: tuple[SamplingVariant, ...] = tuple(SamplingVariant), emulate: bool = False,
                 collective: bool = False, verify: bool = True, logits_only: bool = False, lora_free: bool = False,
                 long_tile_min: int = 0):
        """``collective``: data-parallel engines (expert parallelism). The graphs hold MoE
        collectives across ranks that run different batches, and NCCL requires graph-captured
        vs eager to be the same on every rank of a launch, with graphs of one joint capture: so
        every rank replays a graph of the size the agreed token count gives and the largest
        sampling variant any rank needs (``replay_variant``; a larger variant draws the same
        tokens; no log-prob twins: a log-prob step replays FULL): a decode graph while every
        rank's launch fits a decode batch, else the mixed graph of that count (FULL only,
        ``GraphPlan.collective_mixed_tokens``; ranks with decode rows replay it too, so a
        prefill chunk anywhere no longer sends every rank to eager); no verify graphs, and no
        mixed ones under speculative decoding. Only the graphs ``warmup`` captured on every
        rank at once are replayed, a missing one is an error (never a capture on one rank
        alone), and a rank with nothing to launch replays the agreed graph on padding rows
        (``replay_padding``).
        ``verify``: verify graphs when speculative decoding is on. Speculative engines also
        capture plain decode and mixed graphs (speculative/plain_steps.py), except data-parallel ones
        (every rank runs the drafter's collectives in every step). ``logits_only``: logits-only
        graphs for steps with grammar rows (graph_plan.py; not for data-parallel engines).
        ``lora_free``: LoRA-free twins of the decode graphs (``GraphKey.no_lora``). ``long_tile_min``:
        long-tile twins of the mixed graphs of at least that many tokens (``GraphKey.long_tiles``)."""
        self.model_runner = model_runner
        self.config = config
        self.collective = collective
        if collective:  # mixed graphs would run the drafter's collectives: not under speculative decoding
            mixed, verify = mixed and config.num_speculative_tokens == 0, False
        self.split_sampling = splits_sampling(config)
        """A plain engine's decode and mixed graphs are a forward graph per size (the logits-only
        one) and a sampling tail per variant replayed after it: the forward, nearly all of a
        capture's time, is captured once per size instead of once per variant and log-prob twin
        (0.6B main job: 37 forwards and 184 tails instead of 221 whole steps; Qwen3-30B-A3B under
        EP: 33 forwards instead of 81 whole steps). Data-parallel engines too: every collective is
        in the forward, which every rank replays at the agreed size; a tail holds none.
        Speculative engines (the drafter reads the forward's hidden states) keep whole steps.
        The forwards are the plan's logits-only keys, whether or not a grammar library is there."""
        self.plan = GraphPlan(config, model_runner.model.vocab_size, mixed, variants, verify,
                              plain_steps=not collective, log_prob_twins=not collective,
                              logits_only=logits_only and not collective or self.split_sampling,
                              collective=collective, lora_free=lora_free, long_tile_min=long_tile_min)
        self.graphs: dict[GraphKey, CapturedStep] = {}
        self.emulate = emulate
        self._pool = None
        self._side = None
        """The stream of every capture's eager run: one for all of them, so that the blocks one run
        frees are the next run's (the allocator reuses a block only on the stream that freed it;
        a stream per capture left ~7 GiB cached and unusable over 184 captures on an H100)."""
        self.num_replays = 0
        self.num_mixed_replays = 0
        self.num_verify_replays = 0
        """Speculative verify steps that replayed a verify graph."""
        self.num_lora_free_replays = 0
        """Steps that replayed a LoRA-free graph (``GraphKey.no_lora``)."""
        self.num_long_tile_replays = 0
        """Steps that replayed a long-tile mixed graph (``GraphKey.long_tiles``)."""
        self.num_padding_replays = 0
        """Dummy forwards of data-parallel engines that replayed a graph on padding rows."""
        self._without_eager_run: set[GraphKey] = set()
        """Keys of the graphs held that were captured with no eager run of their step first."""
        self.capture_retries = 0
        """Graphs captured again after an eager run because a capture without one failed (on this
        rank, or on any rank of ranks sharing steps: capture_agreement.py)."""
        self.captures_after_warmup = 0
        """Graphs captured while serving (a key warm-up did not cover); 0 after a full warm-up."""
        self.warmed_up = False

    @property
    def sizes(self) -> list[int]:
        return self.plan.decode_sizes

    def padded_rows(self, num_rows: int) -> int | None:
        """The captured batch size a decode step of ``num_rows`` rows replays (None: too large)."""
        sizes = self.plan.decode_sizes
        return next((b for b in sizes if b >= num_rows), None)

    def replay_variant(self, plan) -> int | None:
        """Data-parallel engines: the sampling variant (``variant_index``) a plan's step needs
        (before assembly) if it can replay a graph that ``warmup`` captured on every rank at
        once, else None (eager). The ranks then replay the largest variant any of them needs."""
        variant = variant_of_params(r.request.sampling_params for r in plan.rows)
        if variant is None:
            return None
        if not plan.is_decode_only:  # prefill chunks: the mixed graph of at least their tokens, if any
            key = self.plan.collective_mixed_key(plan.num_tokens)
            if key is None or wants_prompt_scoring(plan) or key not in self.graphs:
                return None
            return variant_index(key.variant)
        padded = self.padded_rows(len(plan.rows))
        if padded is None:
            return None
        # a larger variant the others may agree on is captured whenever this one is (warm-up takes them all)
        key = decode_key(padded, variant, self.plan.speculative)
        return variant_index(variant) if key in self.graphs else None

    def lookup(self, shape: StepShape, min_rows: int = 0, min_variant: int = 0,
               spec: bool | None = None) -> CapturedStep | None:
        """``spec``: the step runs speculative decoding's machinery (None: whenever it is on)."""
        key = self.plan.key(shape, min_rows, min_variant, spec)
        step = self.graphs.get(key) if key is not None else None
        if step is None and self.collective:  # the ranks agreed on a replay: a bug, say so before a hang
            raise RuntimeError(f"data-parallel ranks agreed to replay CUDA graphs, but this rank's step "
                               f"(key {key}, {shape.num_rows} rows, padded to >= {min_rows}) has no graph that "
                               f"every rank captured at once ({sorted(self.graphs, key=str)})")
        if key is None:
            return None
        if step is None:
            step = self.graphs[key] = self._capture(key)
            self.captures_after_warmup += self.warmed_up
        self.num_replays += 1
        self.num_mixed_replays += not key.decode_only and not key.verify_width
        self.num_verify_replays += bool(key.verify_width)
        self.num_lora_free_replays += key.no_lora
        self.num_long_tile_replays += key.long_tiles
        return step

    def padding_key(self, num_tokens: int, variant: int = 0) -> GraphKey:
        """Data-parallel engines, a rank with nothing to launch in a step the others replay: the
        graph those ranks replay (the agreed token count and sampling variant), which it replays
        on padding rows (``replay_padding``) so its collectives are graph-captured like theirs."""
        kind = list(SamplingVariant)[variant]
        key = self.plan.collective_mixed_key(num_tokens)
        if key is None:
            b = self.padded_rows(num_tokens)
            key = decode_key(b, kind, self.plan.speculative) if b is not None else None
        if key is None or key not in self.graphs:
            raise RuntimeError(f"no {kind.value} CUDA graph for a dummy step of {num_tokens} tokens "
                               f"(captured: {sorted(self.graphs, key=str)})")
        return key

    def replay_padding(self, key: GraphKey) -> None:
        """Replay ``padding_key``'s graph; the model runner has already put a padding snapshot of
        its rows and tokens in the view; the graph's samples are discarded."""
        self.graphs[key].replay()
        self.num_padding_replays += 1

    def release(self) -> None:
        """Destroy every captured graph (before the process group: NCCL's communicator cannot be
        destroyed while a graph holding its collectives exists)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for step in self.graphs.values():
            # explicit: a step someone still holds must not keep it alive (emulated steps hold none)
            if isinstance(step, CapturedStep) and step.graph is not None:
                step.graph.reset()
        self.graphs.clear()
        self._pool = None
        gc.collect()  # CUDAGraph objects in reference cycles too
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def warmup(self, keys: list[GraphKey] | None = None, built: bool = False, agree=None) -> int:
        """Capture ``keys`` (default: the whole plan) not captured yet; returns how many graphs
        (the forwards of sampling tails included).
        TP ranks and data-parallel engines call it on every rank at once (collectives inside the
        captures). ``built``: every kernel the steps launch is built and loaded, and steps capture
        without running first (the warm-up's dry pass captured its shapes so): each graph is
        captured without its eager run (one that fails to is captured again after one). ``agree``:
        the element-wise max of a list of ints over the ranks sharing steps (host-side, every rank
        at once): a failed capture is then captured again by every rank together, since a retry's
        eager run needs every rank (capture_agreement.py); without it a collective runner keeps
        every eager run."""
        before = len(self.graphs)
        gc.collect()  # garbage from earlier engines (their graphs) goes now, not inside a capture
        suspendable = self.model_runner.context.device.suspend_backend is not None  # its pool: after a run
        built = built and (agree is not None or not self.collective)
        runs_first = lambda: not built or self._pool is None or suspendable  # noqa: E731 -- the first capture makes the pool
        keys = [k for k in (self.plan.keys() if keys is None else keys) if k not in self.graphs]
        with caches_kept():
            if agree is not None:  # TP / EP ranks: a failed capture is captured again by every rank together
                capture_together(self, keys, runs_first, agree)
            else:
                for key in keys:
                    if key not in self.graphs:
                        self.graphs[key] = self._capture(key, eager_run=runs_first())
        self.warmed_up = True
        return len(self.graphs) - before

    def drop(self, key: GraphKey) -> None:
        """Forget ``key``'s graph (a collective retry: every rank captures it again)."""
        step = self.graphs.pop(key, None)
        self._without_eager_run.discard(key)
        if getattr(step, "graph", None) is not None:
            step.graph.reset()

    def counted_without_eager_run(self, key: GraphKey) -> None:
        """``key``'s graph was captured without an eager run first."""
        self._without_eager_run.add(key)

    @property
    def captures_without_eager_run(self) -> int:
        """Graphs held that were captured with no eager run of their step first (a built warm-up's,
        ``warmup``)."""
        return len(self._without_eager_run)

    def capture_shape(self, key: GraphKey) -> StepShape:
        """The StepShape a graph of ``key`` is captured with."""
        return graph_shape(key, self.config.max_sequence_length, self.model_runner.model.vocab_size)

    def forward_key(self, key: GraphKey) -> GraphKey | None:
        """The logits-only graph whose logits ``key``'s sampling tail reads (None: ``key``'s graph
        is a whole step)."""
        if not self.split_sampling or key.logits_only or key.spec or key.verify_width:
            return None
        return GraphKey(key.num_tokens, key.num_rows, key.decode_only, SamplingVariant.GREEDY, logits_only=True,
                        no_lora=key.no_lora, long_tiles=key.long_tiles)

    def _capture(self, key: GraphKey, eager_run: bool = True, alone: bool = True) -> CapturedStep:
        """``alone``: a capture without an eager run that fails is captured again here after one
        (else ``GraphCaptureFailed`` is raised, its state undone: the ranks retry together)."""
        ctl, ctx = self.model_runner, self.model_runner.context
        shape = self.capture_shape(key)
        if shape.any_penalties:
            ctx.sampling_state.ensure_allocated()
        fkey = self.forward_key(key)
        forward = None
        if fkey is not None:
            forward = self.graphs.get(fkey)
            if forward is None:
                forward = self.graphs[fkey] = self._capture(fkey, eager_run, alone)
        if self.emulate:
            return CapturedStep(key, None, shape, runner=ctl, forward=forward)
        # An eager run runs on a padding-only snapshot (dummy block, padding slot; a capture alone
        # runs nothing, so the view's contents do not matter to it); the samples of the launch in
        # flight are kept aside because warm-up runs overwrite them.
        torch.cuda.synchronize()
        saved_samples = ctl.last_samples.clone()
        saved_view = ctx.gpu_view.buffer.clone()
        if eager_run:
            ctx.gpu_view.buffer.copy_(ctx.padding_snapshot(key.num_rows, key.num_tokens, key.verify_width))
        if self._side is None:
            self._side = torch.cuda.Stream()
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        if key.logits_only:
            body = lambda: (ctl.graph_logits(shape),)  # noqa: E731
        elif forward is not None:  # the sampling tail of the forward graph's logits
            body = lambda: ctl.sample_tail(shape, forward.logits(shape.num_samples))  # noqa: E731
        else:
            body = lambda: ctl.compute_step(shape, key.spec)  # noqa: E731
        if eager_run:
            with torch.cuda.stream(side):  # once: builds and loads what the step needs, outside the capture
                body()
            torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No cyclic GC inside a capture: collecting an earlier engine's CUDA graphs there frees
        # their memory, which invalidates the capture (seen once in the GPU suite, a graph
        # test right after another one). torch's graph context no longer collects on entry.
        gc_on = gc.isenabled()
        gc.disable()
        try:
            # thread_local: NCCL's watchdog thread keeps polling events while a TP / EP graph with
            # collectives is captured; "global" mode would turn those polls into capture errors.
            with ctx.device.graph_capture(graph, self._pool, "thread_local"):  # suspendable pool if enabled
                out = body()
        except Exception as e:  # noqa: BLE001 -- without its eager run: capture it again after one
            if eager_run:
                raise
            end_failed_capture(self._pool)
            del graph
            ctx.gpu_view.buffer.copy_(saved_view)
            if not alone:
                raise GraphCaptureFailed(key, e) from e
            log.warning("CUDA graph %s failed to capture without an eager run first (%s); capturing it after one",
                        key, e)
            self.capture_retries += 1
            return self._capture(key, eager_run=True)
        finally:
            if gc_on:
                gc.enable()
        self._pool = graph.pool()
        if not eager_run:
            self.counted_without_eager_run(key)
        ctl.last_samples.copy_(saved_samples)
        ctx.gpu_view.buffer.copy_(saved_view)
        torch.cuda.synchronize()
        return CapturedStep(key, graph, shape, out, forward=forward)
