"""The P2P all-reduce's CPU side: under gloo every backend setting falls back cleanly (AUTO and
NCCL silently, P2P with the same clear error on every rank, no hang; a symmetric allocation that
fails on one rank fails the set-up on every rank, no hang), ``tp_all_reduce`` sends a
message to the group's reducer exactly when it accepts it (never in batch-invariant mode), and
the config knob is validated. The GPU side: tests/functional_tests/test_multigpu_p2p_all_reduce.py."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_async import InferenceConfig  # noqa: E402
from megatron_async.config import AllReduceBackend  # noqa: E402
from megatron_async.parallel.communication import tp_all_reduce  # noqa: E402
from megatron_async.parallel.p2p_all_reduce import P2PAllReduceUnavailable, with_p2p_all_reduce  # noqa: E402
from megatron_async.parallel.state import ParallelState  # noqa: E402
from tests.helpers.multiprocess import run_ranks  # noqa: E402


class _CountingReducer:
    """Stands in for P2PAllReduce: takes messages up to ``max_numel`` and sums them over gloo."""

    def __init__(self, group, max_numel: int):
        self.group, self.max_numel, self.taken = group, max_numel, []

    def accepts(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.taken.append(x.numel())
        dist.all_reduce(x, group=self.group)
        return x


def _gloo_worker(rank: int, world: int) -> dict:
    base = ParallelState.from_torchrun(world, "cpu")
    try:
        out = {}
        for backend in AllReduceBackend:
            try:
                out[backend.value] = with_p2p_all_reduce(base, backend, 8 << 20, torch.device("cpu")).tp_reducer
            except P2PAllReduceUnavailable as e:
                out[backend.value] = str(e)
        out["p2p_off"] = with_p2p_all_reduce(base, "p2p", 0, torch.device("cpu")).tp_reducer  # 0 bytes: nothing asked
        fake = _CountingReducer(base.tp_group, max_numel=8)
        parallel = dataclasses.replace(base, tp_reducer=fake)
        small, large = torch.full((2, 4), float(rank + 1)), torch.full((3, 5), float(rank + 1))
        out["small"] = tp_all_reduce(small, parallel).tolist()
        out["large"] = tp_all_reduce(large, parallel).tolist()
        out["invariant"] = tp_all_reduce(torch.full((2, 4), float(rank + 1)), parallel, batch_invariant=True).tolist()
        out["taken"] = fake.taken
        return out
    finally:
        base.destroy()


def test_gloo_falls_back_and_routes_by_size():
    for rank, got in enumerate(run_ranks(_gloo_worker, 2, timeout_s=60)):
        assert got["auto"] is None and got["nccl"] is None and got["p2p_off"] is None, rank
        assert got["p2p"] == "tp_all_reduce='p2p': needs CUDA devices (device is cpu)"
        assert got["small"] == [[3.0] * 4] * 2 and got["large"] == [[3.0] * 5] * 3
        assert got["invariant"] == [[3.0] * 4] * 2
        assert got["taken"] == [8]  # only the small message, and not the batch-invariant sum


def _llm_worker(rank: int, world: int) -> str:
    from megatron_async import LLM

    cfg = InferenceConfig(max_requests=4, max_tokens=64, num_kv_blocks=16, tp_all_reduce="p2p")
    try:
        LLM(None, inference_config=cfg, tensor_parallel_size=world)
    except P2PAllReduceUnavailable as e:
        return str(e)
    return "built"


def test_llm_asked_for_p2p_on_cpu_fails_on_every_rank():
    assert run_ranks(_llm_worker, 2, timeout_s=60) == ["tp_all_reduce='p2p': needs CUDA devices (device is cpu)"] * 2


def test_config_knob():
    cfg = InferenceConfig(tp_all_reduce="nccl")
    cfg.validate()
    assert cfg.tp_all_reduce is AllReduceBackend.NCCL and InferenceConfig().tp_all_reduce is AllReduceBackend.AUTO
    with pytest.raises(ValueError, match="p2p_all_reduce_max_bytes must be >= 0"):
        InferenceConfig(p2p_all_reduce_max_bytes=-1).validate()
    with pytest.raises(ValueError):
        InferenceConfig(tp_all_reduce="multicast").validate()


def _alloc_worker(rank: int, world: int) -> str:
    """Rank 1's symmetric allocation raises (as an out-of-memory would); the rendezvous is a
    stand-in collective that would block forever with one rank missing."""
    import torch.distributed._symmetric_memory as symm_mem

    from megatron_async.parallel import p2p_all_reduce

    base = ParallelState.from_torchrun(world, "cpu")

    def empty(nbytes, dtype, device):
        if rank == 1:
            raise torch.OutOfMemoryError("no room for the buffer")
        return torch.empty(nbytes, dtype=dtype, device=device)

    def rendezvous(buffer, group_name):
        dist.barrier(group=base.tp_group)
        return "handle"

    symm_mem.empty, symm_mem.rendezvous = empty, rendezvous
    symm_mem.enable_symm_mem_for_group = lambda name: None
    try:
        p2p_all_reduce._rendezvous_buffer(base.tp_group, torch.device("cpu"), 64)
    except RuntimeError as e:
        return str(e)
    finally:
        base.destroy()
    return "allocated"


def test_a_failed_symmetric_allocation_fails_every_rank_without_a_hang():
    assert run_ranks(_alloc_worker, 2, timeout_s=60) == [
        "symmetric allocation of 64 bytes failed on another rank",
        "symmetric allocation of 64 bytes failed on rank 1: no room for the buffer",
    ]


@pytest.mark.parametrize("case", ["kept", "self_test_fails", "no_second_region", "two_ranks", "too_small"])
def test_two_shot_is_kept_only_where_its_pads_sizes_and_self_test_allow(monkeypatch, caplog, case):
    """``_settle_two_shot`` (one process; the ranks' agreement is the identity here): the fused
    two-shot kernel stays on only where the pads hold its second barrier, its messages fit the
    fused path, there are 4+ ranks and its self-test at a two-shot size passes; else it is
    turned off (its messages go one-shot), a failed self-test with a warning."""
    from megatron_async.parallel import p2p_all_reduce as p2p

    monkeypatch.setattr(p2p, "all_agree", lambda ok, group, device: bool(ok))
    tested = []
    monkeypatch.setattr(p2p, "fused_self_test", lambda reducer, rows=3, hidden=256: tested.append((rows, hidden))
                        or ("values wrong" if case == "self_test_fails" else None))
    world = 2 if case == "two_ranks" else 4
    ints = torch.zeros(world, dtype=torch.int64)
    peers = p2p.PeerTables(ints, ints, 0, world, 128, torch.zeros(1), 1 << 20, torch.zeros(2, dtype=torch.int32),
                           second_barrier=case != "no_second_region")

    class _Reducer:
        fused_max_bytes = (256 << 10) if case == "too_small" else (2 << 20)
        fuses_rows = p2p.P2PAllReduce.fuses_rows

    reducer = _Reducer()
    reducer.peers = peers
    with caplog.at_level("WARNING", logger="megatron_async"):
        p2p._settle_two_shot(reducer, None, torch.device("cpu"))
    assert reducer.peers.second_barrier == (case == "kept")
    assert ("two-shot off: values wrong" in caplog.text) == (case == "self_test_fails")
    assert tested == ([(512, 256)] if case in ("kept", "self_test_fails") else [])  # 512 KB of float32 rows
