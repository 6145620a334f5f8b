"""The engine's kept IPC mappings (``ipc_storages.IpcStorages``) over CUDA-like entries, with the
mapping and the counter release recorded instead of done: an entry given again maps and
releases nothing, the same memory shared afresh releases its new counter at once, memory no
longer named is unmapped, and an entry whose counter was released (a stale entry: its memory may
be another tensor's now) is refused before anything is mapped; the trainer's ``Sharer`` gives the
same entries while the storages stay, and new ones for new memory."""
import base64

import pytest
import torch

from megatron_async.weight_transfer import ipc
from megatron_async.weight_transfer.ipc_storages import IpcHandleError, IpcStorages


def b64(n: int) -> str:
    return base64.b64encode(bytes([n]) * 64).decode()


def entry(memory: int, share: int, nbytes: int = 1 << 20) -> dict:
    return {"kind": "cuda", "device_uuid": "GPU-0", "handle": b64(memory), "nbytes": nbytes, "offset_bytes": 0,
            "ref_counter_handle": b64(share), "ref_counter_offset": memory, "event_handle": b64(0),
            "event_sync_required": True}


class Recorder:
    def __init__(self, fail_on: int | None = None):
        self.opened, self.released, self.fail_on = [], [], fail_on

    def open(self, s):
        if s["handle"] == self.fail_on:
            raise IpcHandleError("cannot map")
        self.opened.append(s["handle"])
        return object()

    def release(self, c):
        self.released.append(c)


def storages(rec: Recorder) -> IpcStorages:
    return IpcStorages(opener=rec.open, releaser=rec.release)


def test_the_same_entries_again_map_and_release_nothing():
    rec = Recorder()
    kept = storages(rec)
    first = kept.open([entry(1, 10), entry(2, 10)])
    assert kept.open([entry(1, 10), entry(2, 10)]) is first  # an equal list: the last mapped one
    assert kept.open([entry(2, 10), entry(1, 10)]) == first[::-1]  # reordered: taken from the cache
    assert len(rec.opened) == 2 and rec.released == [] and kept.opened == 2


def test_the_same_memory_shared_afresh_releases_its_new_counter_at_once():
    rec = Recorder()
    kept = storages(rec)
    first = kept.open([entry(1, 10)])
    again = kept.open([entry(1, 11)])
    assert again == first and rec.released == [(b64(11), 1)] and len(rec.opened) == 1 and kept.released == 1
    kept.open([entry(3, 12)])  # memory 1 unmapped
    with pytest.raises(IpcHandleError, match="already released"):  # the share released at once is spent too
        kept.open([entry(1, 11)])


def test_memory_no_longer_named_is_unmapped_and_its_entry_is_stale():
    rec = Recorder()
    kept = storages(rec)
    kept.open([entry(1, 10), entry(2, 10)])
    kept.open([entry(2, 10), entry(3, 10)])  # memory 1 unmapped: its counter went back to the trainer
    assert rec.opened == [b64(1), b64(2), b64(3)]
    with pytest.raises(IpcHandleError, match="stale entry"):
        kept.open([entry(1, 10), entry(2, 10)])
    assert rec.opened == [b64(1), b64(2), b64(3)]  # refused before anything was mapped
    kept.open([entry(1, 20), entry(2, 10)])  # shared afresh: mapped again
    assert rec.opened[-1] == b64(1) and rec.released == []


def test_release_makes_every_kept_entry_stale():
    rec = Recorder()
    kept = storages(rec)
    kept.open([entry(1, 10)])
    kept.release()
    with pytest.raises(IpcHandleError, match="stale entry"):
        kept.open([entry(1, 10)])


def test_a_failed_mapping_keeps_the_mappings_as_they_were():
    rec = Recorder(fail_on=b64(3))
    kept = storages(rec)
    first = kept.open([entry(1, 10), entry(2, 10)])
    with pytest.raises(IpcHandleError, match="cannot map"):
        kept.open([entry(1, 10), entry(3, 10)])
    assert kept.open([entry(1, 10), entry(2, 10)]) == first and rec.released == []


def test_the_sharer_gives_the_same_entries_while_the_storages_stay():
    torch.multiprocessing.set_sharing_strategy("file_system")
    a, b = torch.zeros(8).share_memory_(), torch.ones(4).share_memory_()
    sharer = ipc.Sharer()
    first = sharer.share([("decoder.final_layernorm.weight", a), ("output_layer.weight", b)], engine_rank=1)
    assert sharer.share([("decoder.final_layernorm.weight", a), ("output_layer.weight", b)], engine_rank=1) == first
    assert sharer.shared == 2 and first["engine_rank"] == 1 and "release_after" not in first
    b2 = torch.full((4,), 3.0).share_memory_()  # a parameter given new memory
    third = sharer.share([("decoder.final_layernorm.weight", a), ("output_layer.weight", b2)])
    assert third["storages"][0] == first["storages"][0] and third["storages"][1] != first["storages"][1]
    assert sharer.shared == 3
    last = sharer.share([("decoder.final_layernorm.weight", a)], release_after=True)  # (its entry given again)
    assert last["release_after"] is True and last["storages"][0] == first["storages"][0] and sharer.shared == 3
    sharer.share([("decoder.final_layernorm.weight", a)])  # the engine unmapped it: shared afresh
    assert sharer.shared == 4


def test_an_identical_json_text_is_taken_as_checked():
    import json

    torch.multiprocessing.set_sharing_strategy("file_system")
    text = json.dumps(ipc.Sharer().share([("decoder.final_layernorm.weight", torch.zeros(8).share_memory_())]))
    checked = ipc.CheckedPayloads()
    first = checked.checked(text)
    assert checked.checked(text) is first and checked.unchanged == 1
    assert checked.checked(text, engine_rank=1) is not first  # another rank's part is its own check
