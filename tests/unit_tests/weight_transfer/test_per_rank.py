"""Per-rank IPC payloads (``per_rank.py``): each engine rank takes the payloads addressed to it
(all of them when none is addressed), a list that mixes addressed and unaddressed payloads or
misses this rank is refused, a CUDA storage on another GPU is refused; replicated copies of a
trainer rank count as the owned one, split tensors keep their shard."""
import pytest

from megatron_async.models.megatron_layouts import NameMap, Shard
from megatron_async.weight_transfer.ipc_storages import IpcHandleError
from megatron_async.weight_transfer.per_rank import addressed, owned_copy


def payload(rank=None, uuid="GPU-a"):
    p = {"storages": [{"kind": "cuda", "device_uuid": uuid}], "tensors": []}
    if rank is not None:
        p["engine_rank"] = rank
    return p


def test_each_rank_takes_its_own_payloads():
    ps = [payload(0, "GPU-a"), payload(1, "GPU-b"), payload(1, "GPU-b")]
    assert addressed(ps, 0, "GPU-a") == ([ps[0]], True)
    assert addressed(ps, 1, "GPU-b") == (ps[1:], True)
    assert addressed([payload(), payload()], 1) == ([payload(), payload()], False)


@pytest.mark.parametrize("ps,rank,message", [
    ([payload(0), payload()], 0, "engine_rank must be an int"),
    ([payload(0), payload(True)], 0, "engine_rank must be an int"),
    ([payload(0), payload(1)], 2, r"no payload for engine rank 2 \(payloads for ranks \[0, 1\]\)"),
    ([payload(0, "GPU-b")], 0, "names GPU GPU-b; this rank runs on GPU-a"),
])
def test_bad_addressing_is_refused(ps, rank, message):
    with pytest.raises(IpcHandleError, match=message):
        addressed(ps, rank, "GPU-a")


def test_replicated_copies_count_as_the_owned_one():
    names = NameMap.for_arch("Qwen3ForCausalLM")
    r1 = Shard(tp_rank=1, tp_size=2)
    assert owned_copy(names, "decoder.layers.0.input_layernorm.weight", r1) == Shard(tp_rank=0, tp_size=2)
    assert owned_copy(names, "decoder.final_layernorm.weight", r1) == Shard(tp_rank=0, tp_size=2)
    assert owned_copy(names, "decoder.layers.0.self_attention.linear_qkv.weight", r1) == r1
    assert owned_copy(names, "embedding.word_embeddings.weight", r1) == r1
    moe = NameMap.for_arch("Qwen3MoeForCausalLM")
    ep1 = Shard(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2)
    assert owned_copy(moe, "decoder.layers.0.mlp.router.weight", ep1) == Shard(tp_rank=0, tp_size=2, ep_size=2)
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert owned_copy(moe, expert, ep1) == ep1  # an expert's shard is its own
