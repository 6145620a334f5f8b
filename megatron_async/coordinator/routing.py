"""The coordinator routes with ``megatron_async.inference.dp_routing`` (one definition, shared with
rank 0 of a job of data-parallel ranks); its names stay importable from here for the client and the
engines' link to a coordinator."""
from __future__ import annotations

from megatron_async.inference.dp_routing import (
    EngineSlot, PrefixView, choose, keys_from_bytes, keys_of, packed_keys, place, routing_keys,
)

__all__ = ["EngineSlot", "PrefixView", "choose", "keys_from_bytes", "keys_of", "packed_keys", "place", "routing_keys"]
