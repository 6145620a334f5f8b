"""How a job's ranks end together: rank 0 announces its exit status, and every other rank learns
it wherever it waits for rank 0, instead of finding rank 0's connection gone.

Not a collective: rank 0 waits for nobody (a rank may be between collectives, finishing its own
work, or gone). The status goes out twice: as an ``END`` frame to every connected rank (read by a
rank waiting in a ZMQ collective or in ``wait``), and, where the ranks share memory, as the
segment's end word (read by a rank waiting in a shared-memory round: shm_slots.py). Either way the
waiting rank raises ``LeaderEnded`` (or ``wait`` returns the status), never ``CommunicatorError``;
a rank 0 that dies without announcing still shows as a lost connection."""
from __future__ import annotations

from megatron_async.inference.communication import wire
from megatron_async.inference.communication.shm_slots import SharedSlots
from megatron_async.inference.communication.zmq_transport import CommunicatorError, ZMQTransport

END = wire.message_type("end", 20, arity=1)
"""[status]: rank 0 ends the job with this exit status; it answers any wait for rank 0."""
LINGER_MS = 2000
"""The longest rank 0's close waits for the ``END`` frames to leave (a peer already gone: at once)."""


def announce(transport: ZMQTransport, slots: SharedSlots | None, world_size: int, status: int) -> None:
    """Rank 0: tell every rank the job ends with exit ``status``; a rank already gone is skipped."""
    if slots is not None:
        slots.end(status)
    frame = wire.encode(END, int(status))
    for peer in range(1, world_size):
        try:
            transport.send_to(peer, frame)
        except CommunicatorError:  # it exited or died: nobody to tell
            pass
    transport.linger_ms = LINGER_MS


def wait(transport: ZMQTransport) -> int:
    """Another rank, done with its collectives: rank 0's exit status once announced
    (``CommunicatorError`` if rank 0 dies unannounced or stays silent past the timeout)."""
    mtype, fields = transport.recv_from_root("the end of the job")
    if mtype is not END:
        raise CommunicatorError(f"rank {transport.rank} waits for the end of the job but rank 0 sent {mtype.name}: "
                                "the ranks diverged")
    return int(fields[0])
