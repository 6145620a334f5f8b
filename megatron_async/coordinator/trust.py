"""The control plane's shared secret and where the coordinator may listen.

The coordinator listens on loopback (``tcp://127.0.0.1:PORT``) or ``ipc://PATH`` unless told
otherwise. Every engine and client proves the secret on connecting (transport.py). The secret
comes from, in order: the caller, ``MEGATRON_ASYNC_CLIENT_SECRET``, the file named by
``MEGATRON_ASYNC_CLIENT_SECRET_FILE`` (refused when others can read it), and for a loopback or
ipc address the same-user file the coordinator writes at start (``secret_file``: 0600 in a 0700
directory, Jupyter's token-file pattern: same-user clients just work, other local users are
refused). A non-loopback address without a configured secret is refused at start, naming the
variable to set.

A coordinator on loopback TCP also listens on an ``ipc://`` twin beside its secret file
(``ipc_twin``: the same 0700 directory), and engines and clients given the TCP address connect
there when it exists: a Unix socket's hop costs less than TCP loopback's (one at a time, the
bare relay's 4 hops: 101 us over ipc, 124 us over TCP). Who connects is still proven by the
handshake, in both directions."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
from hashlib import sha256
from pathlib import Path

from megatron_async.inference.communication.rendezvous import MIN_SECRET_BYTES, SecretError, secret_from_env

__all__ = ["ENV_SECRET", "ENV_SECRET_FILE", "SecretError", "ipc_twin", "is_local", "listener_secret", "peer_secret",
           "secret_file"]
ENV_SECRET = "MEGATRON_ASYNC_CLIENT_SECRET"
ENV_SECRET_FILE = "MEGATRON_ASYNC_CLIENT_SECRET_FILE"
SUN_PATH_BYTES = 107
"""The longest path a Unix socket's name takes (Linux: 108 bytes with its NUL)."""


def split_tcp(address: str) -> tuple[str, int] | None:
    """(host, port) of ``tcp://HOST:PORT`` (``[::1]`` accepted), else None."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not an address of the form tcp://HOST:PORT: {address!r}")
    return host.strip("[]"), int(port)


def is_local(address: str) -> bool:
    """ipc://, or TCP on a loopback host."""
    if address.startswith("ipc://"):
        return True
    tcp = split_tcp(address)
    if tcp is None:
        raise ValueError(f"the control plane listens on tcp://HOST:PORT or ipc://PATH, not {address!r}")
    host = tcp[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def secret_file(address: str) -> Path:
    """Where a coordinator on a local ``address`` keeps its secret for same-user clients."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
    name = sha256(address.encode()).hexdigest()[:24]
    return Path(base) / "megatron_async" / f"coordinator-{name}.secret"


def ipc_twin(address: str) -> Path | None:
    """The Unix socket a coordinator on loopback TCP ``address`` also listens on (None: not
    loopback TCP, or a path too long for a socket's name: TCP alone)."""
    if not address.startswith("tcp://") or not is_local(address):
        return None
    path = secret_file(address).with_suffix(".ipc")
    return path if len(os.fsencode(path)) <= SUN_PATH_BYTES else None


def ipc_directory(endpoint: str) -> str | None:
    """The directory of an ``ipc://`` endpoint's socket (None: not ipc): where a coordinator's
    twin lives, its clients' reply sockets live too."""
    return str(Path(endpoint[len("ipc://"):]).parent) if endpoint.startswith("ipc://") else None


def peer_endpoint(address: str) -> str:
    """Where an engine or client of the coordinator at ``address`` connects: its ipc twin when
    one listens on this host (the file is a socket), else ``address``."""
    twin = ipc_twin(address)
    try:
        if twin is not None and stat.S_ISSOCK(twin.stat().st_mode):
            return f"ipc://{twin}"
    except OSError:
        pass
    return address


def _read_private(path: Path) -> bytes:
    st = path.stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or st.st_uid != os.getuid():
        raise SecretError(f"{path} must be owned by this user and readable by nobody else (chmod 600)")
    return path.read_bytes().strip()


def configured_secret(secret: bytes | str | None = None) -> bytes | None:
    """The caller's, or the environment's (rendezvous.secret_from_env's rules); None when neither gives one."""
    if secret is None:
        env = secret_from_env(ENV_SECRET, ENV_SECRET_FILE)
        return None if env is None else env[0]
    secret = secret.encode() if isinstance(secret, str) else secret
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the control plane's secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def listener_secret(address: str, secret: bytes | str | None = None) -> bytes:
    """The coordinator's secret for ``address`` (its bound address: the port is known). A local
    address without a configured one gets a random secret in ``secret_file(address)``."""
    got = configured_secret(secret)
    if got is not None:
        return got
    if not is_local(address):
        raise SecretError(f"the coordinator would listen on {address}, which is not loopback: set {ENV_SECRET} "
                          f"(or {ENV_SECRET_FILE}) on it, its engines and its clients")
    path = secret_file(address)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    got = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(got)
    return got


def peer_secret(address: str, secret: bytes | str | None = None) -> bytes:
    """An engine's or client's secret for the coordinator at ``address``."""
    got = configured_secret(secret)
    if got is not None:
        return got
    path = secret_file(address)
    if is_local(address) and path.exists():
        return _read_private(path)
    raise SecretError(f"no secret for the coordinator at {address}: set {ENV_SECRET} (the coordinator's), or run "
                      "as the user who started it on this host")


def remove_secret_file(address: str) -> None:
    """The secret file and the ipc twin's socket file (libzmq leaves it behind)."""
    for path in (secret_file(address), ipc_twin(address)):
        try:
            if path is not None:
                path.unlink()
        except FileNotFoundError:
            pass
