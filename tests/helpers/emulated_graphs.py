"""CUDA graphs emulated on the CPU, for multi-rank engine tests (gloo): the real
``CudaGraphRunner`` decisions (which size, which key, capture or replay) with a "graph" that
re-runs its body on the current GPU view at replay time, which is what a real replay computes:
a whole step (``compute_step``), or for runners that split sampling, a forward (``graph_logits``,
every collective) and a sampling tail after it (``sample_tail``). Every expert-parallel
collective is logged with the mode it ran in, so a test can check what NCCL requires: whether a
launch is graph-captured is a collective property, so all ranks must replay graphs of one
capture, of one size, or all run eager, step by step; ``EmulatedGraphRunner.replayed`` lists the
keys replayed (tails and whole steps; not forwards)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_async.inference.text_generation_controllers.capture_agreement import GraphCaptureFailed
from megatron_async.inference.text_generation_controllers.cuda_graphs import CapturedStep, CudaGraphRunner
from megatron_async.inference.text_generation_controllers.graph_plan import GraphKey
from megatron_async.models.layers import moe


@dataclass
class EmulatedStep:
    runner: EmulatedGraphRunner
    key: GraphKey
    num_rows: int
    forward: EmulatedStep | None = None
    """A sampling tail's forward (replayed first)."""
    out: tuple = ()
    _views: tuple | None = None  # CapturedStep.outputs' views of ``out``

    def replay(self) -> None:
        ctl, shape = self.runner.model_runner, self.runner.capture_shape(self.key)
        if self.forward is not None:
            self.forward.replay()
            self.out = ctl.sample_tail(shape, self.forward.logits(shape.num_samples))
        else:
            self.runner.mode = f"graph{self.key}"
            try:
                self.out = (ctl.graph_logits(shape),) if self.key.logits_only else ctl.compute_step(shape, self.key.spec)
            finally:
                self.runner.mode = "eager"
        if not self.key.logits_only:
            self.runner.replayed.append(self.key)

    outputs = CapturedStep.outputs
    _slice_outputs = CapturedStep._slice_outputs
    logits = CapturedStep.logits


class EmulatedGraphRunner(CudaGraphRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mode = "eager"
        self.captures: list[GraphKey] = []
        """Keys in capture order."""
        self.fail_next: set[GraphKey] = set()
        """Keys whose next capture without an eager run fails on this rank (then leaves the set)."""
        self.failed: list[GraphKey] = []
        """Keys whose capture failed here, in order."""
        self.replayed: list[GraphKey] = []
        """Keys replayed (whole steps and sampling tails), in order."""

    def _capture(self, key: GraphKey, eager_run: bool = True, alone: bool = True) -> EmulatedStep:
        """Like the real capture: with ``eager_run``, two eager warm-up runs on padding rows (their
        collectives are real), the samples and the view restored afterwards; without, nothing
        runs (a capture records, it executes nothing: no collective), and a key in ``fail_next``
        fails as a real capture does (``GraphCaptureFailed``, or captured again after an eager
        run on this rank ``alone``). The first capture makes the shared pool."""
        if not eager_run and key in self.fail_next:
            self.fail_next.discard(key)
            self.failed.append(key)
            if not alone:
                raise GraphCaptureFailed(key, RuntimeError("a capture failed on purpose"))
            self.capture_retries += 1
            return self._capture(key, eager_run=True)
        ctl, ctx = self.model_runner, self.model_runner.context
        shape, fkey, forward = self.capture_shape(key), self.forward_key(key), None
        if fkey is not None:  # a sampling tail (TP ranks' plain engines): its forward's graph first
            forward = self.graphs.get(fkey)
            if forward is None:
                forward = self.graphs[fkey] = self._capture(fkey, eager_run, alone)
        self.captures.append(key)
        if shape.any_penalties:
            ctx.sampling_state.ensure_allocated()
        if eager_run and forward is None:  # a tail runs no collective
            saved_samples, saved_view = ctl.last_samples.clone(), ctx.gpu_view.buffer.clone()
            ctx.gpu_view.buffer.copy_(ctx.padding_snapshot(key.num_rows, key.num_tokens, key.verify_width))
            self.mode = f"capture{key}"
            try:
                for _ in range(2):
                    ctl.graph_logits(shape) if key.logits_only else ctl.compute_step(shape, key.spec)
            finally:
                self.mode = "eager"
            ctl.last_samples.copy_(saved_samples)
            ctx.gpu_view.buffer.copy_(saved_view)
        if not eager_run:
            self.counted_without_eager_run(key)
        self._pool = "emulated"
        return EmulatedStep(self, key, key.num_rows, forward)


@dataclass
class CollectiveLog:
    """Every call of a collective on this rank, (mode, size): by default the MoE layers'
    ``ep_all_gather`` (size: rows per rank); ``AllReduceLog``: TP's ``all_reduce`` (elements)."""
    runner: EmulatedGraphRunner
    calls: list[tuple[str, int]] = field(default_factory=list)
    module: object = moe
    name: str = "ep_all_gather"

    def __post_init__(self):
        inner = getattr(self.module, self.name)

        def logged(x: torch.Tensor, *args, **kwargs):
            self.calls.append((self.runner.mode, int(x.shape[0] if self.module is moe else x.numel())))
            return inner(x, *args, **kwargs)

        setattr(self.module, self.name, logged)  # the spawned rank's own module: nothing else shares it


def AllReduceLog(runner: EmulatedGraphRunner) -> CollectiveLog:  # noqa: N802 -- reads as the log's kind
    import torch.distributed as dist

    return CollectiveLog(runner, module=dist, name="all_reduce")
