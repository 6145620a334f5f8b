"""The engine's public controls beside ``step()``: aborting requests, the warm-up, pausing and
resuming generation, suspending and resuming device memory, weight versions and weight (and LoRA
adapter) transfers from a trainer, and stepping until requests end. Each hands the call to the room that holds its
rules (generation_control.py, weight_receiver.py, run_to_end.py, the model runner and the step
accounting; aborts and the unfinished-requests question: the engine's rank role);
``DynamicInferenceEngine`` inherits them."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_async.inference.engines import lora_refit, run_to_end

if TYPE_CHECKING:
    from megatron_async.inference.request import RequestOutput


class EngineControls:
    """Mixed into ``DynamicInferenceEngine``: reads its ``ranks``, ``runner``, ``accounting``,
    ``control``, ``weights``, ``scheduler``, ``_requests``, ``_pending`` and ``_pause``."""

    def abort_request(self, request_id: int) -> bool:
        """End an unfinished request at the next ``step()``: its output comes in that step's
        ``finished`` with finish_reason "abort", its KV blocks and state slot are freed.
        Returns False (and does nothing) for an unknown, finished or already aborted id."""
        return self.ranks.abort(request_id)

    def abort_requests(self, request_ids: list[int] | None = None) -> int:
        """``abort_request`` for each id (None or empty: every unfinished request); how many were aborted."""
        ids = request_ids or sorted(set(self._requests) | set(getattr(self.ranks, "_live", ())))
        return sum(bool(self.abort_request(rid)) for rid in ids)

    # ------------------------------------------------------------------ warm-up
    def warmup(self):
        """Build every Triton kernel variant and capture every CUDA graph this engine can use,
        so serving never compiles or captures (``LLM`` calls it at build on CUDA unless
        ``InferenceConfig.startup_warmup`` is off). Call with nothing in flight. Returns the
        runner's ``WarmupReport``; the stats' ``warmup_*`` fields hold it too."""
        if self._pending is not None:
            raise RuntimeError("engine.warmup() needs an idle engine: a launch is in flight")
        report = self.runner.warmup(agree=self.ranks.max_over_ranks)
        self.accounting.warmed_up(report)
        return report

    # ------------------------------------------------------------------ weights, pausing, suspending
    # (the rules: generation_control.py)
    def set_weight_version(self, version: int, recompute_kv: bool = True) -> None:
        """The model's weights were updated in place: launches from now on record ``version``
        on their tokens; ``recompute_kv``: requests holding KV recompute it with the new weights."""
        self.control.set_weight_version(version, recompute_kv)

    @property
    def is_paused(self) -> bool:
        """Generation is paused on this rank (under TP / EP the same on every rank between steps)."""
        return self._pause is not None

    def pause_generation(self, mode: str = "keep") -> None:
        """Stop generating until ``resume_generation``; ``mode``: "abort", "wait" or "keep"."""
        self.control.pause_generation(mode)

    def resume_generation(self) -> None:
        """Generate again after ``pause_generation`` (no-op when not paused)."""
        self.control.resume_generation()

    def _set_pause(self, mode: str | None) -> None:
        self._pause = mode
        self.scheduler.admits_new = mode != "wait"

    def suspend(self, tags=("weights", "kv_cache"), keep_weights_on_host: bool = True) -> None:
        """Free device memory by tag ("weights", "kv_cache") while paused; requests continue
        token-identically after ``resume``."""
        self.control.suspend(tags, keep_weights_on_host)

    def resume(self, tags=("weights", "kv_cache")) -> None:
        """Give back the device memory of ``tags`` freed by ``suspend``; then ``resume_generation()``."""
        self.control.resume(tags)

    # ------------------------------------------------------------------ weights from a trainer (weight_receiver.py)
    def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                             backend: str | None = None, timeout_s: float | None = None) -> int:
        """Join a trainer's transfer group (``megatron_async.weight_transfer``) as rank ``rank_offset``
        + this rank's global rank (returned); ``backend``: "nccl" / "gloo" (None: by device);
        ``timeout_s``: how long to wait for every rank (None: ``weight_transfer_timeout_s``)."""
        return self.weights.init_transfer(master_address, master_port, rank_offset, world_size, backend, timeout_s)

    def update_weights_from_distributed(self, metadata, version: int | None = None, recompute_kv: bool = True) -> int:
        """Receive the bucketed update a trainer broadcasts (``metadata``: its manifest); the new weight version."""
        return self.weights.from_distributed(metadata, version, recompute_kv)

    def update_weights_from_ipc(self, handles, version: int | None = None, recompute_kv: bool = True) -> int:
        """Copy a colocated trainer's weights from its shared storages (``weight_transfer.ipc``); the new version."""
        return self.weights.from_ipc(handles, version, recompute_kv)

    def update_lora_from_distributed(self, lora_name: str, metadata) -> int:
        """New weights of loaded LoRA adapter ``lora_name`` broadcast by a trainer over the transfer
        group (``metadata``: its manifest; lora_refit.py); the new weight version."""
        return lora_refit.start_distributed(self.weights, self.lora, lora_name, metadata).finish()

    def update_lora_from_ipc(self, lora_name: str, handles) -> int:
        """New weights of loaded LoRA adapter ``lora_name`` from a colocated trainer's shared storages."""
        return lora_refit.from_ipc(self.weights, self.lora, lora_name, handles)

    def destroy_weight_transfer(self) -> None:
        self.weights.destroy()

    # ------------------------------------------------------------------ stepping to the end (run_to_end.py)
    def has_unfinished_requests(self) -> bool:
        """Requests not yet reported finished. Under TP / EP a collective: every rank gets the
        same answer (and must call it together). It reuses the latest per-step agreement while
        that said "work" (a stale yes costs at most one empty step), else exchanges afresh."""
        return self.ranks.has_unfinished_requests()

    def run_until_done(self) -> list[RequestOutput]:
        """Step until no request is unfinished; every output."""
        return run_to_end.run_until_done(self)

    def run_requests(self, request_ids: list[int],
                     feed: Callable[[], tuple[list[int], bool]] | None = None) -> dict[int, RequestOutput]:
        """Step until these requests (and those ``feed`` adds) finish and return their outputs;
        other requests' outputs and updates wait for the next ``step()``."""
        return run_to_end.run_requests(self, request_ids, feed)
