"""The order in which waiting requests are considered for admission (``SamplingParams.priority``).

A pure function over the queue: requests admitted before (evicted ones, recomputing) come first
in queue order, then the others by class, lower first, and in queue order within a class. A
request's class is its priority less one for every ``aging`` requests admitted since it was
queued, so a low class still progresses while higher ones keep arriving. The engine's admission
count is the same in serial and launch-ahead modes (they build the same schedules), so both
order the queue alike."""
from __future__ import annotations

from collections.abc import Sequence

from megatron_async.inference.request import DynamicInferenceRequest


def aged_class(priority: int, waited: int, aging: int) -> int:
    """The class of a request of ``priority`` that waited ``waited`` admissions: one class lower
    per ``aging`` of them (the server's fair queue ages its bodies by it too)."""
    return priority - waited // aging


def effective_class(req: DynamicInferenceRequest, admissions: int, aging: int) -> int:
    """``req``'s priority, lowered by its wait: one class per ``aging`` admissions."""
    return aged_class(req.sampling_params.priority, admissions - req.queued_after, aging)


def admission_order(waiting: Sequence[DynamicInferenceRequest], admissions: int, aging: int) -> list[int]:
    """Indices of ``waiting`` (queue order) in the order admission considers them."""
    def key(i: int):
        req = waiting[i]
        if req.weights_epoch >= 0:  # admitted before: it holds progress, it goes first
            return (0, 0, i)
        return (1, effective_class(req, admissions, aging), i)

    return sorted(range(len(waiting)), key=key)
