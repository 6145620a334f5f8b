"""The engine's weight updates: every way new weights arrive ends in the one slab loader
(``models/slab_loading.py``) with the same rules: the weights must be resident
(``MemorySuspender.check_can_update_weights``), everything is checked before anything is copied,
and a completed update sets the weight version and the KV recompute rule (``set_weight_version``).
The receiver keeps the copy plans of recent updates (``CopyPlanCache``), so an RL loop that sends
the same tensors every step pays for planning once."""
from __future__ import annotations

import numbers

from megatron_async.models.weight_update import CopyPlanCache, update_weights_in_place


def check_version(version) -> None:
    if version is not None and (isinstance(version, bool) or not isinstance(version, numbers.Integral)
                                or version < 0):
        raise ValueError(f"version must be an int >= 0 or None, got {version!r}")


class WeightReceiver:
    """One per engine: ``update`` (in-process tensors or a checkpoint directory)."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.runner.model
        self.plans = CopyPlanCache()

    def commit(self, version: int | None, recompute_kv: bool) -> int:
        """The update completed: the new version (None: the current one + 1)."""
        new = self.engine.weight_version + 1 if version is None else int(version)
        self.engine.set_weight_version(new, recompute_kv)
        return new

    def update(self, weights, version: int | None = None, recompute_kv: bool = True,
               weights_format: str | None = None) -> int:
        """``LLM.update_weights``: copy ``weights`` in place and return the new weight version."""
        check_version(version)
        self.engine.memory.check_can_update_weights()
        update_weights_in_place(self.model, weights, weights_format=weights_format, cache=self.plans)
        return self.commit(version, recompute_kv)
