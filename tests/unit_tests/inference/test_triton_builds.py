"""The Triton build counter counts: ``EngineStats.triton_builds_after_warmup == 0`` in the GPU
tests means something only if a build raises it. The Triton that ``.[test]`` installs has the
build hook, so installing must succeed here; on CUDA a real build of a new specialization counts."""
import pytest
import torch

from megatron_async.inference import triton_builds

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
