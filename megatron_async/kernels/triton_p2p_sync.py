"""How the P2P collectives' programs meet their peers: call counters, alternate buffer halves,
and one flag barrier per call (kernels/triton_fused_all_reduce.py, triton_p2p_exchange.py).

Each collective owns a symmetric allocation (a buffer and a signal pad on every rank, mapped
into the peers) and a call counter ``state`` = [epoch, arrivals] in this rank's device memory.
A call:

1. every program reads ``epoch`` (``call_epoch``); its parity picks the buffer half the call
   uses, so consecutive calls write different halves;
2. the program writes its data (its own half, or its slot of the peers' halves), then meets
   the same program on every rank (``epoch_barrier``): it stores ``epoch + 1`` into its flag
   slot in every rank's pad (release, system scope; posted, nothing waits for a reply) and
   spins on its own pad until every rank's flag for it has reached ``epoch + 1`` (acquire);
3. it reads what the barrier made visible, and counts itself out (``finish_call``): the last
   program of the grid advances ``epoch``.

No exit barrier: a rank that runs ahead into call k + 1 writes the other half, and it cannot
start call k + 2 (call k's half again) before each of its programs in call k + 1 has seen the
peers' flags for k + 1, i.e. before every peer has started call k + 1 and so finished call k,
whose kernel ran before on the peer's stream. Flags only grow (compared as a wrapping int32
difference), so a peer one call ahead that already stored ``epoch + 2`` still releases a
program waiting for ``epoch + 1``; nothing is reset, and CUDA-graph replays and eager calls can
mix freely: the counter lives on the device, and every rank makes the same calls, so all
ranks' counters agree. A kernel needs all of a call's programs resident together (grids are
capped at the SM count).

The interpreter (CPU tests) runs one process playing one rank: the peers' flags are raised
beforehand in its pad (see tests/unit_tests/kernels/test_fused_all_reduce.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def call_epoch(state_ptr):
    """Calls of this collective so far (the previous call's last program advanced it)."""
    return tl.load(state_ptr, volatile=True)


@triton.jit
def buffer_half(buf_table_ptr, r, epoch, half, DTYPE: tl.constexpr):
    """Rank ``r``'s buffer (from the pointer table), at the half call ``epoch`` uses (``half``
    elements of DTYPE each; ``&``, not ``%``: the counter may wrap to negative values)."""
    return tl.multiple_of(tl.load(buf_table_ptr + r).to(tl.pointer_type(DTYPE)), 16) + (epoch & 1) * half


def check_fits(nbytes: int, half_bytes: int, what: str) -> None:
    """A call's ``nbytes`` must fit one buffer half, and halves keep 16-byte alignment."""
    if nbytes > half_bytes or half_bytes % 16:
        raise ValueError(f"{what}: {nbytes} bytes do not fit a buffer half of {half_bytes} bytes "
                         "(or it is not 16-byte aligned)")


@triton.jit
def epoch_barrier(pad_table_ptr, slot, rank, epoch, W: tl.constexpr):
    """Program ``slot`` of every rank has reached this point in call ``epoch``."""
    tl.debug_barrier()  # the whole program's earlier stores / loads come before the signal
    lanes = tl.arange(0, W)
    peer_pads = tl.load(pad_table_ptr + lanes).to(tl.pointer_type(tl.int32))
    target = epoch + 1
    tl.atomic_xchg(peer_pads + slot * W + rank, tl.full([W], 0, tl.int32) + target, sem="release", scope="sys")
    my_flags = tl.load(pad_table_ptr + rank).to(tl.pointer_type(tl.int32)) + slot * W + lanes
    # Read the flags with a no-op compare-and-swap (target -> target: acquire, changes nothing).
    # Written in this shape because Triton 3.6 fails to compile (RemoveLayoutConversions) a
    # loop that re-assigns the atomic's result directly or uses atomic_add(0).
    targets = tl.full([W], 0, tl.int32) + target
    pending = tl.full([W], 1, tl.int32)
    while tl.max(pending, axis=0) > 0:
        seen = tl.atomic_cas(my_flags, targets, targets, sem="acquire", scope="sys")
        pending = tl.where(seen - targets >= 0, 0, pending)  # wrapping difference: a flag ahead counts
    tl.debug_barrier()  # no thread reads the peers' data before every flag is seen


@triton.jit
def finish_call(state_ptr, epoch):
    """Count this program out of the call; the last one advances the epoch for the next call."""
    tl.debug_barrier()  # every thread has read the epoch before this program counts as arrived
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, epoch + 1)
