"""A small-message tensor-parallel all-reduce through CUDA P2P instead of NCCL.

Decode all-reduces are tiny (batch x hidden x 2 bytes: 8 KB at batch 1, 1 MB at batch 128 for a
4096-wide model) and there are two per layer, so NCCL's fixed cost per collective (ring / tree
steps, protocol handshakes) dominates them. Here every rank of the TP group owns one buffer of
torch symmetric memory: the same-size allocation on every rank, mapped into the others' address
space once at load. A call is then
- one-shot (small messages): one kernel copies this rank's tensor into its buffer, meets the
  other ranks at a barrier of flags in the buffers' signal pads, reads every rank's copy over
  NVLink and writes the sum (each rank reads N x the message; the fewest steps);
- two-shot (medium messages): after a copy into the buffer, each rank sums 1/N of the elements
  from every rank and the ranks gather the summed slices (N x fewer bytes read per rank);
- NCCL above ``max_bytes``, for dtypes other than fp32 / bf16, and for odd sizes.
Multicast (NVLS, multimem instructions) is never used: on shared hosts it can take the GPUs down.

A second symmetric allocation (its own buffer and signal pads, two halves of world_size
messages) serves the all-reduce fused with the residual add and the next RMSNorm
(``add_rms_norm``, kernels/triton_fused_all_reduce.py): a row-parallel layer whose output goes
straight into a block's norm hands over its partial product unreduced
(``communication.PendingSum``) and the norm runs one kernel instead of two.

CUDA-graph safe: the buffer and its peer mappings are fixed at load, each call launches one or
two kernels on the current stream, and the barrier flags return to zero by the end of every
call, so a replay behaves like the captured call. All ranks take the same path because the
choice depends only on the tensor's size, dtype and layout, which are equal on every TP rank."""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist

from megatron_async.config import AllReduceBackend
from megatron_async.parallel.p2p_checks import SELF_TEST_TIMEOUT_S, all_agree, group_problem, local_problem, wait_or_raise
from megatron_async.parallel.state import ParallelState

log = logging.getLogger("megatron_async")

ONE_SHOT_MAX_BYTES = 512 << 10
"""Messages up to this size use one-shot, larger ones two-shot (a bandwidth trade: one-shot
reads world_size x the message per rank). ``python -m benchmarks all-reduce --groups 4`` in CUDA
graphs, 4x H200: one-shot 11.8 / 14.1 / 19.4 / 31.5 us at 256 KB / 512 KB / 1 MB / 2 MB,
two-shot 14.9 / 15.8 / 18.2 / 26.6: the crossover lies between 512 KB and 1 MB."""

FUSED_NORM_MAX_BYTES = 2 << 20
"""Largest partial product the fused all-reduce + add + RMSNorm takes (also at most max_bytes /
world_size; its buffer holds two halves of world_size messages, one pushed by every rank);
larger ones (prefill) are reduced first, then normed as before.
``python -m benchmarks all-reduce --fused`` times both paths per size."""

FUSED_MAX_PROGRAMS = 128
"""Grid cap of the fused kernel (each program owns rows and one flag slot per rank); lower
when the signal pads are small."""

_DTYPES = (torch.float32, torch.bfloat16)  # what torch's symmetric-memory reduce kernels dispatch
_TWO_SHOT_WORLD_SIZES = (2, 4, 8)  # torch's two-shot kernel with an output tensor exists for these only
# Set before the first symmetric allocation: multicast objects are never created.
_NO_MULTICAST_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class P2PAllReduceUnavailable(RuntimeError):
    """``tp_all_reduce="p2p"`` was asked for but the TP group cannot set up P2P buffers."""


def with_p2p_all_reduce(parallel: ParallelState, backend: AllReduceBackend | str, max_bytes: int,
                        device: torch.device, fused_norm: bool = True) -> ParallelState:
    """``parallel`` with its TP group's P2P all-reduce attached (``parallel.tp_reducer``), or
    unchanged when the backend is NCCL, TP is off, ``max_bytes`` is 0, or (AUTO) the group cannot
    use P2P. ``fused_norm``: also offer the all-reduce fused with the next add + RMSNorm.
    Collective over the TP group on CUDA; call it on every rank before building layers."""
    backend = AllReduceBackend(backend)
    if parallel.tp_size == 1 or backend is AllReduceBackend.NCCL or max_bytes == 0:
        return parallel
    reducer = P2PAllReduce.create(parallel.tp_group, torch.device(device), max_bytes,
                                  required=backend is AllReduceBackend.P2P, fused_norm=fused_norm)
    return parallel if reducer is None else dataclasses.replace(parallel, tp_reducer=reducer)


def check_p2p_possible(backend: AllReduceBackend | str, tp_size: int, device: torch.device) -> None:
    """Raise P2PAllReduceUnavailable now, before any process group exists, when P2P is required
    and this device can never take part: every rank decides alike, and no rank leaves while its
    peers are still connecting (a rank that left mid-way failed their gloo set-up instead)."""
    if AllReduceBackend(backend) is AllReduceBackend.P2P and tp_size > 1 and torch.device(device).type != "cuda":
        _unavailable(local_problem(torch.device(device)), required=True)


class P2PAllReduce:
    """The TP group's symmetric buffer and the size rules; call ``accepts`` then ``all_reduce``.
    Build it with ``create`` (collective over the TP group)."""

    def __init__(self, group, buffer: torch.Tensor, max_bytes: int, one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
                 peers: PeerTables | None = None):
        self.group = group
        self.group_name = group.group_name
        self.buffer = buffer
        self.peers = peers
        """Every rank's fused buffer and signal-pad address, for the fused kernel (None: not fused)."""
        pow2 = peers is not None and peers.world_size & (peers.world_size - 1) == 0
        self.fused_max_bytes = fused_message_bytes(max_bytes, peers.world_size) if pow2 else 0
        """Largest partial product ``fuses_norm`` takes; 0 turns the fused path off (mutable,
        like ``max_bytes``, for A/B runs in one process). Off for TP sizes that are not powers of 2."""
        self.max_bytes = max_bytes
        """Largest message taken (<= the buffer); mutable: 0 sends everything to NCCL (benchmarks
        compare both paths in one process this way; CUDA graphs keep the path they captured)."""
        self.one_shot_max_bytes = one_shot_max_bytes
        self.two_shot = dist.get_world_size(group) in _TWO_SHOT_WORLD_SIZES and hasattr(
            torch.ops.symm_mem, "two_shot_all_reduce_out")
        """Messages above ``one_shot_max_bytes`` go two-shot; without it (other group sizes,
        older torch) they go to NCCL."""
        self.calls: Counter = Counter()
        """Host-side count of calls per path ("one_shot", "two_shot", "fused_norm"); a graph counts
        at capture."""

    @classmethod
    def create(cls, group, device: torch.device, max_bytes: int, required: bool,
               fused_norm: bool = True) -> P2PAllReduce | None:
        """Collective over ``group``: every rank checks itself, the ranks agree, and only if all
        can do they allocate and exchange the buffer. None (NCCL for everything) when some rank
        cannot, or raise P2PAllReduceUnavailable (on every rank) when ``required``. The fused
        norm path is kept only if it passes its own self-test on every rank."""
        problem = local_problem(device)
        if problem is not None and device.type != "cuda":  # gloo group: decided alike on every rank, no collective
            return _unavailable(problem, required)
        problem, buffer, peers = group_problem(group, device, problem), None, None
        if problem is None:
            try:
                buffer = _rendezvous_buffer(group, device, max_bytes)[0]
            except Exception as e:  # noqa: BLE001 - any failure means: use NCCL
                problem, buffer = f"symmetric memory setup failed on rank {dist.get_rank(group)}: {e}", None
            if buffer is not None and fused_norm:
                try:  # the fused path's own allocation: optional, its failure leaves plain P2P on
                    peers = _fused_peer_tables(group, device, max_bytes)
                except Exception as e:  # noqa: BLE001 - the ranks agree on the fused path below
                    log.warning("fused all-reduce + RMSNorm off: its symmetric buffer failed (%s)", e)
        if not all_agree(problem is None, group, device):
            return _unavailable(problem or "symmetric memory setup failed on another rank", required)
        reducer = cls(group, buffer, max_bytes, peers=peers)
        problem = reducer.self_test()
        if not all_agree(problem is None, group, device):
            reducer.close()
            return _unavailable(problem or "the self-test failed on another rank", required)
        if fused_norm and all_agree(reducer.fused_max_bytes > 0, group, device):  # every rank has the tables
            problem = fused_self_test(reducer)
            if not all_agree(problem is None, group, device):
                log.warning("fused all-reduce + RMSNorm off: %s", problem or "its self-test failed on another rank")
                reducer.fused_max_bytes = 0
            else:
                _settle_two_shot(reducer, group, device)
        else:
            reducer.fused_max_bytes = 0
        return reducer

    def self_test(self, timeout_s: float = SELF_TEST_TIMEOUT_S) -> str | None:
        """Sum exactly representable values through one-shot (and two-shot) and compare bit for
        bit: a problem string if a sum is wrong. Raises RuntimeError if the kernels do not finish
        within ``timeout_s`` (P2P mappings that do not work spin forever: an error, not a hang)."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        sizes = [1024] + ([self.one_shot_max_bytes // 4 + 64] if self.two_shot else [])
        sizes = [n for n in sizes if 4 * n <= self.max_bytes]
        device = self.buffer.device
        results = []
        for n in sizes:
            pattern = torch.arange(n, device=device, dtype=torch.float32) % 7
            x = pattern + (rank + 1)
            results.append((self.all_reduce(x), pattern * world + world * (world + 1) // 2))
        wait_or_raise(timeout_s, f"P2P all-reduce self-test on rank {rank}")
        self.calls.clear()
        bad = [x.numel() for x, want in results if not torch.equal(x, want)]
        return f"self-test sums wrong on rank {rank} for {bad} elements" if bad else None

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the P2P path (the same answer on every rank for the same shape)."""
        nbytes = x.numel() * x.element_size()
        # The kernels' vector width must be the same for the buffer (offset 0) and x: a 16-byte
        # aligned start and a size that is a multiple of 4 bytes give both min(16, size alignment).
        return (x.is_cuda and x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes and nbytes % 4 == 0
                and (self.two_shot or nbytes <= self.one_shot_max_bytes)
                and x.is_contiguous() and (x.storage_offset() * x.element_size()) % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (``accepts(x)`` must hold)."""
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        if nbytes <= self.one_shot_max_bytes:
            self.calls["one_shot"] += 1
            # Each thread copies its elements of x into the buffer before the barrier and writes
            # the same elements of the sum after it, so the output may be x itself.
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, x)
        else:
            self.calls["two_shot"] += 1
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, x)
        return x

    def fuses_norm(self, partial: torch.Tensor) -> bool:
        """Whether a row-parallel layer may hand ``partial`` to the next norm unreduced (the same
        answer on every rank for the same shape); the norm then calls ``add_rms_norm``."""
        return (partial.is_cuda and partial.dim() == 2 and partial.is_contiguous()
                and self.fuses_rows(partial.shape[0], partial.shape[1], partial.dtype))

    def fuses_rows(self, rows: int, hidden: int, dtype: torch.dtype) -> bool:
        """``fuses_norm`` for a contiguous CUDA partial of this shape, before it is computed (a
        row-parallel layer then may hand over K-split partials instead)."""
        return dtype in _DTYPES and 0 < rows * hidden * dtype.itemsize <= self.fused_max_bytes

    def add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     cast_before_weight: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(residual + sum of the group's partials), that sum) in one kernel, or None when
        the fused kernel does not take these tensors (e.g. a float32 residual stream under bf16
        activations): the caller then reduces and norms as usual. Decided alike on every rank.
        ``partial``: this rank's rows, or its [splits, rows, hidden] float32 K-split partials."""
        from megatron_async.kernels import triton_fused_all_reduce as fused

        if not fused.supported(partial, residual, weight, self.peers.world_size):
            return None
        self.calls["fused_norm"] += 1
        p = self.peers
        return fused.all_reduce_add_rms_norm(partial, residual, weight, eps, cast_before_weight, p.buffers,
                                             p.signal_pads, p.state, p.half_bytes, p.rank, p.max_programs,
                                             two_shot=p.second_barrier)

    def close(self) -> None:
        """Drop the buffer (before the process group goes); later calls all go to NCCL."""
        self.buffer, self.max_bytes, self.peers, self.fused_max_bytes = None, 0, None, 0


def fused_message_bytes(max_bytes: int, world_size: int) -> int:
    """Largest partial product of the fused path (16-byte multiple)."""
    return min(FUSED_NORM_MAX_BYTES, max_bytes // world_size) // 16 * 16


@dataclasses.dataclass(frozen=True)
class PeerTables:
    """Where the fused kernel finds every rank's buffer and signal pad (int64 addresses on this
    GPU, fixed for the process's life: CUDA-graph safe), and this rank's call counter."""

    buffers: torch.Tensor
    signal_pads: torch.Tensor
    rank: int
    world_size: int
    max_programs: int
    """Grid cap: max_programs x world_size int32 flags (one per program and rank) fit the signal pad."""
    allocation: torch.Tensor
    """This rank's symmetric buffer (kept alive with the tables)."""
    half_bytes: int
    """Each buffer is two halves of this size, used alternately (``kernels/triton_p2p_sync``)."""
    state: torch.Tensor
    """int32 [2] on this GPU: (calls so far, arrivals in the current call); the kernels' own."""
    second_barrier: bool = False
    """The signal pad holds a second region of max_programs x world_size flags (the fused two-shot
    kernel's second barrier)."""


def fused_self_test(reducer: P2PAllReduce, rows: int = 3, hidden: int = 256) -> str | None:
    """Run the fused kernel once on exactly representable float32 values: None when the new
    residual is exact and the norm close to torch's, else what went wrong (raises on a hang)."""
    rank, world, device = reducer.peers.rank, reducer.peers.world_size, reducer.buffer.device
    pattern = (torch.arange(rows * hidden, device=device, dtype=torch.float32) % 5).view(rows, hidden)
    residual = torch.ones(rows, hidden, device=device)
    weight = torch.full((hidden,), 0.5, device=device)
    try:
        got = reducer.add_rms_norm(pattern + (rank + 1), residual, weight, 1e-6, True)
    except Exception as e:  # noqa: BLE001 - a Triton compile / launch problem: keep the unfused path
        return f"fused kernel failed on rank {rank}: {e}"
    wait_or_raise(SELF_TEST_TIMEOUT_S, f"fused all-reduce + RMSNorm self-test on rank {rank}")
    reducer.calls.clear()
    if got is None:
        return f"fused kernel refused float32 [{rows}, {hidden}] at world {world}"
    want = pattern * world + world * (world + 1) // 2 + 1
    normed = weight * want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-6)
    if not torch.equal(got[1], want) or not torch.allclose(got[0], normed, rtol=1e-5, atol=1e-6):
        return f"fused self-test values wrong on rank {rank}"
    return None


def _settle_two_shot(reducer: P2PAllReduce, group, device: torch.device) -> None:
    """Keep the fused two-shot kernel only where every rank's pad holds its second barrier, a
    message of its size fits the fused path, and a self-test at that size passes on every rank
    (else its messages go one-shot, with a warning). Collective over ``group``."""
    from megatron_async.kernels.triton_fused_all_reduce import TWO_SHOT_MIN_BYTES, takes_two_shot

    hidden = 256
    rows = TWO_SHOT_MIN_BYTES // (4 * hidden)  # float32 rows the kernel takes two-shot
    probe = torch.empty(rows, hidden, device="meta")
    usable = (reducer.peers.second_barrier and reducer.fuses_rows(rows, hidden, torch.float32)
              and takes_two_shot(probe, probe, reducer.peers.world_size))
    if all_agree(usable, group, device):
        problem = fused_self_test(reducer, rows, hidden)
        if all_agree(problem is None, group, device):
            return
        log.warning("fused all-reduce + RMSNorm two-shot off: %s", problem or "its self-test failed on another rank")
    reducer.peers = dataclasses.replace(reducer.peers, second_barrier=False)


def _rendezvous_buffer(group, device: torch.device, nbytes: int) -> tuple[torch.Tensor, object]:
    """A symmetric buffer of ``nbytes`` on every rank of ``group`` and its rendezvous handle.
    Collective: the ranks agree that every allocation succeeded before the rendezvous (a rank
    whose allocation raised would never join it, and the others would wait there forever);
    if one failed, every rank raises RuntimeError."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer, error = None, None
    try:
        for key, value in _NO_MULTICAST_ENV.items():
            os.environ[key] = value
        with warnings.catch_warnings():  # older torch needs it, newer deprecates it
            warnings.simplefilter("ignore")
            enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: False)
            if hasattr(symm_mem, "enable_symm_mem_for_group") and not enabled(group.group_name):
                symm_mem.enable_symm_mem_for_group(group.group_name)
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    except Exception as e:  # noqa: BLE001 - reported below, on every rank
        error = e
    if not all_agree(error is None, group, device):
        where = f"on rank {dist.get_rank(group)}: {error}" if error is not None else "on another rank"
        raise RuntimeError(f"symmetric allocation of {nbytes} bytes failed {where}")
    return buffer, symm_mem.rendezvous(buffer, group.group_name)


def _fused_peer_tables(group, device: torch.device, max_bytes: int) -> PeerTables | None:
    """The fused kernel's own symmetric buffer (two halves of world_size messages) and its
    address tables (None, fused path off, if this torch's handle lacks something: the plain P2P
    all-reduce does not need them). Collective over ``group``."""
    world = dist.get_world_size(group)
    half = world * fused_message_bytes(max_bytes, world)
    if half == 0:
        return None
    buffer, handle = _rendezvous_buffer(group, device, 2 * half)
    return peer_tables(handle, buffer, device, half, "fused all-reduce + RMSNorm")


def peer_tables(handle, buffer: torch.Tensor, device: torch.device, half_bytes: int, what: str) -> PeerTables | None:
    """A P2P collective's address tables from a rendezvous handle (``buffer``: two halves of
    ``half_bytes``) and a fresh call counter; None (that path off: ``what``) if this torch's
    handle lacks something."""
    try:
        world, rank = handle.world_size, handle.rank
        shift = buffer.data_ptr() - handle.buffer_ptrs[rank]  # where the tensor starts in its allocation (0)
        pad_bytes = getattr(handle, "signal_pad_size", None)
        pad_slots = (pad_bytes if isinstance(pad_bytes, int) else 2048) // 4  # int32 flags; unknown: assume 2 KB
        # Programs of one rank wait only for the same program on the others: with at most one per
        # SM they can all be resident at once, so none waits behind a program that waits itself.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = min(FUSED_MAX_PROGRAMS, sms, pad_slots // world)
        return PeerTables(
            buffers=torch.tensor([p + shift for p in handle.buffer_ptrs], dtype=torch.int64, device=device),
            signal_pads=torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device),
            rank=rank, world_size=world, max_programs=programs,
            allocation=buffer, half_bytes=half_bytes, state=torch.zeros(2, dtype=torch.int32, device=device),
            second_barrier=pad_slots >= 2 * world * programs)
    except Exception as e:  # noqa: BLE001 - decided alike on every rank (same torch); self-tests agree anyway
        log.warning("%s off: no peer address tables from torch symmetric memory (%s)", what, e)
        return None


def _unavailable(problem: str, required: bool) -> None:
    if required:
        raise P2PAllReduceUnavailable(f"tp_all_reduce='p2p': {problem}")
    log.info("P2P all-reduce off (NCCL / gloo for every size): %s", problem)
    return None
