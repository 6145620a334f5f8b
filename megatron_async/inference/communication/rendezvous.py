"""Where rank 0 of a job listens and where the job's secret comes from, decided through the
torch.distributed store before anything binds.

1. Census: rank 0 makes a private directory (0700) holding a token file (0600) and publishes
   the directory's path and the token in the store; every rank reports whether it reads the
   same token there (same host, same user, same mount namespace: exactly "can share an ipc://
   socket and /dev/shm with rank 0").
2. Bind: every rank local -> ``ipc://DIR/ranks`` only: no TCP port at all (nothing a network
   stranger can reach; the directory's mode keeps other users out). Otherwise TCP on the
   interface that routes to MASTER_ADDR (never 0.0.0.0) on an ephemeral port, plus the ipc
   endpoint for the ranks on rank 0's host.
3. Secret, the first found: ``MEGATRON_ASYNC_SECRET``; the file named by
   ``MEGATRON_ASYNC_SECRET_FILE`` (refused when others can read it); else 32 random bytes from
   rank 0, in ``DIR/secret`` (0600) when every rank is local, else through the store, with a
   warning: torch's TCPStore listens on every interface without authentication, so anyone who
   reaches MASTER_ADDR:MASTER_PORT could read it.

The store's entries are trusted for reachability only: a forged directory fails the ownership
and mode check (``private_dir_ok``), a forged endpoint fails the handshake (the listener must
prove the key first, handshake.py)."""
from __future__ import annotations

import logging
import os
import secrets
import socket
import stat
import tempfile
from dataclasses import dataclass

log = logging.getLogger("megatron_async")
SECRET_ENV, SECRET_FILE_ENV = "MEGATRON_ASYNC_SECRET", "MEGATRON_ASYNC_SECRET_FILE"
MIN_SECRET_BYTES = 16


class SecretError(RuntimeError):
    """A configured secret that cannot be used (what to fix is in the message)."""


@dataclass(frozen=True)
class Plan:
    """One rank's view of the job's rendezvous."""

    all_local: bool
    """Every rank shares rank 0's host (and user): ipc only, no TCP port."""
    secret: bytes
    secret_source: str
    """"env", "file", "local-file" (0600 in the private directory) or "store"."""
    job: bytes
    """Non-secret id of this listener, part of every handshake's MAC (no replay into another job)."""
    directory: str | None
    """Rank 0's private directory when this rank can use it (rank 0: it made it; removed at close)."""
    bind: tuple[str, ...] = ()
    """Rank 0: the endpoints to bind ("tcp://ADDR:0" = an ephemeral port)."""


def secret_from_env(env: str = SECRET_ENV, file_env: str = SECRET_FILE_ENV) -> tuple[bytes, str] | None:
    """(secret, "env" | "file") from the environment, or None when neither variable is set.
    A secret file readable by group or others, or not this user's, is refused."""
    value = os.environ.get(env)
    if value:
        secret, source = value.encode(), "env"
    elif os.environ.get(file_env):
        path = os.environ[file_env]
        st = os.stat(path)
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise SecretError(f"{file_env}={path} must be this user's and readable by nobody else "
                              f"(mode {st.st_mode & 0o777:o}): chmod 600 it")
        with open(path, "rb") as fh:
            secret, source = fh.read().strip(), "file"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the secret in {env if source == 'env' else file_env} must be at least "
                          f"{MIN_SECRET_BYTES} bytes")
    return secret, source


def private_dir_ok(path: str) -> bool:
    """``path`` is a directory of this user that nobody else can enter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def plan(store, rank: int, world: int, key: str, force_tcp: bool = False) -> Plan:
    """Collective over ``store``: every rank gets the same decision. ``force_tcp``: behave as
    if the ranks spanned hosts (tests, measurements)."""
    if rank == 0:
        directory = tempfile.mkdtemp(prefix="ma-ranks-")  # 0700
        token = secrets.token_hex(16)
        write_private(os.path.join(directory, "token"), token.encode())
        store.set(f"{key}/dir", f"{directory} {token}")
    else:
        directory, token = store.get(f"{key}/dir").decode().split(" ")
    local = not force_tcp and private_dir_ok(directory) and _read(os.path.join(directory, "token")) == token.encode()
    store.set(f"{key}/local/{rank}", "1" if local else "0")
    env = secret_from_env()
    if rank == 0:
        all_local = all(store.get(f"{key}/local/{r}") == b"1" for r in range(world))
        secret, source = env or (secrets.token_bytes(32), "local-file" if all_local else "store")
        if env is None and all_local:
            write_private(os.path.join(directory, "secret"), secret)
        elif env is None:
            store.set(f"{key}/secret", secret.hex())
            log.warning("the ranks span hosts and %s is not set: the job's secret travels through the torch store, which "
                        "anyone who can reach MASTER_ADDR:MASTER_PORT can read; set %s on every node for a network you "
                        "do not trust", SECRET_ENV, SECRET_ENV)
        bind = (f"ipc://{os.path.join(directory, 'ranks')}",)
        if not all_local:
            bind += (f"tcp://{address_towards(os.environ.get('MASTER_ADDR', '127.0.0.1'))}:0",)
        job = secrets.token_bytes(16)
        store.set(f"{key}/plan", f"{int(all_local)} {source} {job.hex()}")
        return Plan(all_local, secret, source, job, directory, bind)
    all_local, source, job = store.get(f"{key}/plan").decode().split(" ")
    if source in ("env", "file"):
        if env is None:
            raise SecretError(f"rank 0 uses {SECRET_ENV} / {SECRET_FILE_ENV}, but it is not set on rank {rank}")
        secret = env[0]
    elif source == "local-file":
        secret = _read(os.path.join(directory, "secret"))
        if secret is None:
            raise SecretError(f"rank {rank} cannot read the job's secret in {directory}")
    else:
        secret = bytes.fromhex(store.get(f"{key}/secret").decode())
    return Plan(all_local == "1", secret, source, bytes.fromhex(job), directory if local else None)


def write_private(path: str, data: bytes) -> None:
    """A new file readable by this user only (fails if it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def address_towards(peer_host: str) -> str:
    """This host's address on the interface that routes to ``peer_host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(peer_host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
