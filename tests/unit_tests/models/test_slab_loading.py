"""The one weight loader (models/slab_loading.py): pieces of full tensors in any cut and order
fill the model exactly as whole tensors do; a piece given twice, a piece missing, a wrong shape
or dtype is refused before anything is copied; the copy plan is cached while the parameters stay
where they are; the extension points (sinks with staging, name checks, finalize) are honoured."""
import random

import pytest
import torch

from megatron_async.models.slab_loading import Slab, WeightPlan, WeightUpdateError
from megatron_async.models.weight_update import CopyPlanCache, update_weights_in_place
from megatron_async.parallel.sharding import Destination, Sharding
from tests.helpers.refit_models import build, hf_weights, load_full, params


def pieces(name: str, t: torch.Tensor, rng: random.Random) -> list[Slab]:
    """``t`` cut into random row bands (dim 0), each band of a 2-D tensor into two column pieces."""
    cuts = sorted(rng.sample(range(1, t.shape[0]), min(3, t.shape[0] - 1))) if t.shape[0] > 1 else []
    out = []
    for lo, hi in zip([0, *cuts], [*cuts, t.shape[0]]):
        if t.dim() == 2 and t.shape[1] > 1:
            c = rng.randrange(1, t.shape[1])
            for a, b in ((0, c), (c, t.shape[1])):
                out.append(Slab(name, (lo, a), (hi - lo, b - a), tuple(t.shape), t[lo:hi, a:b]))
        else:
            off = (lo,) + (0,) * (t.dim() - 1)
            out.append(Slab(name, off, (hi - lo, *t.shape[1:]), tuple(t.shape), t[lo:hi]))
    return out


def apply(model, slabs: list[Slab], require_all=False) -> int:
    plan = WeightPlan(model, require_all=require_all)
    plan.check(slabs)
    plan.verify()
    program = plan.program(slabs)
    copied = program.run((i, s.tensor) for i, s in enumerate(slabs))
    plan.finish(copied)
    return copied


@pytest.mark.parametrize("kind,tp,rank,ep,ep_rank", [("dense", 1, 0, 1, 0), ("dense", 2, 1, 1, 0),
                                                     ("qwen2", 2, 0, 1, 0), ("moe", 2, 1, 2, 1),
                                                     ("hybrid", 2, 1, 1, 0)])
def test_pieces_in_any_order_equal_whole_tensors(kind, tp, rank, ep, ep_rank):
    hf = hf_weights(kind, seed=1)
    want = params(load_full(build(kind, tp, rank, ep, ep_rank), hf))
    rng = random.Random(0)
    slabs = [s for name, t in hf.items() for s in pieces(name, t, rng)]
    rng.shuffle(slabs)
    model = build(kind, tp, rank, ep, ep_rank)
    copied = apply(model, slabs, require_all=True)
    assert copied == sum(p.numel() for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name


def test_a_piece_twice_or_missing_is_refused_and_nothing_changes():
    hf = hf_weights("dense")
    model = build("dense", 2, 0)
    before = params(model)
    slabs = [s for name, t in hf.items() for s in pieces(name, t, random.Random(2))]
    k = next(i for i, s in enumerate(slabs) if s.hf_name == "model.norm.weight")  # replicated: every rank needs it
    for bad, message in ((slabs + [slabs[5]], "tensors given twice"), (slabs[:k] + slabs[k + 1:], "incomplete tensors")):
        with pytest.raises(WeightUpdateError, match=message):
            apply(model, bad)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_piece_applied_twice_after_the_plan_fails_the_finish():
    hf = hf_weights("dense")
    model = build("dense")
    slabs = [Slab.full(n, t) for n, t in hf.items()]
    plan = WeightPlan(model, require_all=False)
    plan.check(slabs)
    plan.verify()
    program = plan.program(slabs)
    copied = program.run((i, s.tensor) for i, s in enumerate(slabs))
    copied += program.run([(0, slabs[0].tensor)])  # a bucket applied twice
    with pytest.raises(WeightUpdateError, match="applied twice or skipped"):
        plan.finish(copied)


def test_shapes_out_of_bounds_and_dtypes_are_refused():
    model = build("dense")
    name = "model.norm.weight"
    for slab, message in (
        (Slab(name, (0,), (65,), (65,), torch.ones(65)), "wrong shapes"),
        (Slab(name, (60,), (8,), (64,), torch.ones(8)), "outside"),
        (Slab(name, (0,), (64,), (64,), torch.ones(64, dtype=torch.int32)), "refused dtypes"),
        (Slab(name, (0,), (64,), (64,), torch.ones(64).to(torch.float8_e4m3fn)), "refused dtypes"),
        (Slab("model.nope.weight", (0,), (64,), (64,), torch.ones(64)), "unknown tensors"),
    ):
        with pytest.raises(WeightUpdateError, match=message):
            apply(model, [slab])


def test_copy_plans_are_cached_while_parameters_stay():
    hf = hf_weights("dense")
    model = build("dense", 2, 1)
    cache = CopyPlanCache()
    update_weights_in_place(model, hf, cache=cache)
    new = {n: t + 1 for n, t in hf.items()}
    update_weights_in_place(model, new, cache=cache)
    assert (cache.misses, cache.hits) == (1, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), load_full(build("dense", 2, 1), new).parameters()))
    model.final_norm.weight.data = model.final_norm.weight.data.clone()  # storage moved: the plan is stale
    update_weights_in_place(model, hf, cache=cache)
    assert cache.misses == 2
    assert torch.equal(model.final_norm.weight, hf["model.norm.weight"])


class _CountedHash:
    def __init__(self):
        self.hashed = 0

    def __hash__(self):
        self.hashed += 1
        return 0


def test_the_last_key_object_is_taken_without_hashing_while_its_parameters_stay():
    hf = hf_weights("dense")
    model = build("dense", 2, 1)
    cache, counted = CopyPlanCache(), _CountedHash()
    key = ("update", counted)
    metas = [(n, tuple(t.shape), t.dtype) for n, t in hf.items()]
    first = cache.get(model, key, metas, "hf")
    second = cache.get(model, key, metas, "hf")  # a dict hit: the key is hashed
    hashed = counted.hashed
    assert cache.get(model, key, metas, "hf") == first == second and counted.hashed == hashed
    assert (cache.misses, cache.hits) == (1, 2)
    model.final_norm.weight.data = model.final_norm.weight.data.clone()  # storage moved: the plan is stale
    assert cache.get(model, key, metas, "hf")[0] is not first[0] and cache.misses == 2


class _ScaledSink:
    """Stages the pieces of its destination and writes 2x the values once all have arrived."""

    def __init__(self, view):
        self.view, self.staged, self.completions = view, torch.zeros_like(view), 0

    def accepts(self, dtype):
        return dtype in (torch.float32, torch.int32)

    def write(self, dst, src, box):
        offset = [d.data_ptr() - self.view.data_ptr() for d in (dst,)][0] // dst.element_size()
        flat = self.staged.view(-1)
        flat[offset:offset + dst.numel()] = src.reshape(-1).to(flat.dtype)

    def complete(self):
        self.completions += 1
        self.view.copy_(self.staged * 2)


class _SinkSharding(Sharding):
    def destinations(self, target, shard_id=None):
        self.sink = getattr(self, "sink", None) or _ScaledSink(target)
        return [Destination(d.box, d.view, self.sink) for d in super().destinations(target, shard_id)]


def test_extension_points_sink_staging_name_check_and_finalize():
    model = build("dense")
    param = model.final_norm.weight
    param.sharding = _SinkSharding(None)
    seen = {}
    model.check_weight_names = lambda names: seen.setdefault("checked", set(names))
    model.finalize_weights = lambda names: seen.setdefault("finalized", set(names))
    values = torch.arange(64, dtype=torch.int32)  # a dtype only the sink accepts
    slabs = [Slab("model.norm.weight", (lo,), (16,), (64,), values[lo:lo + 16]) for lo in (48, 0, 32, 16)]
    apply(model, slabs[:3] + slabs[3:])
    assert param.sharding.sink.completions == 1
    assert torch.equal(param, values.float() * 2)
    assert seen == {"checked": {"model.norm.weight"}, "finalized": {"model.norm.weight"}}
    model.check_weight_names = lambda names: (_ for _ in ()).throw(ValueError("weight without its scales"))
    with pytest.raises(WeightUpdateError, match="weight without its scales"):
        apply(model, slabs)
