"""CUDA graphs for decode-only steps: one graph per (padded batch size, sampling variant).

A captured graph is the whole device side of a decode step after the H2D copy: the
gather of the previous samples into input ids, the forward, sampling, log-probs and the
write of the samples into ``last_samples`` — all reading the fixed-address
``ContextGPUView``. Launch-ahead replays therefore chain back to back: the host only
copies the next snapshot and replays. Rows beyond the real batch are padding rows that
write to the dummy KV block (and the padding Mamba slot)."""
from __future__ import annotations

import bisect
import gc
from dataclasses import dataclass

import torch

from megatron_async.config import InferenceConfig
from megatron_async.inference.contexts.dynamic_context import StepShape


def default_batch_sizes(max_requests: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_requests]
    sizes += list(range(16, max_requests + 1, 16))
    if sizes[-1] != max_requests:
        sizes.append(max_requests)
    return sizes


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    num_rows: int
    out: tuple

    def replay(self) -> None:
        self.graph.replay()

    def outputs(self, num_rows: int):
        tokens, lp, tv, ti = self.out
        cut = lambda t: None if t is None else t[:num_rows]  # noqa: E731
        return cut(tokens), cut(lp), cut(tv), cut(ti)


GREEDY_VARIANT = (False, (False, False, False), False, 0, False)
"""The key of a greedy decode graph after its padded size (no sampling, filters, log-probs, penalties)."""


class CudaGraphRunner:
    def __init__(self, controller, config: InferenceConfig, collective: bool = False):
        """``collective``: data-parallel engines (expert parallelism). The graphs hold MoE
        collectives across ranks that run different batches, and NCCL requires graph-captured
        vs eager to be the same on every rank of a launch, with graphs of one joint capture: so
        only the graphs ``warmup`` captured on every rank at once are replayed, a missing one is
        an error (never a capture on one rank alone), and a rank with nothing to launch replays
        the agreed graph on padding rows (``replay_padding``)."""
        self.controller = controller
        self.config = config
        self.collective = collective
        self.sizes = sorted(config.cuda_graph_batch_sizes or default_batch_sizes(config.max_requests))
        self.graphs: dict[tuple, CapturedStep] = {}
        self._pool = None
        self.num_replays = 0
        self.num_padding_replays = 0
        """Dummy forwards of data-parallel engines that replayed a graph on padding rows."""

    def padded_rows(self, num_rows: int) -> int | None:
        """The captured batch size a step of ``num_rows`` decode rows replays (None: too large)."""
        if num_rows > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    def would_replay(self, plan) -> bool:
        """Data-parallel engines: a plan (before assembly) whose step can replay a graph that
        ``warmup`` captured on every rank at once: greedy decode without log-probs or penalties
        (the shape's key is then ``(padded, *GREEDY_VARIANT)``). Other variants run eager."""
        def plain_greedy(sp) -> bool:
            return sp.is_greedy and not sp.return_log_probs and sp.top_n_logprobs == 0 and not sp.has_penalties
        padded = self.padded_rows(len(plan.rows))
        return (plan.is_decode_only and padded is not None and (padded, *GREEDY_VARIANT) in self.graphs
                and all(plain_greedy(r.request.sampling_params) for r in plan.rows))

    def key(self, shape: StepShape, min_rows: int = 0) -> tuple | None:
        """``min_rows``: pad at least to this many rows (data-parallel ranks pad to the agreed size)."""
        padded = self.padded_rows(max(shape.num_rows, min_rows))
        if not shape.is_decode_only or padded is None:
            return None
        return (padded, shape.any_sampling, shape.filters, shape.any_log_probs or shape.max_top_n > 0,
                shape.max_top_n, shape.any_penalties)

    def lookup(self, shape: StepShape, min_rows: int = 0) -> CapturedStep | None:
        key = self.key(shape, min_rows)
        step = self.graphs.get(key) if key is not None else None
        if step is None and self.collective:  # the ranks agreed on a replay: a bug, say so before a hang
            raise RuntimeError(f"data-parallel ranks agreed to replay CUDA graphs, but this rank's step "
                               f"(key {key}, {shape.num_rows} rows, padded to >= {min_rows}) has no graph that "
                               f"every rank captured at once ({sorted(self.graphs)})")
        if key is None:
            return None
        if step is None:
            step = self.graphs[key] = self._capture(key)
        self.num_replays += 1
        return step

    def replay_padding(self, num_rows: int) -> int:
        """Data-parallel engines, a rank with nothing to launch in a step the others replay:
        replay the greedy graph those ranks replay (padded size of ``num_rows``) on padding rows,
        so its collectives are graph-captured like theirs. The controller has already put a
        padding snapshot in the view; the graph's samples are discarded. Returns the rows."""
        b = self.padded_rows(num_rows)
        step = self.graphs.get((b, *GREEDY_VARIANT)) if b is not None else None
        if step is None:
            raise RuntimeError(f"no greedy CUDA graph for a dummy step of {num_rows} rows "
                               f"(captured: {sorted(self.graphs)})")
        step.replay()
        self.num_padding_replays += 1
        return b

    def release(self) -> None:
        """Destroy every captured graph (before the process group: NCCL's communicator cannot be
        destroyed while a graph holding its collectives exists)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for step in self.graphs.values():
            if isinstance(step, CapturedStep):  # explicit: a step someone still holds must not keep it alive
                step.graph.reset()
        self.graphs.clear()
        self._pool = None
        gc.collect()  # CUDAGraph objects in reference cycles too
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def warmup(self, greedy_only: bool = True) -> None:
        """Capture the greedy decode graphs of every batch size up front."""
        for b in self.sizes:
            key = (b, *GREEDY_VARIANT)
            if key not in self.graphs:
                self.graphs[key] = self._capture(key)

    def capture_shape(self, key: tuple) -> StepShape:
        """The decode shape a graph of ``key`` is captured with."""
        b, any_sampling, filters, any_lp, top_n, any_penalties = key
        return StepShape(
            num_tokens=b, num_rows=b, max_query_len=1, max_kv_len=self.config.max_sequence_length,
            is_decode_only=True, any_sampling=any_sampling, any_top_k_top_p=any(filters), filters=filters,
            max_top_n=top_n, any_log_probs=any_lp, any_penalties=any_penalties,
        )

    def _capture(self, key: tuple) -> CapturedStep:
        b, any_penalties = key[0], key[-1]
        ctl, ctx = self.controller, self.controller.context
        shape = self.capture_shape(key)
        if any_penalties:
            ctx.sampling_state.ensure_allocated()
        # Capture runs on a padding-only snapshot (dummy block, padding slot); the samples of
        # the launch in flight are kept aside because warm-up runs overwrite them.
        torch.cuda.synchronize()
        ctl.dp_num_tokens = 0  # MoE exchanges pad to the graph's rows (a stale agreement must not leak in)
        saved_samples = ctl.last_samples.clone()
        saved_view = ctx.gpu_view.buffer.clone()
        ctx.gpu_view.buffer.copy_(ctx.padding_snapshot(b))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                ctl.compute_step(shape)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread keeps polling events while a TP / EP graph with
        # collectives is captured; "global" mode would turn those polls into capture errors.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = ctl.compute_step(shape)
        self._pool = graph.pool()
        ctl.last_samples.copy_(saved_samples)
        ctx.gpu_view.buffer.copy_(saved_view)
        torch.cuda.synchronize()
        return CapturedStep(graph, b, out)
