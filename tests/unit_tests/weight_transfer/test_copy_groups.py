"""The IPC update's repeated copy as multi-tensor lists (``copy_groups``): each list is of one
device and dtype pair and all of its pairs qualify for the multi-tensor kernel or none do; a
payload of many separate storages (one per tensor, as a plain Megatron-Core model holds them)
gives the same weights as one flat storage of the same tensors, with mixed dtypes too (CPU
shared memory, the twin of CUDA IPC)."""
from __future__ import annotations

import torch

from megatron_async.weight_transfer import ipc
from megatron_async.weight_transfer.copy_groups import dense, group_pairs, multi_tensor
from tests.helpers.refit_engine import _shape_info, engine, trainer_items


def test_pairs_are_grouped_by_dtypes_and_by_whether_they_qualify():
    big = torch.zeros(8, 6)
    dsts = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(8, 3), torch.zeros(5), torch.zeros(2, 2)]
    srcs = [torch.ones(4), torch.ones(4), big[:, :3], torch.ones(5), torch.ones(2, 2, dtype=torch.bfloat16)]
    groups = group_pairs(dsts, srcs)
    assert [len(d) for d, _ in groups] == [2, 1, 1, 1]
    assert groups[0][0][0] is dsts[0] and groups[0][0][1] is dsts[3]  # first-seen order, pairs in order
    for d, s in groups:
        assert len({(x.device, x.dtype) for x in d}) == 1 and len({(x.device, x.dtype) for x in s}) == 1
        assert len({multi_tensor(a, b) for a, b in zip(d, s)}) == 1
    assert not multi_tensor(dsts[2], srcs[2])  # a column slice: its own list, copied pair by pair
    assert dense(big.t()) and dense(big[:4]) and not dense(big[:, :3]) and dense(torch.zeros(3, 1, 4)[:, :, :])


def _shared(items: list[tuple], flat: bool) -> list[tuple]:
    """The items in shared memory: a storage per tensor, or one flat storage per dtype."""
    if not flat:
        return [(n, t.clone().share_memory_(), s) for n, t, s in items]
    out, buffers = [], {}
    for dtype in {t.dtype for _, t, _ in items}:
        buffers[dtype] = [torch.empty(sum(t.numel() for _, t, _ in items if t.dtype == dtype), dtype=dtype)
                          .share_memory_(), 0]
    for n, t, s in items:
        buf = buffers[t.dtype]
        view = buf[0][buf[1]: buf[1] + t.numel()].view(t.shape)
        view.copy_(t)
        buf[1] += t.numel()
        out.append((n, view, s))
    return out


def _updated(payload) -> tuple[list[torch.Tensor], list]:
    llm = engine()
    llm.engine.update_weights_from_ipc(payload)
    llm.engine.update_weights_from_ipc(payload)  # the repeated path: plan, storages and copy lists kept
    assert llm.engine.weights.plans.hits == 1
    return [p.detach().clone() for p in llm.model.parameters()], llm.engine.weights._bound[1].groups


def test_many_separate_storages_give_the_weights_of_one_flat_storage():
    torch.multiprocessing.set_sharing_strategy("file_system")
    shapes, dims, arch = _shape_info()
    items = trainer_items(shapes, 11, 1, dims, arch)
    # a few tensors in bf16 (converted on the copy), the rest float32
    items = [(n, t.to(torch.bfloat16) if i % 3 == 0 else t, s) for i, (n, t, s) in enumerate(items)]
    separate, flat = _shared(items, flat=False), _shared(items, flat=True)
    assert len(ipc.share(separate)["storages"]) == len(items) and len(ipc.share(flat)["storages"]) == 2
    got_separate, groups = _updated(ipc.share(separate))
    got_flat, _ = _updated(ipc.share(flat))
    assert all(torch.equal(a, b) for a, b in zip(got_separate, got_flat))
    reference = engine()
    reference.update_weights([(n, t) for n, t, _ in items], weights_format="megatron")  # in-process, its own copies
    assert all(torch.equal(a, b.detach()) for a, b in zip(got_separate, reference.model.parameters()))
    # one list per (dtype pair, qualifying or not): a few lists for the whole model
    assert {(d[0].dtype, s[0].dtype) for d, s in groups} == {(torch.float32, torch.float32),
                                                               (torch.float32, torch.bfloat16)}
    assert len(groups) <= 4
