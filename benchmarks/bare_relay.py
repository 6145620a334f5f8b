"""The coordinator's hops over bare ZMQ, without the Python around them: the floor under
``dp-routing --part router``'s one-at-a-time round trip on the host it runs on.

A client DEALER (the calling process), a relay ROUTER (the coordinator's place: one socket for
both sides, as the coordinator's) and an echo DEALER (an engine's place), each its own process,
with the control plane's socket options (coordinator/transport.py's ``control_socket``), on TCP
loopback or (``ipc=True``) a Unix socket in a 0700 directory, as a local coordinator's peers
connect (its ipc twin: coordinator/trust.py). One round trip = the 4 hops of a request through the coordinator to an engine and
back: client -> relay -> echo -> relay -> client, each process blocked in ``recv`` between them.

    relay = BareRelay(ipc=False); relay.round_trips(2000)   # seconds each; relay.close()
    python -m benchmarks.bare_relay relay [ipc://PATH] | echo ADDR
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

import zmq

from megatron_async.coordinator.transport import control_socket

READY = "bare relay: listening on "
JOINED = "bare relay: the echo joined"
HELLO = b"echo here"
FRAME_BYTES = 320
"""About a submission's, a route's, an engine's outputs' and a client's finished message's size."""


def relay(address: str = "tcp://127.0.0.1:*") -> None:
    sock = control_socket(zmq.Context.instance(), zmq.ROUTER)
    sock.bind(address)
    print(READY + sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    echo = client = None
    while True:
        rid, frame = sock.recv_multipart()
        if frame == HELLO:
            echo = rid
            print(JOINED, flush=True)
        elif rid == echo:
            sock.send_multipart([client, frame])
        else:
            client = rid
            sock.send_multipart([echo, frame])


def echo(address: str) -> None:
    sock = control_socket(zmq.Context.instance(), zmq.DEALER)
    sock.connect(address)
    sock.send(HELLO)
    while True:
        sock.send(sock.recv())


class BareRelay:
    """The relay and echo processes (killed at ``close``) and this process's client socket."""

    def __init__(self, timeout_s: float = 60.0, ipc: bool = False):
        from tests.helpers.coordinator_procs import ROOT, _env, _wait_line

        cmd = [sys.executable, "-m", "benchmarks.bare_relay"]
        self._dir = tempfile.mkdtemp(prefix="relay-") if ipc else None  # (0700)
        where = [f"ipc://{self._dir}/relay"] if ipc else []
        self.procs = [subprocess.Popen([*cmd, "relay", *where], stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)]
        try:
            address = _wait_line(self.procs[0], READY, timeout_s)
            self.procs.append(subprocess.Popen([*cmd, "echo", address], env=_env(), cwd=ROOT))
            _wait_line(self.procs[0], JOINED, timeout_s)
            self._ctx = zmq.Context()
            self.sock = control_socket(self._ctx, zmq.DEALER)
            self.sock.connect(address)
            self._frame = b"x" * FRAME_BYTES
            self.round_trips(200)  # warm
        except BaseException:
            self.close()
            raise

    def round_trips(self, n: int) -> list[float]:
        """``n`` round trips one at a time: seconds each."""
        out, sock, frame, clock = [], self.sock, self._frame, time.perf_counter
        for _ in range(n):
            t0 = clock()
            sock.send(frame)
            sock.recv()
            out.append(clock() - t0)
        return out

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)
        if getattr(self, "sock", None) is not None:
            self.sock.close(0)
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    relay(*sys.argv[2:]) if sys.argv[1] == "relay" else echo(sys.argv[2])
