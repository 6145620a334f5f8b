"""A prefill engine starts a ``kv_send`` while its step runs on the device, not only at its next
loop turn: a long prompt's step takes hundreds of milliseconds on a GPU, and a decode engine's
imported request waits for its second token until its blocks arrive.

While the engine's host waits for a launch's samples (``DeviceFacade.wait_host``) and a request
it announced (kv_ready) still awaits its kv_send, the loop thread looks at the coordinator's
connection (``POLL_S`` at a time, holding the heartbeat thread's lock: the connection is not
thread-safe) and starts the sends it finds, on the pair connection's own stream and staging
buffers (the send waits on the event recorded when the request's blocks were kept, never on the
compute stream, and nothing on the compute stream waits for it). Every other message is held,
in arrival order, for the next turn, which handles them before the ones that come after.

A kv_send goes before the held messages only when none of them could change what it sends or
where its bytes meet their receive: none names its request (a kv_release or kv_cancel before it
is handled first, so each request still ends once and its blocks are freed once), none is a kv_send
(a pair's sends meet its receives in order: NCCL matches them by order, not by tag), and none is
of a kind outside ``PASSABLE`` (a control operation, a drain). Once one kv_send is held, later
ones are held too until the turn. An "ipc" pair's send packs on the compute stream and waits
for it: it waits for the turn."""
from __future__ import annotations

import time

POLL_S = 0.001
"""Longest wait on the coordinator's connection before the launch's event is queried again (a
message wakes it at once; the step's end is seen within this)."""
PASSABLE = frozenset({"route", "prefill", "abort", "kv_import", "kv_release", "kv_cancel"})
"""Kinds of held messages a kv_send of another request may go before."""


class MidStepSends:
    def __init__(self, channel, lock, handoffs):
        """``channel``: the link's connection to the coordinator; ``lock``: the heartbeat
        thread's (it owns the channel while a step runs); ``handoffs``: EngineHandOffs."""
        self.channel, self.lock, self.handoffs = channel, lock, handoffs
        self.held: list[tuple[str, list]] = []  # taken during a step, for the next turn, in arrival order
        self._held_rids: set = set()
        self._blocked = False  # a held message no kv_send may pass: the rest wait for the turn too
        self.sends = 0
        """kv_sends started while a step was in flight."""
        self.seconds = 0.0
        """Host time spent starting them (beside the device's work, not the loop's)."""

    def wait(self, passed) -> None:
        """Until ``passed()`` (the launch's event), or until no announced request awaits its
        kv_send: take kv_sends (``DeviceFacade.while_waiting``)."""
        h = self.handoffs
        while h.unsent and not self._blocked and not self.channel.lost and not passed():
            with self.lock:
                for kind, fields in self.channel.poll(POLL_S):
                    self._take(kind, fields)

    def _take(self, kind: str, fields) -> None:
        if kind == "kv_send" and not self._blocked and fields[0] not in self._held_rids and fields[1][3] != "ipc":
            start = time.perf_counter()
            self.handoffs.handle_now(kind, fields)
            self.sends += 1
            self.seconds += time.perf_counter() - start
            return
        self.held.append((kind, fields))
        if kind not in PASSABLE or kind == "kv_send":
            self._blocked = True
        elif fields:
            self._held_rids.add(fields[0])

    def take_held(self) -> list[tuple[str, list]]:
        """The messages held during the last step, in arrival order (the turn handles them first)."""
        held, self.held = self.held, []
        self._held_rids.clear()
        self._blocked = False
        return held

    def counters(self) -> dict:
        return {"kv_sends_mid_step": self.sends, "kv_mid_step_seconds": self.seconds}
