"""An engine joins a data-parallel coordinator: its connection (``CoordinatorChannel``), its
registration, and the coordinator process an engine job starts for itself (``--listen``,
``LLM(..., listen=...)``); the serving itself is link.py's."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_async.config.inference_config import DP_ENGINE_TIMEOUT_S
from megatron_async.config.modes import DpRouting
from megatron_async.coordinator.engines import EngineInfo, RegistrationError
from megatron_async.coordinator.transport import PeerSocket
from megatron_async.coordinator.trust import peer_secret
from megatron_async.dp_engine.direct_replies import DirectReplies

COORDINATOR_START_TIMEOUT_S = 60.0


class CoordinatorChannel:
    """link.EngineChannel over an authenticated connection to the coordinator."""

    def __init__(self, address: str, name: str, secret: bytes | str | None = None, timeout_s: float = 30.0):
        key = peer_secret(address, secret)
        self.peer = PeerSocket(address, key, "engine", name, timeout_s)
        self.replies = DirectReplies(self.peer.endpoint, key, name, self.peer.sock.context)
        """Final outputs straight to clients on this host (direct_replies.py)."""
        self._early: list[tuple[str, list]] = []
        self.index: int | None = None

    @property
    def lost(self) -> bool:
        return self.peer.lost

    def register(self, info: EngineInfo, timeout_s: float = 30.0) -> int:
        """This engine's index at the coordinator (RegistrationError: refused)."""
        self.peer.send("register", info)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.peer.lost:
            self.peer.wait(0.1)
            for kind, fields in self.peer.take():
                if kind == "info" and self.index is None:
                    self.index = fields[0]["index"]
                    return self.index
                if kind == "rejected":
                    raise RegistrationError(f"the coordinator at {self.peer.address} refused this engine: {fields[1]}")
                self._early.append((kind, fields))  # told the pause mode / epoch before the answer
        raise RegistrationError(f"the coordinator at {self.peer.address} did not answer this engine's registration")

    def poll(self, timeout_s: float) -> list[tuple[str, list]]:
        early, self._early = self._early, []
        if early or timeout_s <= 0:
            return early + self.peer.take()
        return self.peer.take(self.peer.wait(timeout_s))  # (the wait returns at once when a message waits)

    def send(self, kind: str, *fields) -> None:
        if not self.peer.lost:
            self.peer.send(kind, *fields)

    def close(self) -> None:
        self.replies.close()  # (before the context they share ends with the coordinator's connection)
        self.peer.close()


def join(llm, address: str, name: str | None = None, secret: bytes | str | None = None, role: str = "mixed",
         kv_transfer_backend: str | None = None):
    """An ``EngineLink`` serving ``llm``'s engine to the coordinator at ``address``, registered
    (not yet running: ``run()`` here, or ``start()`` on a thread). ``role``: "mixed", "prefill" or
    "decode" (docs/DISAGGREGATION.md); ``kv_transfer_backend``: None, the engine's
    ``InferenceConfig.kv_transfer_backend``."""
    from megatron_async.dp_engine.link import EngineLink

    name = name or f"{socket.gethostname()}:{os.getpid()}"
    channel = CoordinatorChannel(address, name, secret)
    try:
        link = EngineLink(llm.engine, channel, llm.config.max_requests, name, llm.update_weights,
                          llm.communicator if llm.tensor_parallel_size > 1 else None, role=role,
                          kv_transfer_backend=kv_transfer_backend or llm.config.kv_transfer_backend,
                          kv_transfer_kernel=llm.config.kv_transfer_kernel, address=address,
                          kv_send_mid_step=llm.config.kv_send_mid_step)
        channel.register(link.info())
    except BaseException:
        channel.close()
        raise
    return link


def spawn_coordinator(listen: str, policy: str = "load_balanced", alpha: float = 0.5,
                      engine_timeout_s: float = DP_ENGINE_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """``python -m megatron_async.coordinator`` listening on ``listen``: (its process, its address)."""
    from megatron_async.coordinator.__main__ import READY_LINE

    root = str(Path(__file__).resolve().parents[2])  # this tree's package, whatever the caller's sys.path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "megatron_async.coordinator", "--listen", listen, "--dp-routing", DpRouting(policy).value,
           "--dp-routing-alpha", str(alpha), "--engine-timeout-s", str(engine_timeout_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + COORDINATOR_START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY_LINE):
            return proc, line[len(READY_LINE):].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"the coordinator did not start on {listen} (exit code {proc.poll()})")


def spawn_configured_coordinator(listen: str, config) -> tuple[subprocess.Popen, str]:
    """``spawn_coordinator`` with an engine's ``InferenceConfig`` settings (dp_routing,
    dp_routing_alpha, dp_engine_timeout_s)."""
    return spawn_coordinator(listen, config.dp_routing, config.dp_routing_alpha, config.dp_engine_timeout_s)


def serve_engine(llm, args) -> int:
    """``python -m megatron_async.serve --listen ADDR | --join ADDR``: serve ``llm``'s engine to
    the coordinator (started here with ``--listen``) until it is stopped or drained, SIGTERM, or
    the coordinator is gone. Tensor parallelism: rank 0 serves, the other ranks follow its steps."""
    import signal
    import threading

    from megatron_async.coordinator.trust import SecretError
    from megatron_async.dp_engine.engine_ops import follow_rank0

    proc = None
    try:
        if not llm.is_leader:
            follow_rank0(llm.engine, llm.communicator, llm.update_weights)
            return 0
        address = args.join
        if args.listen:
            proc, address = spawn_configured_coordinator(args.listen, llm.config)
        try:
            link = join(llm, address, args.engine_name, role=args.role, kv_transfer_backend=args.kv_transfer_backend)
        except (SecretError, RegistrationError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        print(f"megatron_async.serve: engine {link.channel.index} of the coordinator at {address}", flush=True)
        why = link.run(stop)
        link.channel.close()
        return 0 if why == "left" else 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        llm.close()


class CoordinatorService:
    """What ``LLM(..., listen=ADDR)`` / ``LLM(..., join=ADDR)`` runs beside the engine: the
    coordinator process it started (``listen``), and its engine served to the coordinator on a
    thread (rank 0; under tensor parallelism the other ranks follow rank 0's steps on a thread)."""

    def __init__(self, llm, listen: str | None, join_address: str | None, role: str = "mixed"):
        self.process: subprocess.Popen | None = None
        self.link = None
        self._follower = None
        self.address = join_address
        if not llm.is_leader:
            import threading

            from megatron_async.dp_engine.engine_ops import follow_rank0

            self._follower = threading.Thread(target=follow_rank0, args=(llm.engine, llm.communicator, llm.update_weights),
                                              daemon=True, name="megatron-async-follower")
            self._follower.start()
            return
        try:
            if listen is not None:
                self.process, self.address = spawn_configured_coordinator(listen, llm.config)
            self.link = join(llm, self.address, role=role)
            self.link.start()
        except BaseException:
            self.close()
            raise

    @property
    def index(self) -> int | None:
        """This engine's index at the coordinator (rank 0)."""
        return self.link.channel.index if self.link is not None else None

    def close(self) -> None:
        """The engine leaves (its requests end first) and a coordinator started here stops."""
        if self.link is not None:
            self.link.stop()
            self.link.channel.close()
            self.link = None
        if self._follower is not None:
            self._follower.join(10)
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None
