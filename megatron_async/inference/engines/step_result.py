"""What one ``DynamicInferenceEngine.step()`` call hands back."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_async.inference.request import RequestOutput, RequestUpdate


@dataclass
class StepResult:
    finished: list[RequestOutput] = field(default_factory=list)
    """Requests that ended (length, stop, abort, error), in the order they ended."""
    updates: list[RequestUpdate] = field(default_factory=list)
    """One entry per request that gained tokens or ended in this call."""
    step_id: int = -1
    """Id of the launch bookkept by this call (-1: nothing ran; 0: data-parallel engines only,
    this call launched without bookkeeping, or took part in the ranks' step with a dummy forward)."""
    num_rows: int = 0
    is_decode_only: bool = False
    overlapped: bool = False
    step_time: float | None = None
    """Device seconds of the bookkept step (logging steps on CUDA; host time on CPU)."""
