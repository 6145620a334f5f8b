"""The plan an engine makes at start for a colocated trainer's update of every Megatron-Core
tensor (``CopyPlanCache.prepare``): the first IPC update of that metadata takes it whatever the
tensors' order and storages, lands the same weights, and is planned anew once the parameters
moved; ``megatron_shapes`` gives the shapes ``megatron_from_hf`` builds, for each TP shard."""
from __future__ import annotations

import torch

from megatron_async.models.megatron_layouts import NameMap, Shard, megatron_from_hf, megatron_names_of, megatron_shapes
from megatron_async.weight_transfer import ipc
from tests.helpers.refit_engine import _shape_info, engine, trainer_items


def test_shapes_from_metadata_equal_the_built_tensors():
    shapes, dims, arch = _shape_info()
    names = NameMap.for_arch(arch)
    hf = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    for shard in (Shard(), Shard(tp_rank=1, tp_size=2)):
        built = megatron_from_hf(names, dims, hf, megatron_names_of(names, hf, dims, shard), shard)
        assert megatron_shapes(names, dims, shapes, megatron_names_of(names, hf, dims, shard), shard) == \
            {n: tuple(t.shape) for n, t in built.items()}


def _payload(items, kept: list):
    """``items`` in shared memory, kept alive in ``kept`` while the engine maps them."""
    shared = [(n, t.clone().share_memory_(), s) for n, t, s in items]
    kept.append(shared)
    return ipc.share(shared)


def test_first_ipc_update_takes_the_plan_made_at_start_in_any_order():
    torch.multiprocessing.set_sharing_strategy("file_system")
    llm, kept = engine(), []
    plans = llm.engine.weights.plans
    assert (plans.misses, plans.hits, plans.reused) == (0, 0, 0) and len(plans._entries) == 2  # planned at start
    shapes, dims, arch = _shape_info()
    items = trainer_items(shapes, 3, 1, dims, arch)
    assert all(t.dtype == next(llm.model.parameters()).dtype for _, t, _ in items)
    llm.engine.update_weights_from_ipc(_payload(items[::-1], kept))  # another order than the start's
    assert (plans.misses, plans.reused) == (0, 1)
    got = [p.detach().clone() for p in llm.model.parameters()]

    reference = engine()
    reference.engine.weights.plans._entries.clear()  # planned at the update, in its own order
    reference.engine.update_weights_from_ipc(_payload(items, kept))
    assert reference.engine.weights.plans.misses == 1
    assert all(torch.equal(a, b) for a, b in zip(got, reference.model.parameters()))


def test_a_moved_parameter_plans_the_update_anew():
    torch.multiprocessing.set_sharing_strategy("file_system")
    llm, kept = engine(), []
    plans = llm.engine.weights.plans
    shapes, dims, arch = _shape_info()
    items = trainer_items(shapes, 4, 1, dims, arch)
    with torch.no_grad():
        for p in llm.model.parameters():  # (as resuming after a suspension may: new storages)
            p.data = p.data.clone().zero_()
    llm.engine.update_weights_from_ipc(_payload(items, kept))
    assert (plans.misses, plans.reused) == (1, 0)  # the start's plan named the old storages
    reference = engine()
    reference.engine.update_weights_from_ipc(_payload(items, kept))
    assert all(torch.equal(a, b) for a, b in zip(llm.model.parameters(), reference.model.parameters()))
