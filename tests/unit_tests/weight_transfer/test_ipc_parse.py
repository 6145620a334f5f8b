"""An IPC payload's ints are checked field by field (error texts built only for the field that
fails): a negative, bool, float, string or missing int is refused with the same text whatever was
accepted before it (a shard checked once is remembered, a bool never passes for it)."""
import base64

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
