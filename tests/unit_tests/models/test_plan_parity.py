"""The planner's copies and refusals equal the plain answer (tests/helpers/plan_reference.py:
every piece against every destination and every other piece, no lookups kept): on the Megatron-Core
manifests of the qwen3-0.6b shape (trainer TP 1) and the qwen3-8b shape (trainer TP 4) from
metadata, on MoE (EP) and hybrid models, and on random cuts of trainer shards into pieces, in any
order, with a piece dropped or given twice."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.models.default_model import DEFAULT_CONFIGS
from megatron_async.models.gpt import build_gpt
from megatron_async.models.megatron_layouts import Shard
from megatron_async.models.slab_loading import WeightUpdateError
from megatron_async.models.weight_targets import Chunks, TargetTable
from megatron_async.parallel.state import ParallelState
from megatron_async.models.weight_update import CopyPlanCache, plan_update, weight_slabs
from tests.helpers.plan_reference import planned, reference, trainer_metas
from tests.helpers.refit_models import build

REFUSED = "weight update refused, nothing was changed: "


def check_parity(model, metas, table: TargetTable | None = None) -> int:
    """Plan ``metas`` and compare with the reference; returns the copies planned (0: refused)."""
    slabs, inputs = weight_slabs(model, metas, "megatron")
    want, problems = reference(model, slabs, inputs, len(metas))
    if problems:
        with pytest.raises(WeightUpdateError) as e:
            plan_update(model, metas, "megatron", table)
        assert str(e.value) == REFUSED + "; ".join(problems)
        return 0
    plan, program = plan_update(model, metas, "megatron", table)
    assert planned(plan, program) == want
    assert program.expected == sum(t.need for t in plan.touched.values())
    return sum(map(len, want))


@pytest.mark.parametrize("shape,tp,copies,chunked", [("qwen3-0.6b", 1, 898, 310), ("qwen3-8b", 4, 1593, 1161)])
def test_released_shapes_from_metadata(shape, tp, copies, chunked):
    """``copies`` as the reference counts them (one per query group), ``chunked`` as planned (the
    groups of each of q, k, v in one copy)."""
    model = build_gpt(DEFAULT_CONFIGS[shape], torch.bfloat16, torch.device("meta"), None)
    metas = trainer_metas(model, [Shard(tp_rank=r, tp_size=tp) for r in range(tp)])
    table = TargetTable(model).warm()
    assert check_parity(model, metas, table) == copies
    assert check_parity(model, metas, table) == copies  # again, from the table's kept lookups
    assert sum(map(len, plan_update(model, metas, "megatron", table)[1].pairs)) == chunked


def test_an_engine_rank_takes_whole_query_groups_of_a_chunked_slab():
    """Engine TP 2 (rank 1: query groups 4-7 of 8): from a trainer at TP 1 each of its q / k / v
    is 4 chunks of the trainer's 8-group slab, one copy; from TP 4, 2 chunks of each of two
    trainer ranks' slabs."""
    model = build_gpt(DEFAULT_CONFIGS["qwen3-0.6b"], torch.bfloat16, torch.device("meta"), ParallelState(1, 2))
    for trainer_tp, copies, pairs, chunks in ((1, 562, 310, {4: 84}), (4, 675, 507, {2: 168})):
        metas = trainer_metas(model, [Shard(tp_rank=r, tp_size=trainer_tp) for r in range(trainer_tp)])
        assert check_parity(model, metas) == copies
        planned = [p for ps in plan_update(model, metas, "megatron")[1].pairs for p in ps]
        assert len(planned) == pairs and Counter(p[1].count for p in planned if isinstance(p[1], Chunks)) == chunks


@pytest.mark.parametrize("kind,tp,rank,ep,ep_rank,trainer_tp,trainer_ep", [
    ("dense", 2, 1, 1, 0, 2, 1), ("qwen2", 1, 0, 1, 0, 2, 1), ("moe", 2, 1, 2, 1, 2, 2), ("moe", 1, 0, 1, 0, 1, 2),
    ("hybrid", 2, 0, 1, 0, 2, 1), ("hybrid", 1, 0, 1, 0, 2, 1)])
def test_engine_and_trainer_layouts(kind, tp, rank, ep, ep_rank, trainer_tp, trainer_ep):
    model = build(kind, tp, rank, ep, ep_rank)
    shards = [Shard(tp_rank=r, tp_size=trainer_tp, ep_rank=e, ep_size=trainer_ep)
              for e in range(trainer_ep) for r in range(trainer_tp)]
    assert check_parity(model, trainer_metas(model, shards)) > 0


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["dense", "moe", "hybrid"]), engine=st.sampled_from([(1, 0), (2, 0), (2, 1)]),
       trainer_tp=st.sampled_from([1, 2]), seed=st.integers(0, 2**16), fault=st.sampled_from([None, "drop", "twice"]))
def test_random_pieces_in_any_order(kind, engine, trainer_tp, seed, fault):
    """Each trainer tensor cut into random row pieces (as transfer buckets cut them), shuffled."""
    model = build(kind, *engine)
    rng = random.Random(seed)
    metas = []
    for name, shape, dtype, shard in trainer_metas(model, [Shard(r, trainer_tp) for r in range(trainer_tp)]):
        cuts = sorted(rng.sample(range(1, shape[0]), min(rng.randrange(3), shape[0] - 1)))
        metas += [(name, shape, dtype, shard, (a, b)) for a, b in zip([0, *cuts], [*cuts, shape[0]])]
    rng.shuffle(metas)
    if fault == "drop":
        metas.pop(rng.randrange(len(metas)))
    elif fault == "twice":
        metas.append(metas[rng.randrange(len(metas))])
    copies = check_parity(model, metas, CopyPlanCache().table(model))
    if fault != "drop":  # a dropped piece may be one this rank does not keep
        assert (copies == 0) == (fault == "twice")


def test_unknown_and_misshaped_tensors_are_refused_as_before():
    model = build("dense")
    metas = trainer_metas(model, [Shard()])
    name, shape, dtype, shard = metas[3]
    bad = [(name, (shape[0] + 1, *shape[1:]), dtype, shard),
           ("decoder.layers.0.mlp.linear_fc2.weight", (64, 96), dtype)]
    assert check_parity(model, metas[:3] + bad + metas[5:]) == 0
