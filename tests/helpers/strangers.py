"""What a stranger does to every endpoint a job publishes (another process of the host, or anyone
on the network for a TCP endpoint): connects and leaves, sends random bytes, malicious pickles,
well-formed frames of the ranks' message types without a handshake, a handshake claiming a real
rank's name with a forged proof, ZMQ identities a pickling communicator would have trusted, an
oversized frame, raw TCP garbage. Nothing here knows the job's secret."""
from __future__ import annotations

import os
import pickle
import random
import socket
import time

import msgpack
import zmq


class Canary:
    """Unpickling this creates ``path`` (what code execution on the receiver would look like)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def evil_pickles(canary: str) -> list[bytes]:
    c = Canary(canary)
    return [pickle.dumps(c), pickle.dumps((1, "exchange", ([0, 0, 0], c))), pickle.dumps((1, "all_reduce_max", c)),
            b"MAP1" + pickle.dumps(c)]


def attack(endpoint: str, rng: random.Random, canary: str, heavy: bool = False) -> list[str]:
    """One round of every attack on ``endpoint``; returns what was tried. ``heavy``: also a frame
    over the listener's 64 MiB limit (libzmq closes that connection)."""
    ctx = zmq.Context.instance()
    done = []

    def dealer(identity: bytes | None = None) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(endpoint)
        return s

    def leave(s: zmq.Socket) -> None:
        time.sleep(0.01)  # (its frames reach the listener before the close)
        s.close(0)

    s = dealer()
    leave(s)
    done.append("connect and disconnect")
    s = dealer()
    for _ in range(5):
        s.send(rng.randbytes(rng.randrange(1, 200)))
    s.send_multipart([b"", rng.randbytes(10)])
    for p in evil_pickles(canary):
        s.send(p)
    for value in (1, 3, 16, 17, 18, 19, 99, 32):  # handshake types malformed, the ranks' types unauthenticated, unknown
        s.send(msgpack.packb([value, 1, [2**40] * 3, None, rng.randbytes(32)]))
    leave(s)
    done.append("random bytes, malicious pickles, frames without a handshake")
    for name in ("1", "2", "3"):  # a well-formed HELLO under a real rank's name, a forged PROOF, then its frames
        s = dealer()
        s.send(msgpack.packb([1, 1, "rank", name, rng.randbytes(32)]))
        time.sleep(0.005)
        s.send(msgpack.packb([3, rng.randbytes(32)]))
        s.send(msgpack.packb([16, 1, [2**40] * 8, None]))
        s.send(pickle.dumps(Canary(canary)))
        leave(s)
    s = dealer()
    s.send(msgpack.packb([1, 1, "rank", "1", rng.randbytes(32)]))  # a HELLO, then silence (a pending handshake)
    leave(s)
    done.append("frames under a rank's name with a forged proof")
    for ident in (b"rank1", b"1", b"\x00\x80\x00\x00\x00", b"\x00\x80\x00\x00\x01"):
        s = dealer(ident)  # identities a pickling communicator trusted; ROUTER-style ids
        s.send(pickle.dumps((1, "exchange", ([2**40] * 8, None))))
        s.send(pickle.dumps(Canary(canary)))
        leave(s)
    done.append("frames under chosen identities")
    s = dealer()
    s.send(rng.randbytes(300_000))  # over the pre-authentication limit
    if heavy:
        s.send(b"\0" * (65 << 20))
    leave(s)
    done.append("oversized frames")
    if endpoint.startswith("tcp://"):
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=1) as raw:  # not even ZMTP
            raw.sendall(rng.randbytes(64))
            time.sleep(0.005)
        done.append("raw TCP garbage")
    return done
