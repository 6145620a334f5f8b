"""The front-ends' listening sockets (serve/launch.py ``bind_group``): on Linux one socket per
front-end on one port, in an SO_REUSEPORT group, so the kernel deals connections across them
evenly; a port another server holds is still refused, and so is a stranger that does not join
the group; elsewhere, or asked not to, one socket that all of them share."""
import socket
import sys

import pytest

from megatron_async.serve import launch
from megatron_async.serve.launch import bind_group

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balances on Linux")


def accepted(socks: list[socket.socket]) -> list[int]:
    """How many waiting connections each socket has (each accepted and closed)."""
    counts = []
    for sock in socks:
        sock.setblocking(False)
        n = 0
        while True:
            try:
                conn, _ = sock.accept()
            except BlockingIOError:
                break
            conn.close()
            n += 1
        counts.append(n)
    return counts


def close_all(socks) -> None:
    for s in set(socks):
        s.close()


@linux_only
@pytest.mark.parametrize("count", [2, 3])
def test_each_frontend_gets_a_socket_of_its_own_and_a_fair_share_of_connections(count):
    socks = bind_group("127.0.0.1", 0, count)
    clients = []
    try:
        port = socks[0].getsockname()[1]
        assert len(set(socks)) == count and {s.getsockname() for s in socks} == {("127.0.0.1", port)}
        assert all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in socks)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64 * count)]
        counts = accepted(socks)
        # a hash of each connection's addresses picks its socket: every one takes 64 +- ~8 of them
        # (below 32 has a chance under 1e-7); a group that sends all to one socket fails
        assert sum(counts) == 64 * count and min(counts) >= 32, counts
    finally:
        close_all(socks + clients)


@linux_only
def test_a_port_in_use_is_refused_and_strangers_cannot_join():
    held = bind_group("127.0.0.1", 0, 2)
    port = held[0].getsockname()[1]
    try:
        with pytest.raises(OSError):  # a second server on the same port, as with one shared socket
            bind_group("127.0.0.1", port, 2)
        stranger = socket.socket()
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            stranger.bind(("127.0.0.1", port))
        stranger.close()
    finally:
        close_all(held)
    # a server holding one plain socket (another program's) keeps a group off its port too
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(1)
    try:
        with pytest.raises(OSError):
            bind_group("127.0.0.1", plain.getsockname()[1], 2)
    finally:
        plain.close()


def test_one_socket_listens_on_a_free_port():
    (sock,) = bind_group("127.0.0.1", 0, 1)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog before any server loop runs
    finally:
        sock.close()


def test_one_shared_socket_when_asked_and_for_one_frontend():
    for count, share_port in ((3, False), (1, True)):
        socks = bind_group("127.0.0.1", 0, count, share_port=share_port)
        try:
            assert len(socks) == count and len(set(socks)) == 1
            if hasattr(socket, "SO_REUSEPORT"):  # nobody may join it
                assert not socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
        finally:
            close_all(socks)


def test_a_platform_without_a_balancing_reuseport_shares_one_socket(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    socks = bind_group("127.0.0.1", 0, 2)
    try:
        assert len(socks) == 2 and socks[0] is socks[1]
    finally:
        close_all(socks)


@linux_only
def test_a_group_that_cannot_form_falls_back_to_one_shared_socket(monkeypatch, caplog):
    real = launch._bound

    def no_joiners(host, port, reuse_port=False):
        if reuse_port:
            raise OSError(92, "Protocol not available")
        return real(host, port, reuse_port)

    monkeypatch.setattr(launch, "_bound", no_joiners)
    socks = bind_group("127.0.0.1", 0, 2)
    try:
        assert socks[0] is socks[1] and not socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
        assert "share one listening socket" in caplog.text
        client = socket.create_connection(socks[0].getsockname())  # it listens
        assert accepted(socks[:1]) == [1]
        client.close()
    finally:
        close_all(socks)
