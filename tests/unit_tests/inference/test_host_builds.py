"""Ranks of one host split the start-up's Triton builds (host_builds.py): every recorded kernel
has exactly one owner whatever the host's rank count, a rank builds its own before the barrier
and the rest after it (the barrier reached even with nothing to build or a failed build), and
over two gloo ranks whose lists differ in one kernel each, a shared kernel compiles once on the
host while each rank still ends with every kernel of its own list (the one no other rank built
compiled by the rank that needs it)."""
import json
import os

import pytest

from megatron_async.inference import host_builds, triton_builds
from tests.helpers.multiprocess import run_ranks

pytest.importorskip("triton")


class _Jit:
    """A kernel whose builds go through a shared "cache" directory: a build of a specialization
    not in it compiles (and logs the compile), one in it loads."""

    module = "host_builds_test"

    class fn:
        __qualname__ = "k"

    def __init__(self, cache: str | None = None, who: str = ""):
        self.cache, self.who, self.order, self.loaded = cache, who, [], []

    def preload(self, data):
        self.order.append(data)
        if self.cache is not None:
            path = os.path.join(self.cache, data)
            if not os.path.exists(path):
                with open(os.path.join(self.cache, "compiles.log"), "a") as log:
                    log.write(f"{data} {self.who}\n")
                with open(path + ".tmp" + self.who, "w") as f:
                    f.write("binary")
                os.replace(path + ".tmp" + self.who, path)
        jit = self

        class Compiled:
            def _init_handles(self):
                jit.loaded.append(data)

        return Compiled()


DATA = [json.dumps({"n": i}) for i in range(40)]


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_every_kernel_has_exactly_one_owner(count):
    jit = _Jit()
    specs = [(jit, d) for d in DATA]
    firsts = [host_builds.HostShare(i, count, lambda: None).split(specs)[0] for i in range(count)]
    assert sorted(d for first in firsts for _, d in first) == sorted(DATA)
    if count > 1:
        assert all(firsts), "with 40 kernels every rank owns some"
    for i in range(count):  # a kernel's owner does not depend on what else a rank recorded
        share = host_builds.HostShare(i, count, lambda: None)
        assert [d for _, d in share.split(specs[5:])[0]] == [d for _, d in firsts[i] if d in DATA[5:]]


def test_a_rank_builds_its_own_then_meets_the_others_then_builds_the_rest():
    jit, events = _Jit(), []
    share = host_builds.HostShare(1, 2, lambda: events.append(list(jit.order)))
    specs = [(jit, d) for d in DATA[:10]]
    report = triton_builds.build_all(specs, 4, share)
    mine, rest = share.split(specs)
    assert mine and rest
    assert [sorted(e) for e in events] == [sorted(d for _, d in mine)]  # one barrier, after its own builds
    assert sorted(jit.loaded) == sorted(DATA[:10]) and report.kernels == 10
    assert report.host.startswith(f"rank 1 of 2 on this host built {len(mine)} first")


def test_the_barrier_is_reached_with_nothing_to_build_and_after_a_failed_build(monkeypatch):
    met = []
    share = host_builds.HostShare(0, 2, lambda: met.append(1))
    assert triton_builds.build_all([], 4, share).kernels == 0 and met == [1]

    def fail(specs, threads):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(triton_builds, "_build_all", fail)
    with pytest.raises(RuntimeError, match="no compiler"):
        triton_builds.build_all([(_Jit(), DATA[0])], 4, share)
    assert met == [1, 1]


def test_no_share_outside_a_distributed_job():
    assert host_builds.host_share(2, "cpu") is None


def _rank(rank: int, world: int, cache: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        share = host_builds.host_share(world, "cpu")
        assert (share.index, share.count) == (rank, world)
        jit = _Jit(cache, f"rank{rank}")
        own = f"only-rank{rank}"  # one kernel of this rank's list alone
        specs = [(jit, d) for d in DATA[:12] + [own]]
        report = triton_builds.build_all(specs, 2, share)
        return {"loaded": sorted(jit.loaded), "want": sorted(DATA[:12] + [own]), "kernels": report.kernels}
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_a_host_compile_each_shared_kernel_once(tmp_path):
    results = run_ranks(_rank, 2, str(tmp_path), timeout_s=120, env={"LOCAL_WORLD_SIZE": "2"})
    for r in results:
        assert r["loaded"] == r["want"] and r["kernels"] == 13
    compiles = (tmp_path / "compiles.log").read_text().split("\n")[:-1]
    by_kernel = {}
    for line in compiles:
        data, who = line.rsplit(" ", 1)
        by_kernel.setdefault(data, []).append(who)
    assert all(len(v) == 1 for v in by_kernel.values()), by_kernel
    assert sorted(by_kernel) == sorted(DATA[:12] + ["only-rank0", "only-rank1"])
    assert {by_kernel[f"only-rank{r}"][0] for r in (0, 1)} == {"rank0", "rank1"}  # each built its own
    owners = {who for d, (who,) in by_kernel.items() if d in DATA[:12]}
    assert owners == {"rank0", "rank1"}, "the shared kernels were split between the ranks"
