"""An IPC payload's ints are checked field by field (error texts built only for the field that
fails): a negative, bool, float, string or missing int is refused with the same text whatever was
accepted before it (a shard checked once is remembered, a bool never passes for it)."""
import base64
import json

import pytest

from megatron_async.weight_transfer import ipc

FAKE = base64.b64encode(b"\0" * 8).decode()


def payload(**changes) -> dict:
    tensor = {"name": "decoder.final_layernorm.weight", "storage": 0, "dtype": "float32", "shape": [4, 2],
              "stride": [2, 1], "storage_offset": 0, "tp_rank": 1, "tp_size": 2}
    return {"storages": [{"kind": "cpu_shm", "manager": FAKE, "handle": FAKE, "nbytes": 64}],
            "tensors": [dict(tensor), {**tensor, **changes}]}


def test_a_good_payload_parses():
    fmt, storages, tensors = ipc.parse(payload())
    assert (fmt, len(storages), tensors[1]["shape"], tensors[1]["stride"]) == ("megatron", 1, [4, 2], [2, 1])


@pytest.mark.parametrize("changes,message", [
    ({"shape": [4, -2]}, "shape must be an int >= 0, got -2"),
    ({"shape": [4, True]}, "shape must be an int >= 0, got True"),
    ({"stride": [2.0, 1]}, "stride must be an int >= 0, got 2.0"),
    ({"storage": True}, "storage must be an int >= 0, got True"),
    ({"storage_offset": "0"}, "storage_offset must be an int >= 0, got '0'"),
    ({"tp_rank": True}, "tp_rank must be an int >= 0, got True"),
    ({"tp_size": None}, "tp_size must be an int >= 0, got None"),
    ({"tp_rank": 2}, "shard tp_rank 2 is not in"),
    ({"etp_rank": -1, "etp_size": 2}, "etp_rank must be an int >= 0, got -1"),
])
def test_bad_ints_are_refused_by_name(changes, message):
    ipc.parse(payload())  # the good shard is remembered first
    with pytest.raises(ipc.IpcHandleError) as e:
        ipc.parse(payload(**changes))
    assert str(e.value).startswith("decoder.final_layernorm.weight: ") and message in str(e.value)


def shared_again(p: dict) -> dict:
    """The same tensors shared again: a fresh JSON copy whose storages carry new per-share fields."""
    p = json.loads(json.dumps(p))
    p["storages"][0]["handle"] = base64.b64encode(b"\1" * 8).decode()
    return p


def test_the_same_tensors_again_reuse_their_check():
    checked = ipc.CheckedPayloads()
    fmt, storages, tensors, key = checked.parse(payload())
    again = shared_again(payload())
    fmt2, storages2, tensors2, key2 = checked.parse([again])
    assert checked.reused == 1 and tensors2 is tensors and storages2 == again["storages"]
    assert key2[3] is key[3] and key2[2] != key[2]  # the tensors' part kept, the storages' new
    assert key2 == ipc.plan_key(*ipc.parse(again))


def test_entries_of_the_same_bytes_skip_the_value_compare(monkeypatch):
    checked = ipc.CheckedPayloads()
    key = checked.parse(json.dumps(payload()))[3]
    monkeypatch.setattr(ipc, "_same", lambda raw, kept: pytest.fail("compared value by value"))
    fmt, storages, tensors, again = checked.parse(json.loads(json.dumps(payload())))
    assert checked.reused == 1 and again is key  # the key object itself: the plan cache finds it by identity


@pytest.mark.parametrize("changes", [{"shape": [2, 2]}, {"stride": [1, 4]}, {"storage_offset": 8}, {"tp_rank": 0},
                                     {"dtype": "bfloat16"}, {"name": "decoder.layers.0.input_layernorm.weight"}])
def test_a_changed_tensor_is_checked_and_keyed_anew(changes):
    checked = ipc.CheckedPayloads()
    checked.parse(payload())
    fmt, storages, tensors, key = checked.parse(payload(**changes))
    assert checked.reused == 0 and key == ipc.plan_key(*ipc.parse(payload(**changes)))
    assert all(tensors[1][k] == v for k, v in changes.items())


@pytest.mark.parametrize("changes,message", [
    ({"shape": [4, 2.0]}, "shape must be an int >= 0, got 2.0"), ({"tp_rank": True}, "tp_rank must be an int >= 0, got True"),
    ({"storage": False}, "storage must be an int >= 0, got False"), ({"stride": [2, True]}, "stride must be an int >= 0"),
])
def test_an_equal_value_of_another_type_is_refused_after_a_good_payload(changes, message):
    checked = ipc.CheckedPayloads()
    checked.parse(payload(tp_rank=1, storage=0, stride=[2, 1]))
    with pytest.raises(ipc.IpcHandleError, match=message):
        checked.parse(payload(**changes))  # == the last entries, but the check refuses it


def test_a_payload_changed_in_place_after_its_update_is_checked_anew():
    checked = ipc.CheckedPayloads()
    p = payload()
    checked.parse(p)
    p["tensors"][1]["shape"][0] = 2  # the caller reuses its objects
    fmt, storages, tensors, key = checked.parse(p)
    assert checked.reused == 0 and tensors[1]["shape"] == [2, 2]
    p["tensors"][1]["shape"][0] = 40  # beyond the storage: refused, not taken from the last check
    with pytest.raises(ipc.IpcHandleError, match="reaches beyond its storage"):
        checked.parse(p)


def test_a_smaller_storage_is_checked_against_the_tensors_again():
    checked = ipc.CheckedPayloads()
    checked.parse(payload())
    small = payload()
    small["storages"][0]["nbytes"] = 16
    with pytest.raises(ipc.IpcHandleError, match="reaches beyond its storage"):
        checked.parse(small)


def test_what_is_kept_does_not_follow_the_callers_objects():
    checked = ipc.CheckedPayloads()
    p = payload()
    checked.parse(p)
    p["tensors"][1]["shape"][0], p["tensors"][1]["stride"][0] = 2, 4  # the caller reuses its lists
    fmt, storages, tensors, key = checked.parse(payload())  # the first tensors shared again
    assert checked.reused == 1 and (tensors[1]["shape"], tensors[1]["stride"]) == ([4, 2], [2, 1])
    assert key == ipc.plan_key(*ipc.parse(payload()))


def test_several_payloads_are_reused_only_as_they_were():
    checked = ipc.CheckedPayloads()
    two = [payload(), payload()]
    fmt, storages, tensors, key = checked.parse(two)
    assert [t["storage"] for t in tensors] == [0, 0, 1, 1]
    assert checked.parse([payload(), payload()])[2] is tensors and checked.reused == 1
    assert checked.parse([payload(), payload(storage_offset=8)])[2][3]["storage_offset"] == 8 and checked.reused == 1
