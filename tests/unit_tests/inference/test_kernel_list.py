"""Kept kernel lists (kernel_list.py): a dry pass that captured every shape writes every
specialization the process met; a later start-up of the same key builds that list instead of
capturing dry; a pass with shapes left, or an unreadable list, changes nothing. The dry pass and
the builds need CUDA: they stand in here."""
import pytest

from megatron_async.inference import triton_builds
from megatron_async.inference.text_generation_controllers import kernel_list
from megatron_async.inference.text_generation_controllers.kernel_prebuild import PrebuildReport

triton = pytest.importorskip("triton")


class _Jit:
    module = "kernel_list_test"

    class fn:
        __qualname__ = "k"


@pytest.fixture
def listed(monkeypatch, tmp_path):
    from triton.runtime.jit import _triton_jit_function_registry as registry

    jit, path, calls = _Jit(), tmp_path / "megatron_async_kernels" / "key.json", {"dry": 0, "built": []}
    monkeypatch.setitem(registry, "kernel_list_test:k", jit)  # where a later process finds the kernel
    monkeypatch.setattr(kernel_list, "list_path", lambda runner, shapes: path)

    def dry(runner, shapes, threads, also=None, built_before=frozenset(), share=None):
        calls["dry"] += 1
        return PrebuildReport(2, threads, 1.0, 0.5, len(shapes), calls.get("left", []), specs=[(jit, "a"), (jit, "b")])

    def build_all(specs, threads, share=None):
        calls["built"].append(specs)
        return triton_builds.BuildReport(len(specs), threads, 0.1)

    monkeypatch.setattr(kernel_list, "prebuild", dry)
    monkeypatch.setattr(triton_builds, "build_all", build_all)
    return jit, path, calls


def test_a_whole_dry_pass_is_kept_and_a_later_start_up_builds_the_list(listed):
    jit, path, calls = listed
    first = kernel_list.prebuild_listed(None, ["s1", "s2"], 4)
    assert calls["dry"] == 1 and not first.listed and path.exists()
    again = kernel_list.prebuild_listed(None, ["s1", "s2"], 4)
    assert calls["dry"] == 1 and again.listed and again.shapes == 0 and again.left == []
    assert calls["built"] == [[(jit, "a"), (jit, "b")]]
    assert again.describe().startswith("the kept kernel list, 2 kernels on 4 threads")


def test_a_pass_with_shapes_left_keeps_nothing_and_a_bad_list_is_ignored(listed):
    jit, path, calls = listed
    calls["left"] = ["s2"]
    kernel_list.prebuild_listed(None, ["s1", "s2"], 4)
    assert not path.exists()
    path.parent.mkdir(parents=True)
    path.write_text('{"kernels": [["no_such_module_here:k", "a"]]}')
    assert not kernel_list.prebuild_listed(None, ["s1", "s2"], 4).listed and calls["dry"] == 2


def test_lists_are_off_unless_asked():
    from types import SimpleNamespace

    from megatron_async.config import InferenceConfig

    assert not InferenceConfig().kernels().startup_kernel_lists
    runner = SimpleNamespace(kernel_lists=False)  # the key (which needs CUDA) is not even computed
    assert kernel_list.list_path(runner, []) is None


def test_the_hook_remembers_every_specialization_it_meets():
    from triton import knobs

    assert triton_builds.install()

    class Info:
        name = "k"
        jit_function = _Jit()

    knobs.runtime.jit_cache_hook(fn=Info(), key="x", compile={"specialization_data": "seen-1"},
                                 is_manual_warmup=False, already_compiled=False)
    assert (Info.jit_function, "seen-1") in triton_builds.seen()


def test_the_key_keeps_the_kv_layout_but_not_the_pool_size():
    import torch

    def pools(blocks, heads=8, dtype=torch.bfloat16):
        return [torch.empty(2, blocks, 16, heads, 4, dtype=dtype, device="meta") for _ in range(3)]

    assert kernel_list.kv_layout(pools(40312)) == kernel_list.kv_layout(pools(40352))
    assert kernel_list.kv_layout(pools(40312)) != kernel_list.kv_layout(pools(40312, heads=4))
    assert kernel_list.kv_layout(pools(40312)) != kernel_list.kv_layout(pools(40312, dtype=torch.float8_e4m3fn))


def test_kernel_lists_key_on_the_tp_and_ep_ranks():
    """A rank-valued kernel argument of 1 specializes apart: each rank of a job keeps its own list."""
    from torch import nn

    from megatron_async.parallel.state import ParallelState

    def model(**ranks) -> nn.Module:
        m = nn.Module()
        m.parallel = ParallelState(**ranks)
        return m

    keys = {kernel_list._parallel(model(tp_rank=r, tp_size=2)) for r in (0, 1)}
    keys |= {kernel_list._parallel(model(ep_rank=r, ep_size=2)) for r in (0, 1)}
    assert len(keys) == 4 and "" not in keys
    # the fused all-reduce's kernels: one-shot only, or its two-shot kernel too
    fused = [type("Reducer", (), {"fused_max_bytes": 1 << 20, "peers": type("Peers", (), {"second_barrier": two})})()
             for two in (False, True)]
    assert len({kernel_list._parallel(model(tp_rank=0, tp_size=4, tp_reducer=r)) for r in fused}) == 2
    assert kernel_list._parallel(model()) == "" and kernel_list.build_share(
        type("Runner", (), {"model": model()})()) is None  # one rank: no key part, no host share
