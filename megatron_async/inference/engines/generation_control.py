"""What pauses and resumes generation, suspends and restores device memory, and switches the
weights' version while requests live: the work behind the engine's ``pause_generation`` /
``resume_generation``, ``suspend`` / ``resume`` and ``set_weight_version``, and the ``step()``
taken while paused.

Bound to its engine like a rank role (rank_roles.py): it reads the engine's pause mode and the
launch in flight, lands that launch through the engine's ``_land``, and changes the pause mode
only through ``ranks.pause`` (at once for an engine alone, at the next per-step exchange where
ranks share steps). Device memory is the engine's ``MemorySuspender`` (suspend.py)."""
from __future__ import annotations

import time

from megatron_async.inference.engines.step_result import StepResult
from megatron_async.inference.engines.suspend import SuspendError
from megatron_async.inference.step_plan import StepPlan


class GenerationControl:
    def __init__(self, engine):
        """``engine``: the DynamicInferenceEngine it serves (not annotated: the engine imports
        this module)."""
        self.engine = engine

    def pause_generation(self, mode: str) -> None:
        """Stop generating until ``resume_generation``. ``"abort"``: every unfinished request
        ends with finish_reason "abort" (outputs in the next ``step()``); ``"wait"``: no new
        admissions, running requests (evicted ones too) run to their end; ``"keep"``: the
        in-flight launch lands at the next ``step()``, then nothing runs; requests keep their KV
        and continue, token-identically, after resuming. While paused ``add_request`` still queues, and a
        ``step()`` with nothing to land does no device work and returns an empty result
        (``EngineStats.paused_steps``).

        Under TP / EP only rank 0 calls it; every rank applies it at the same per-step exchange
        (the next ``step()``'s, or an idle check's), and ``is_paused`` turns True on every rank
        there; what is in flight has landed when the ``step()`` after that returns."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"unknown pause mode {mode!r}: use 'abort', 'wait' or 'keep'")
        if mode == "wait":  # running requests would step on suspended memory
            self.engine.memory.check_can_generate()
        self.engine.ranks.pause(mode)

    def resume_generation(self) -> None:
        """Generate again after ``pause_generation`` (no-op when not paused). Under TP / EP, as
        ``pause_generation``: rank 0 calls it, every rank applies it at the next exchange; while
        any rank's memory is still suspended, every rank's ``step()`` raises ``SuspendError``."""
        self.engine.memory.check_can_generate()
        self.engine.ranks.pause(None)

    def generation_blocked(self) -> str | None:
        """Why a request added now would neither run nor wait (None: it runs, or waits under a
        pause): the device memory is suspended, or the weights were dropped, while generation is
        not paused in "keep" / "abort" (then ``step()`` raises ``SuspendError``). Under such a pause
        requests queue until ``resume`` and ``resume_generation``. This rank's memory only: under
        TP / EP every rank suspends and resumes together."""
        if self.engine._pause in ("keep", "abort"):
            return None
        try:
            self.engine.memory.check_can_generate()
        except SuspendError as e:
            return str(e)
        return None

    def suspend(self, tags, keep_weights_on_host: bool) -> None:
        """Free device memory by tag ("weights": the parameters; "kv_cache": the KV pool, the
        Mamba state pools and the CUDA graph pools) for a colocated trainer; needs
        ``InferenceConfig.enable_suspend``, and while requests are unfinished
        ``pause_generation("keep")`` (or "abort") with the in-flight launch landed. An idle engine
        needs no pause (``step()`` then raises ``SuspendError`` until ``resume``: a request added
        meanwhile waits only under a pause). Running requests keep their KV (copied to host memory) and
        continue token-identically after ``resume``. ``keep_weights_on_host=False`` drops the
        weights: refill them with ``update_weights`` after ``resume(("weights",))`` and before
        ``resume(("kv_cache",))``. Wrong orders raise ``SuspendError`` and change nothing
        (suspend.py). Under TP / EP every rank calls it (and ``resume``), like
        ``update_weights``: each frees its own memory, once ``is_paused`` and the step after it
        landed the in-flight launch there; paused exchanges are host-only."""
        eng = self.engine
        eng.memory.check_enabled()
        if eng._pause not in ("keep", "abort") and (eng._requests or eng._pending is not None):
            raise SuspendError(f"suspend while generating ({len(eng._requests)} unfinished requests): "
                               "pause_generation('keep') first")
        if eng._pending is not None:
            raise SuspendError("a launch is in flight: step() once after pause_generation to land it, then suspend")
        eng.memory.suspend(tags, keep_weights_on_host)

    def resume(self, tags) -> None:
        """Give back the device memory of ``tags`` freed by ``suspend`` (same addresses: captured
        graphs replay as before); then ``resume_generation()``."""
        self.engine.memory.resume(tags)

    def set_weight_version(self, version: int, recompute_kv: bool) -> None:
        """The model's weights were updated in place (``LLM.update_weights``): launches from now
        on record ``version`` on their tokens (a launch enqueued before ran on the old weights:
        same stream), and KV / Mamba states cached before are never hit again. ``recompute_kv``:
        the launch in flight lands now (its results come with the next ``step()``) and every
        request holding KV gives it back and recomputes it with the new weights (prompt and tokens
        so far, as after an eviction) before its next token; False: they keep the old weights' KV."""
        eng = self.engine
        if recompute_kv:
            if eng._pending is not None:
                pending, eng._pending = eng._pending, None
                eng._land(pending, eng._held, time.perf_counter())
            for req in sorted(eng.context.active.values(), key=lambda r: r.arrival_order, reverse=True):
                eng.book.evict(req)  # the oldest ends first in the queue
                eng.scheduler.requeue_front(req)
                eng.stats.recomputed_after_update += 1
        eng.weight_version = version
        eng.context.weights_changed()
        eng.memory.weights_updated()

    def step_paused(self, out: StepResult, t0: float) -> StepResult:
        """``step()`` paused ("keep" / "abort"): the in-flight launch lands, nothing launches.
        Data-parallel ranks still exchange (all of them are paused: nobody forwards), so rank 0's
        resume, requests and aborts reach them and their results reach rank 0."""
        eng = self.engine
        pending, eng._pending = eng._pending, None
        if pending is None:
            eng.stats.paused_steps += 1
        else:
            eng._land(pending, out, t0)
        eng.ranks.agree_on_launch(StepPlan(), out)
        return eng.ranks.close_step(out, landed=pending is not None)
