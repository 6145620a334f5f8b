"""Grammar rows of a step: their requests' grammars and the token masks their sampling reads.

A launch with grammar rows is enqueued in two parts (model_runner.py): its forward, whose
logits wait in a device buffer, and, once the host filled the masks, its sampling. The masks
are filled as soon as the launch before lands (``start``: on a worker thread, once its tokens
are in the requests, while the engine thread reports and streams the landing and schedules and
assembles the next launch; the libraries fill without the GIL), and the
sampling is enqueued (``finish``) right before the next launch is, or before the launch itself
lands. Every launch before it has landed by ``start``, so each grammar is advanced by exactly
the tokens its request generated before the row's position: the state a serial engine has, so
constrained launch-ahead is token for token the serial engine. The device meanwhile runs the
forward. (The fill took 4.1 ms a step at 128 rows on an H100's host, more than its 3.7 ms step,
and the engine thread's own ~2 ms came on top of it.)

The worker needs the GIL between the libraries' calls (to start, after the landed tokens'
consume, after the masks). While the engine thread runs Python, a thread waiting for the GIL
gets it only after the switch interval, 5 ms by default: longer than the engine thread's work,
so the fill would only go on once the engine thread waits for it, the whole fill on the host's
step. While a fill is in flight the interval is at most ``FILL_SWITCH_INTERVAL_S`` (the one
before is restored when the last fill in flight in the process is taken: ``FillSwitchInterval``).

A request's grammar is built at admission from its validated spec (``attach``); a spec that
does not compile refuses the request at ``add_request`` with the library's message (``check``)."""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from megatron_async.config import Scheduling
from megatron_async.inference.request import DynamicInferenceRequest, InvalidRequestError, SamplingParams, Status
from megatron_async.inference.structured.grammars import Grammars, accept_landed, fill_masks
from megatron_async.inference.structured.spec import GrammarError

if TYPE_CHECKING:
    from megatron_async.inference.async_pipeline import PendingLaunch
    from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner

Failed = list[tuple[DynamicInferenceRequest, str]]
FILL_SWITCH_INTERVAL_S = 1e-4
"""GIL switch interval while a fill runs beside the engine thread (module doc)."""


class FillSwitchInterval:
    """The process's GIL switch interval (one setting, whatever engines share the process): at
    most FILL_SWITCH_INTERVAL_S while any fill is in flight, the one before once none is."""

    def __init__(self):
        self._lock, self._fills, self._before = threading.Lock(), 0, 0.0

    def fill_started(self) -> None:
        with self._lock:
            if self._fills == 0:
                self._before = sys.getswitchinterval()
                if self._before > FILL_SWITCH_INTERVAL_S:  # (a lower one is left as it is)
                    sys.setswitchinterval(FILL_SWITCH_INTERVAL_S)
            self._fills += 1

    def fill_taken(self) -> None:
        with self._lock:
            self._fills -= 1
            if self._fills == 0 and self._before > FILL_SWITCH_INTERVAL_S:
                sys.setswitchinterval(self._before)


SWITCH_INTERVAL = FillSwitchInterval()


class GrammarMasks:
    def __init__(self, config: Scheduling, tokenizer, eos_ids: tuple[int, ...], vocab_size: int):
        """``tokenizer``: the engine's (None: structured outputs are refused)."""
        self.enabled = config.structured_outputs_backend != "off"
        self.grammars = Grammars(tokenizer.backend_tokenizer if tokenizer is not None else None, eos_ids, vocab_size,
                                 "auto" if not self.enabled else config.structured_outputs_backend,
                                 config.grammar_threads)
        self.steps = 0
        """Launches whose sampling waited for grammar masks."""
        self.rows = 0
        """Constrained samples in them."""
        self.fill_seconds = 0.0
        """Host time advancing grammars and filling masks."""
        self.early_fills = 0
        """Launches whose masks were filled on the worker thread, beside the next scheduling."""
        self.wait_seconds = 0.0
        """Engine-thread time waiting for those fills to end."""
        self._job: tuple[PendingLaunch, Future] | None = None
        self._worker: ThreadPoolExecutor | None = None

    def check(self, sp: SamplingParams) -> None:
        """Refuse (InvalidRequestError) a request whose structured outputs cannot be served."""
        spec = sp.structured_outputs
        if spec is None:
            return
        if not self.enabled:
            raise InvalidRequestError("structured outputs are off in this engine (structured_outputs_backend='off')")
        if sp.ignore_eos:
            raise InvalidRequestError("structured outputs cannot be combined with ignore_eos (the grammar ends the output)")
        if sp.min_tokens:
            raise InvalidRequestError("structured outputs cannot be combined with min_tokens (the grammar decides the length)")
        try:
            self.grammars.validate(spec)
        except GrammarError as e:
            raise InvalidRequestError(str(e)) from None

    def attach(self, req: DynamicInferenceRequest) -> None:
        """Give an admitted request its grammar (its spec was checked)."""
        spec = req.sampling_params.structured_outputs
        if spec is not None and req.grammar is None:
            req.grammar = self.grammars.matcher(spec, stop_ids=sorted(req.eos_ids))

    def start(self, runner: ModelRunner, pending: PendingLaunch | None) -> None:
        """Fill ``pending``'s masks on the worker thread (the launch before it has landed)."""
        if pending is None or pending.awaiting_masks is None or self._job is not None:
            return
        bitmask, row_map = runner.mask_buffers(pending)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        SWITCH_INTERVAL.fill_started()
        self._job = (pending, self._worker.submit(self.fill, pending, bitmask, row_map))

    def close(self) -> None:
        """Wait for a fill in flight (its result is dropped: its launch is never sampled), give the
        process its switch interval back, and end the worker thread."""
        job, self._job = self._job, None
        if job is not None:
            try:
                job[1].exception()
            finally:
                SWITCH_INTERVAL.fill_taken()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def finish(self, runner: ModelRunner, pending: PendingLaunch | None) -> Failed:
        """Enqueue the sampling of ``pending`` if it awaits its masks (filled by ``start``'s job,
        else now). Returns the requests whose grammar refused a landed token, with the error."""
        if pending is None or pending.awaiting_masks is None:
            return []
        failed: Failed = []

        def fill(bitmask: torch.Tensor, row_map: torch.Tensor) -> int:
            job, self._job = self._job, None
            if job is not None:
                t0 = time.perf_counter()
                try:
                    num_rows, job_failed = job[1].result()  # the fill's error, if any, raises here
                finally:
                    SWITCH_INTERVAL.fill_taken()
                self.wait_seconds += time.perf_counter() - t0
                if job[0] is pending:
                    self.early_fills += 1
                    failed.extend(job_failed)
                    return num_rows
            num_rows, now_failed = self.fill(pending, bitmask, row_map)
            failed.extend(now_failed)
            return num_rows

        runner.finish_launch(pending, fill)
        return [(req, error) for req, error in failed if req.status != Status.FINISHED]  # ended meanwhile

    def fill(self, pending: PendingLaunch, bitmask: torch.Tensor, row_map: torch.Tensor) -> tuple[int, Failed]:
        """Advance the grammars of ``pending``'s sampling rows by their requests' landed tokens and
        write their masks: bitmask row g for the g-th constrained sample, ``row_map[sample] = g``
        (the caller set it to -1). A request whose grammar refuses a landed token is returned
        with the error (its row is left unmasked; the engine ends it). Returns the bitmask rows
        used and those requests."""
        t0 = time.perf_counter()
        rows = []  # (row index, request, its landed tokens the grammar has not seen)
        for i, row in enumerate(pending.rows):
            req = row.request
            g = req.grammar
            if g is None or not row.samples or req.status == Status.FINISHED:  # a finished request's row is discarded
                continue
            if row.start + row.num_tokens != req.num_known_tokens:
                raise RuntimeError(f"request {req.request_id}: a grammar row at position {row.start + row.num_tokens} "
                                   f"while {req.num_known_tokens} tokens are known (a launch before it has not landed)")
            rows.append((i, req, req.generated_tokens[g.num_accepted:]))
        landed = [r for r in rows if r[2]]
        ok = accept_landed([req.grammar for _, req, _ in landed], [new for _, _, new in landed])
        refused = {id(req) for (_, req, _), good in zip(landed, ok) if not good}
        grammars, base, failed, samples = [], pending.sample_base, [], []
        for i, req, _ in rows:
            if id(req) in refused:
                failed.append((req, "the grammar refused a sampled token: no token was allowed by both the grammar "
                                    "and the request's other token constraints"))
                continue
            samples.append(i if base is None else base[i])
            grammars.append(req.grammar)
        row_map.numpy()[samples] = range(len(samples))  # one write (a tensor item write is ~3 us, holding the GIL)
        fill_masks(grammars, list(range(len(grammars))), bitmask)
        self.steps += 1
        self.rows += len(grammars)
        self.fill_seconds += time.perf_counter() - t0
        return len(grammars), failed
