"""The coordinator's open requests: who asked (client and its request id), where each runs, and
what it has produced so far (the tokens, text and log-probs of its updates), so that a request
whose engine dies ends with its partial output, and one that produced nothing is routed again.

Each request has one entry from its submission to its end, whichever way it ends (its engine's
final output, a rejection, an abort while not yet routed, its engine's death after it produced
tokens, its client's departure): ``end`` removes it, and nothing reports a request that has no
entry, so a request ends exactly once."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_async.coordinator.engines import EngineSlot
from megatron_async.inference.communication.wire_fields import ints
from megatron_async.inference.dp_routing import digest_keys
from megatron_async.inference.request import RequestOutput, RequestUpdate


@dataclass(eq=False)
class OpenRequest:
    rid: int
    """The coordinator's id (what engines see)."""
    client: Any
    client_rid: int
    prompt: Any
    """Text, or token ids (packed as they travelled, or a list: ``prompt_tokens``), as the engine takes it."""
    sampling: Any
    """The sampling parameters as the client sent them (passed through to the engine)."""
    stream: bool
    digests: bytes
    """The prompt's block digests (32 bytes each; b"": none), handed to its engine."""
    keys: list[int] = field(default_factory=list)
    """What routing reads of them (``digest_keys``)."""
    engine: EngineSlot | None = None
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    log_probs: list[float] | None = None
    queued_at: float = field(default_factory=time.monotonic)
    """When it last waited for an engine (none took requests)."""
    placements: int = 0
    """Engines it was sent to (more than one: routed again after a death)."""

    def hashed(self, digests: bytes) -> None:
        self.digests, self.keys = digests, digest_keys(digests)

    def land(self, update: RequestUpdate) -> None:
        """What an update of its engine brought (kept until it ends)."""
        self.tokens += update.new_tokens
        if update.new_text:
            self.text.append(update.new_text)
        if update.new_log_probs is not None:
            if self.log_probs is None:
                self.log_probs = []
            self.log_probs += update.new_log_probs

    def partial_output(self, reason: str, error: str | None) -> RequestOutput:
        """Its output so far, ended with ``reason`` (ids are the client's)."""
        prompt = prompt_tokens(self.prompt) if not isinstance(self.prompt, str) else []
        return RequestOutput(self.client_rid, prompt, list(self.tokens), "".join(self.text) if self.text else None,
                             reason, generated_log_probs=self.log_probs, error=error)


def prompt_tokens(prompt: bytes | Sequence[int]) -> list[int]:
    """A token-id prompt as a list (the coordinator keeps a submitted one packed, as it came)."""
    return ints(prompt, "prompt") if type(prompt) is bytes else list(prompt)


class RequestTable:
    def __init__(self):
        self.open: dict[int, OpenRequest] = {}
        self._of_client: dict[Any, dict[int, int]] = {}  # client -> its request id -> rid
        self.unrouted: OrderedDict[int, OpenRequest] = OrderedDict()
        """Requests waiting for an engine that takes requests, oldest first."""
        self._next_rid = 0

    def add(self, client: Any, client_rid: int, prompt: Any, sampling: Any, stream: bool,
            digests: bytes) -> OpenRequest | None:
        """A new entry, or None when this client already has an open request with that id."""
        mine = self._of_client.setdefault(client, {})
        if client_rid in mine:
            return None
        req = OpenRequest(self._next_rid, client, client_rid, prompt, sampling, stream, digests)
        req.hashed(digests)
        self._next_rid += 1
        mine[client_rid] = req.rid
        self.open[req.rid] = req
        return req

    def get(self, rid: int) -> OpenRequest | None:
        return self.open.get(rid)

    def of_client(self, client: Any, client_rid: int) -> OpenRequest | None:
        rid = self._of_client.get(client, {}).get(client_rid)
        return None if rid is None else self.open.get(rid)

    def all_of_client(self, client: Any) -> list[OpenRequest]:
        return [self.open[rid] for rid in list(self._of_client.get(client, {}).values()) if rid in self.open]

    def on_engine(self, slot: EngineSlot) -> list[OpenRequest]:
        """The open requests routed to ``slot``, oldest first."""
        return [r for r in self.open.values() if r.engine is slot]

    def end(self, rid: int) -> OpenRequest | None:
        """Remove an entry (None: it had ended already); the engine it ran on counts one less."""
        req = self.open.pop(rid, None)
        if req is None:
            return None
        mine = self._of_client.get(req.client)
        if mine is not None:
            mine.pop(req.client_rid, None)
            if not mine:
                del self._of_client[req.client]
        self.unrouted.pop(rid, None)
        self.unplace(req)
        return req

    @staticmethod
    def unplace(req: OpenRequest) -> None:
        if req.engine is not None:
            req.engine.pending -= 1
            req.engine = None

    def forget_client(self, client: Any) -> None:
        self._of_client.pop(client, None)

    def __len__(self) -> int:
        return len(self.open)
