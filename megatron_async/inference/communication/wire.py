"""What the communicator's messages are made of: every collective's message is its sequence
number, its kind and its payload, turned into bytes and back here (the transport,
zmq_transport.py, moves the bytes and never looks inside them). Payloads are pickled: only for
ranks of one trusted job. Uploads (data-parallel ranks' results) may bring their own compact
codec (``ZMQCommunicator.upload_codec``) and fall back to ``dumps`` / ``loads``."""
from __future__ import annotations

import pickle
from typing import Any


def pack(seq: int, kind: str, payload: Any) -> bytes:
    """The message of collective number ``seq`` of kind ``kind`` carrying ``payload``."""
    return pickle.dumps((seq, kind, payload))


def unpack(msg: bytes) -> tuple[int, str, Any]:
    """(sequence number, kind, payload) of a message made by ``pack``."""
    return pickle.loads(msg)


def dumps(obj: Any) -> bytes:
    """``obj`` as bytes outside a message (a payload in shared memory, an upload)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)
