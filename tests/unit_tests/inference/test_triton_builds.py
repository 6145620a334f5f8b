"""The Triton build counter counts: ``EngineStats.triton_builds_after_warmup == 0`` in the GPU
tests means something only if a build raises it. The Triton that ``.[test]`` installs has the
build hook, so installing must succeed here; on CUDA a real build of a new specialization counts."""
import pytest
import torch

from megatron_async.inference import triton_builds, triton_workers

triton = pytest.importorskip("triton")


def test_install_sets_the_hook_and_a_hook_call_counts_and_chains(monkeypatch):
    from triton import knobs

    assert triton_builds.install()
    assert triton_builds.install()  # idempotent
    assert knobs.runtime.jit_cache_hook is triton_builds._hook
    chained = []  # a hook set before ours keeps being called
    monkeypatch.setitem(triton_builds._state, "prev", lambda *a, **k: chained.append(k.get("fn")))
    before = triton_builds.builds()

    class Fn:
        name = "probe_kernel"

    # what Triton's JITFunction._do_compile does for a specialization it has not built
    assert not knobs.runtime.jit_cache_hook(fn=Fn(), key="k", compile={}, is_manual_warmup=False, already_compiled=False)
    assert triton_builds.builds() == before + 1
    if before < 200:
        assert triton_builds.built_names(before) == ["probe_kernel"]
    assert len(chained) == 1 and chained[0].name == "probe_kernel"


def test_builds_in_an_uncounted_block_are_not_counted_in_that_thread_only(monkeypatch):
    """A background compile no step waits for (the IPC table copy's) is not a kernel the warm-up
    missed: inside ``uncounted()`` the hook only chains; another thread's builds still count."""
    import threading

    from triton import knobs

    assert triton_builds.install()
    chained = []
    monkeypatch.setitem(triton_builds._state, "prev", lambda *a, **k: chained.append(k.get("fn")))

    class Fn:
        name = "background_kernel"

    def build():
        return knobs.runtime.jit_cache_hook(fn=Fn(), key="k", compile={}, is_manual_warmup=False,
                                            already_compiled=False)

    before = triton_builds.builds()
    with triton_builds.uncounted():
        assert not build()  # Triton builds it as usual
        other = threading.Thread(target=build)
        other.start()
        other.join()
    assert triton_builds.builds() == before + 1  # the other thread's build only
    assert len(chained) == 2
    build()
    assert triton_builds.builds() == before + 2  # counted again after the block


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_build_counts_once_per_specialization():
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)

    assert triton_builds.install()
    x = torch.ones(100, device="cuda")
    before = triton_builds.builds()
    scale[(1,)](x, 100, FACTOR=3, BLOCK=128)
    assert triton_builds.builds() == before + 1
    scale[(1,)](x, 100, FACTOR=3, BLOCK=128)  # built: no new build
    assert triton_builds.builds() == before + 1
    scale[(1,)](x, 100, FACTOR=5, BLOCK=128)  # a new constexpr is a new specialization
    assert triton_builds.builds() == before + 2
    assert torch.equal(x, torch.full_like(x, 45.0))


class _Jit:
    """Stands in for a JITFunction: ``preload`` is what build_all calls on each recorded one."""

    def __init__(self):
        self.preloaded, self.loaded = [], []

    def preload(self, data):
        self.preloaded.append(data)
        jit = self

        class Compiled:
            def _init_handles(self):
                jit.loaded.append(data)

        return Compiled()


def _hook_call(jit, data):
    from triton import knobs

    class Info:
        name = "k"
        jit_function = jit

    return knobs.runtime.jit_cache_hook(fn=Info(), key=data, compile={"specialization_data": data},
                                        is_manual_warmup=False, already_compiled=False)


def test_deferring_records_each_specialization_once_skips_it_and_counts_no_build():
    assert triton_builds.install()
    jit, before = _Jit(), triton_builds.builds()
    with triton_builds.deferring() as specs:
        assert _hook_call(jit, "a") is True  # Triton then neither builds nor launches
        assert _hook_call(jit, "a") is True
        assert _hook_call(jit, "b") is True
        assert specs == []  # filled when the block closes
    assert sorted(d for _, d in specs) == ["a", "b"] and all(j is jit for j, _ in specs)
    assert triton_builds.builds() == before
    assert not _hook_call(jit, "c")  # closed: builds count again
    assert triton_builds.builds() == before + 1


def test_deferring_hands_each_new_specialization_to_the_compile_workers_at_once(monkeypatch):
    assert triton_builds.install()
    jit, submitted = _Jit(), []
    monkeypatch.setattr(triton_workers, "submit", lambda j, data: submitted.append(data))
    with triton_builds.deferring():
        _hook_call(jit, "a")
        _hook_call(jit, "a")
        _hook_call(jit, "b")
    assert submitted == ["a", "b"]


def test_deferring_is_the_opening_threads_only():
    import threading

    assert triton_builds.install()
    jit, answers = _Jit(), []
    with triton_builds.deferring() as specs:
        t = threading.Thread(target=lambda: answers.append(_hook_call(jit, "other")))
        t.start()
        t.join()
    assert specs == [] and not answers[0]


def test_build_all_preloads_and_loads_every_recorded_specialization():
    jit = _Jit()
    report = triton_builds.build_all([(jit, "a"), (jit, "b"), (jit, "c")], threads=8)
    assert sorted(jit.preloaded) == ["a", "b", "c"] and sorted(jit.loaded) == ["a", "b", "c"]
    assert report.kernels == 3 and report.threads == 3
    assert triton_builds.build_all([], threads=8).kernels == 0


def test_cache_dir_follows_triton_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_builds.cache_dir() == str(tmp_path)
    assert 1 <= triton_workers.build_threads(None) <= 16 and triton_workers.build_threads(3) == 3


@pytest.mark.parametrize("cores,local_ranks,want", [(64, "4", 16), (16, "4", 4), (2, "4", 1), (64, None, 16), (8, None, 8)])
def test_build_threads_default_to_this_ranks_share_of_the_cores(monkeypatch, cores, local_ranks, want):
    """torchrun's ranks of one host start up at once: each takes its share of the cores, at most 16."""
    monkeypatch.setattr(triton_workers.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if local_ranks is not None:
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert triton_workers.build_threads(None) == want and triton_workers.build_threads(0) == 0


def test_compile_workers_find_kernels_without_triton_registry(monkeypatch):
    """Triton 3.6 (the CUDA 13 wheels' pin) has no ``_triton_jit_function_registry``: a worker
    finds the kernel as its module's attribute (without this every worker compile failed and the
    threads compiled them all again)."""
    import triton.runtime.jit as triton_jit

    from megatron_async.inference import triton_workers
    from megatron_async.kernels import triton_step_inputs

    key = "megatron_async.kernels.triton_step_inputs:_resolve_ids_kernel"
    found = triton_workers.jit_function(key)  # the registry's entry where Triton keeps one (3.9+); where this
    raw = getattr(found, "fn", found)  # process imported the module under the interpreter, its attribute differs
    assert (raw.__module__, raw.__qualname__) == ("megatron_async.kernels.triton_step_inputs", "_resolve_ids_kernel")
    if hasattr(triton_jit, "_triton_jit_function_registry"):
        monkeypatch.delattr(triton_jit, "_triton_jit_function_registry")
    assert triton_workers.jit_function(key) is triton_step_inputs._resolve_ids_kernel
