"""One payload entry per allocator segment: the trainer's storages that ``_share_cuda_`` reports
under one IPC handle are named once (``sharer.segments``), each tensor's offset counted from the
span's start; the engine (``IpcStorages``) holds every counter such an entry carries, releases
the others' counters when it unmaps (torch releases the entry's own), releases a fresh share's
counters at once, and refuses an entry naming any counter it already released. A ``Sharer``
shares a segment's storages afresh when the storages it names of that segment change."""
import base64

import pytest
import torch

from megatron_async.weight_transfer import sharer as sharer_mod
from megatron_async.weight_transfer.ipc import parse
from megatron_async.weight_transfer.ipc_storages import IpcHandleError, IpcStorages, counters
from megatron_async.weight_transfer.sharer import Sharer, cuda_entry, segments


def raw(handle: int, offset: int, nbytes: int, counter: int) -> tuple:
    """What ``UntypedStorage._share_cuda_()`` returns, made up."""
    return (0, bytes([handle]) * 64, nbytes, offset, b"rc" + bytes([counter]), counter, b"ev" * 32, True)


def entry(handle: int, offset: int, nbytes: int, counter: int) -> dict:
    return cuda_entry(raw(handle, offset, nbytes, counter), uuid_of=lambda i: f"GPU-{i}")


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def test_storages_of_one_segment_are_one_entry_spanning_them():
    es = [entry(1, 1024, 512, 1), entry(2, 0, 4096, 2), entry(1, 0, 512, 3), entry(1, 4096, 1024, 4)]
    out, where = segments(es)
    assert len(out) == 2
    seg = out[0]
    assert (seg["handle"], seg["offset_bytes"], seg["nbytes"]) == (b64(bytes([1]) * 64), 0, 5120)
    assert seg["ref_counter_handle"] == b64(b"rc" + bytes([1])) and seg["ref_counter_offset"] == 1  # the first's own
    assert seg["ref_counters"] == [[b64(b"rc" + bytes([3])), 3], [b64(b"rc" + bytes([4])), 4]]
    assert out[1] == es[1] and "ref_counters" not in out[1]
    assert where == [(0, 1024), (1, 0), (0, 0), (0, 4096)]
    assert counters(seg) == ((seg["ref_counter_handle"], 1), (b64(b"rc" + bytes([3])), 3), (b64(b"rc" + bytes([4])), 4))


def test_a_payload_offsets_tensors_into_their_segment_and_parses(monkeypatch):
    place = {}  # storage address -> its made-up segment and offset
    shares = iter(range(1, 100))

    def fake_share(st):
        handle, offset = place[st.data_ptr()]
        return entry(handle, offset, st.nbytes(), next(shares))

    monkeypatch.setattr(sharer_mod, "share_storage", fake_share)
    a, b, c = torch.zeros(4, 8), torch.zeros(16, dtype=torch.bfloat16), torch.zeros(8)
    place.update({a.data_ptr(): (7, 0), b.data_ptr(): (7, 512), c.data_ptr(): (9, 0)})
    items = [("x", a[1:3]), ("y", b[2:10].view(2, 4)), ("z", c)]
    payload = sharer_mod.share(items)
    assert len(payload["storages"]) == 2 and payload["storages"][0]["nbytes"] == 512 + 32
    x, y, z = payload["tensors"]
    assert (x["storage"], x["storage_offset"]) == (0, 8)
    assert (y["storage"], y["storage_offset"]) == (0, 256 + 2)  # 512 bytes of bfloat16 before it
    assert (z["storage"], z["storage_offset"]) == (1, 0)
    _, storages, tensors = parse(payload)  # within its span, and the extra counters well formed
    assert [t["storage"] for t in tensors] == [0, 0, 1]

    kept = Sharer()
    first = kept.share(items)
    assert kept.share(items) == first and kept.shared == 3  # the same storages: the same entries
    fewer = kept.share(items[1:])  # segment 7 names fewer storages: its entry is shared afresh
    assert kept.shared == 4 and fewer["storages"][0]["ref_counter_offset"] != first["storages"][0]["ref_counters"][0][1]
    assert fewer["storages"][1] == first["storages"][1]  # segment 9 unchanged: given again


def test_malformed_extra_counters_are_refused():
    seg = segments([entry(1, 0, 512, 1), entry(1, 512, 512, 2)])[0][0]
    tensor = {"name": "decoder.final_layernorm.weight", "storage": 0, "dtype": "float32", "shape": [4],
              "stride": [1], "storage_offset": 0}
    for bad in ("x", [["!!", 1]], [[b64(b"rc"), -1]], [[b64(b"rc")]]):
        with pytest.raises(IpcHandleError, match="ref_counters"):
            parse({"storages": [{**seg, "ref_counters": bad}], "tensors": [tensor]})


class Recorder:
    def __init__(self):
        self.opened, self.released = [], []

    def open(self, s):
        self.opened.append(s["handle"])
        return object()

    def release(self, c):
        self.released.append(c)


def c(n: int) -> tuple:
    return (b64(b"rc" + bytes([n])), n)


def test_the_engine_holds_every_counter_of_a_segment_entry():
    rec = Recorder()
    kept = IpcStorages(opener=rec.open, releaser=rec.release)
    seg = segments([entry(1, 0, 512, 1), entry(1, 512, 512, 2), entry(1, 1024, 512, 3)])[0]
    kept.open(seg)
    assert rec.opened == [seg[0]["handle"]] and rec.released == []  # one mapping for three storages
    again = segments([entry(1, 0, 512, 4), entry(1, 512, 512, 5), entry(1, 1024, 512, 6)])[0]
    kept.open(again)  # shared afresh: the new counters go back at once, the mapping stays
    assert len(rec.opened) == 1 and rec.released == [c(4), c(5), c(6)] and kept.released == 3
    kept.open([entry(2, 0, 512, 7)])  # segment 1 no longer named: unmapped, its other counters released here
    assert rec.released[3:] == [c(2), c(3)]
    with pytest.raises(IpcHandleError, match="already released"):  # any of its counters spent: stale
        kept.open(segments([entry(1, 0, 512, 9), entry(1, 512, 512, 3)])[0])
    kept.release()
    assert rec.released[5:] == []  # entry 2 has no other counters: torch releases its own
