"""A trainer process sends Megatron-Core shards of new weights to an engine process (``LLM``):
over a gloo transfer group (``update_weights_from_distributed``) and through shared-memory IPC
handles (``update_weights_from_ipc``, the CPU twin of CUDA IPC). Either way the engine then
generates exactly the tokens and log-probs of an engine updated in-process with the same weights
under HF names; a repeated update reuses its copy plan."""
import pytest
import torch

from megatron_async.models.slab_loading import WeightUpdateError
from megatron_async.inference.engines.weight_receiver import IPC_PHASES
from megatron_async.weight_transfer import ipc
from megatron_async.weight_transfer.ipc import IpcHandleError
from tests.helpers.multiprocess import free_port, run_ranks
from tests.helpers.refit_engine import distributed_rank, engine, ipc_rank, reference


def test_distributed_update_equals_an_in_process_update():
    sent, (joined, versions, (misses, hits), buffer_bytes, out) = run_ranks(distributed_rank, 2, free_port(),
                                                                             timeout_s=180)
    assert sent == "sent" and joined == 1
    assert versions == [7, 7] and (misses, hits) == (1, 1)
    assert 0 < buffer_bytes <= 32 << 10
    want = reference(11)
    assert [o[0] for o in out] == [w[0] for w in want]
    assert all(torch.allclose(torch.tensor(o[1]), torch.tensor(w[1]), atol=1e-6) for o, w in zip(out, want))
    assert all(o[2] == [7] * len(o[0]) for o in out)


def test_ipc_update_from_another_process_follows_in_place_changes():
    shared, ((v1, v2), (misses, hits, reused, phases), out1, out2) = run_ranks(ipc_rank, 2, free_port(), timeout_s=180)
    assert shared == "shared" and (v1, v2) == (1, 2) and (misses, hits, reused) == (1, 1, 1)  # the second: no check, no plan
    assert phases == IPC_PHASES  # the receiver's host time by phase, for python -m benchmarks refit-ipc
    for out, want in ((out1, reference(11)), (out2, reference(11, 2.0))):
        assert [o[0] for o in out] == [w[0] for w in want]
        assert all(torch.allclose(torch.tensor(o[1]), torch.tensor(w[1]), atol=1e-6) for o, w in zip(out, want))


def _payload():
    torch.multiprocessing.set_sharing_strategy("file_system")
    t = torch.zeros(256).share_memory_()
    return ipc.share([("decoder.final_layernorm.weight", t)]), t


@pytest.mark.parametrize("mutate,message", [
    (lambda p: p["storages"][0].update(handle="@@not base64@@"), "not valid base64"),
    (lambda p: p["tensors"][0].update(shape=[512]), "beyond its storage"),
    (lambda p: p["tensors"][0].update(storage=3), "storage 3 does not exist"),
    (lambda p: p["tensors"][0].update(dtype="int64"), "dtype must be one of"),
    (lambda p: p["tensors"][0].update(tp_rank=2, tp_size=2), "tp_rank"),
    (lambda p: p["storages"].__setitem__(0, {"kind": "cuda", "device_uuid": "GPU-x", "handle": "", "nbytes": 1024,
                                             "offset_bytes": 0, "ref_counter_handle": "", "ref_counter_offset": 0,
                                             "event_handle": "", "event_sync_required": False}), "not visible"),
    (lambda p: p.update(tensors="x"), "'storages' and 'tensors' lists"),
])
def test_malformed_ipc_payloads_are_refused_and_nothing_changes(mutate, message):
    llm = engine()
    payload, keep = _payload()
    mutate(payload)
    before = [p.clone() for p in llm.model.parameters()]
    with pytest.raises((IpcHandleError, WeightUpdateError), match=message):
        llm.engine.update_weights_from_ipc(payload)
    assert all(torch.equal(p, q) for p, q in zip(llm.model.parameters(), before))
    assert llm.engine.weight_version == 0
