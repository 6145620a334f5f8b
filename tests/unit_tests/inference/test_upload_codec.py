"""The compact upload format (what data-parallel ranks hand up to rank 0) round-trips exactly,
against random updates of every shape it meets: several tokens or none, texts with non-ASCII
characters or None, finish reasons, finished outputs, and log-probs (the pickled fallback)."""
import random

import pytest

from megatron_async.inference.engines.upload_codec import _COMPACT, _PICKLED, decode, encode
from megatron_async.inference.request import RequestOutput, RequestUpdate

TEXTS = [None, "", "a", " héllo", "日本語", "\n\t", "😀x"]


def _updates(rng: random.Random, n: int, texts: bool, counts=(1,)) -> list[RequestUpdate]:
    out = []
    for i in range(n):
        done = rng.random() < 0.2
        tokens = tuple(rng.randrange(-5, 2**40) for _ in range(rng.choice(counts)))
        out.append(RequestUpdate(rng.randrange(2**40), tokens, rng.choice(TEXTS) if texts else None, done,
                                 rng.choice(["length", "stop", "abort"]) if done else None))
    return out


def _finished(rng: random.Random, k: int) -> list[RequestOutput]:
    return [RequestOutput(rng.randrange(1000), [1, 2, 3], [rng.randrange(50) for _ in range(4)], rng.choice(TEXTS),
                          "length") for _ in range(k)]


@pytest.mark.parametrize("seed", range(8))
def test_compact_uploads_round_trip_exactly(seed):
    rng = random.Random(seed)
    n = rng.choice([0, 1, 5, 64])
    counts = (1,) if seed % 2 else (0, 1, 2, 3)  # decode steps (the 1-tuple path) and mixed
    updates, finished = _updates(rng, n, texts=seed % 3 != 0, counts=counts), _finished(rng, rng.choice([0, 2]))
    data = encode(finished, updates)
    assert data[:4] == _COMPACT
    got = decode(data)
    assert got.updates == updates and got.finished == finished
    assert all(type(u) is RequestUpdate and type(u.new_tokens) is tuple for u in got.updates)


def test_log_probs_fall_back_to_a_pickle():
    rng = random.Random(0)
    updates = _updates(rng, 4, texts=True)
    updates[2] = updates[2]._replace(new_log_probs=(-0.5,), new_top_n_logprobs=({3: -0.5},))
    data = encode([], updates)
    assert data[:4] == _PICKLED and decode(data).updates == updates


def test_garbage_is_refused():
    with pytest.raises(ValueError, match="not an upload"):
        decode(b"XXXX" + bytes(12))
