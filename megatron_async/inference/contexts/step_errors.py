"""When preparing a step raises for one request: name the request.

Per-request values enter the step in ``initialize_attention_state``; a value that slipped
past validation (or a bug tied to one request) must fail that request alone, not leave it
queued to break every later step. Assembly changes no request (the request book commits a
step only once it is assembled), so the plan's other requests are scheduled again as if this
launch never happened (the blocks it reserved stay theirs)."""
from __future__ import annotations

from megatron_async.inference.request import DynamicInferenceRequest

TOKEN_FIELDS = ("input_ids", "prev_sample_idx", "positions", "slot_mapping", "token_to_row")


class RequestStepError(RuntimeError):
    """Preparing a step raised for ``request``; nothing of the step was committed."""

    def __init__(self, request: DynamicInferenceRequest, cause: BaseException):
        self.request = request
        self.message = f"preparing a step raised {type(cause).__name__}: {cause}"
        super().__init__(f"request {request.request_id}: {self.message}")


def row_of_bad_value(views: dict, columns: dict[str, list], token_to_row: list[int]) -> int | None:
    """Which row holds a value the host buffer cannot take (e.g. an int64 overflow); None if none."""
    for name, values in columns.items():
        arr = views[name]
        for i, x in enumerate(values):
            try:
                arr[i] = x
            except (OverflowError, TypeError, ValueError):
                if name in TOKEN_FIELDS:
                    return token_to_row[i]
                return max(i - 1, 0) if name == "cu_query_lens" else i
    return None
