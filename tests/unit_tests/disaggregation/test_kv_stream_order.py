"""A chunked transfer (kv_stream.send_blocks / recv_blocks over a loopback wire) lands every
block of every layer where the decode side asked, through the one-launch chunk kernel
(interpreted on CPU) as through the per-layer torch ops; the decode side posts its first two
receives before it waits for its pool (``before_scatter``: on a GPU, the steps still in flight),
and that wait comes once, before the first write into the pool."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
import torch

from megatron_async.disaggregation.kv_layout import KVLayout
from megatron_async.disaggregation.kv_stream import Clock, Staging, recv_blocks, send_blocks

SHAPES = [(4, 2, 8), (4, 1, 16), (4, 3, 8)]  # [block, heads, head_dim] per layer
BLOCKS = 16


class _Done:
    def wait(self) -> None:
        pass


class _Recording(KVLayout):
    """A layout whose scatters are written into ``log``."""

    def __init__(self, context, log: list, one_launch: bool):
        super().__init__(context, one_launch=one_launch)
        self.log = log

    def scatter(self, buf, idx):
        self.log.append(("scatter", idx.numel()))
        super().scatter(buf, idx)


def _context(seed: int, mamba: bool = False):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, BLOCKS, *s, generator=g) for s in SHAPES]
    states = SimpleNamespace(conv_states=[torch.randn(3, 5, generator=g)], ssm_states=[]) if mamba else None
    return SimpleNamespace(kv_caches=caches, mamba=states)


@pytest.mark.parametrize("one_launch", [False, True])
def test_receives_are_posted_before_the_wait_for_the_pool(one_launch):
    src, dst = _context(1, mamba=True), _context(2, mamba=True)
    send_ids, recv_ids = [3, 0, 9, 14, 6, 11, 1], [15, 2, 7, 4, 12, 8, 5]
    log: list = []
    sender = KVLayout(src, one_launch=one_launch)
    receiver = _Recording(dst, log, one_launch)
    chunk = 2 * sender.block_bytes()  # four chunks: 2 + 2 + 2 + 1 blocks
    wire: deque = deque()

    def send(kind, tensor):
        wire.append(tensor.clone())
        return _Done()

    def recv(kind, tensor):
        log.append(("recv", tensor.numel()))
        tensor.copy_(wire.popleft())
        return _Done()

    state = sender.take_state(1)
    send_blocks(send, Staging(torch.device("cpu"), torch.device("cpu")), sender, send_ids, state, chunk, Clock(False))
    got = recv_blocks(recv, Staging(torch.device("cpu"), torch.device("cpu")), receiver, recv_ids, chunk,
                      lambda: log.append(("wait",)))
    size = 2 * sender.block_bytes()
    assert log[:3] == [("recv", size), ("recv", size), ("wait",)]  # (the wire ran ahead of the wait)
    assert [e for e in log if e[0] == "wait"] == [("wait",)] and log[3] == ("scatter", 2)
    assert [e[1] for e in log if e[0] == "scatter"] == [2, 2, 2, 1]
    assert torch.equal(got, state[0].view(-1).view(torch.uint8))  # the Mamba state's bytes, last
    for s, d in zip(src.kv_caches, dst.kv_caches):
        for i, j in zip(send_ids, recv_ids):
            assert torch.equal(d[:, j], s[:, i])
    untouched = [j for j in range(BLOCKS) if j not in recv_ids]
    for d, before in zip(dst.kv_caches, _context(2).kv_caches):
        assert torch.equal(d[:, untouched], before[:, untouched])
    assert (receiver._table is not None) == one_launch
