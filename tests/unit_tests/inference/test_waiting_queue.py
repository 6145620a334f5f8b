"""The scheduler's waiting queue: FIFO with evicted requests back at the front, a request taken
out from anywhere by its id (never by comparing requests: thousands of queued requests aborted or
finished cost no search), stale entries compacted away; and an engine with 20,000 queued
requests aborts them all without one request comparison."""
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.engines import waiting_queue
from megatron_async.inference.engines.waiting_queue import WaitingQueue
from megatron_async.inference.request import DynamicInferenceRequest


def _req(i: int) -> DynamicInferenceRequest:
    return DynamicInferenceRequest(i, [1, 2, 3], SamplingParams(), seed=0)


@pytest.fixture
def no_comparisons(monkeypatch):
    """Any == between requests fails the test (a membership search compares field by field)."""
    def refuse(self, other):
        raise AssertionError("requests compared: a search of the queue")

    monkeypatch.setattr(DynamicInferenceRequest, "__eq__", refuse)


def test_order_front_and_discard_anywhere(no_comparisons):
    q = WaitingQueue()
    reqs = [_req(i) for i in range(6)]
    for r in reqs[:5]:
        q.append(r)
    q.appendleft(reqs[5])  # an evicted request goes first
    assert q.discard(reqs[0]) and q.discard(reqs[3]) and not q.discard(reqs[3])
    assert [r.request_id for r in q] == [5, 1, 2, 4] and len(q) == 4
    assert reqs[1] in q and reqs[3] not in q
    assert q.head() is reqs[5] and q.popleft() is reqs[5]
    q.discard(reqs[1])
    assert q.popleft() is reqs[2]  # the stale head entry is skipped
    q.append(reqs[1])  # back after it left: one live entry, at the back
    assert [r.request_id for r in q] == [4, 1]
    with pytest.raises(ValueError, match="already waiting"):
        q.append(reqs[4])


def test_stale_entries_are_compacted():
    q = WaitingQueue()
    reqs = [_req(i) for i in range(1000)]
    for r in reqs:
        q.append(r)
    for r in reqs[1:]:  # the head stays: nothing pops the stale entries behind it
        q.discard(r)
    assert len(q) == 1 and len(q._entries) <= 2 + waiting_queue.COMPACT_SLACK + 1
    assert list(q) == [reqs[0]] and q.popleft() is reqs[0] and not q and q.head() is None


def test_aborting_a_long_queue_compares_no_requests(no_comparisons):
    llm = LLM(inference_config=InferenceConfig(max_requests=4, max_tokens=16, num_kv_blocks=64, block_size_tokens=4,
                                               max_sequence_length=64))
    eng = llm.engine
    params = SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)
    ids = [eng.add_request([5, 6, 7], params) for _ in range(20_000)]
    eng.step()  # four of them run
    assert len(eng.scheduler.waiting) == 20_000 - 4
    for rid in reversed(ids):  # the newest first: a search would pass every older request
        eng.abort_request(rid)
    res = eng.step()
    while eng.has_unfinished_requests():
        res.finished += eng.step().finished
    assert len(res.finished) == 20_000 and {o.finish_reason for o in res.finished} == {"abort"}
    assert not eng.scheduler.waiting and len(eng.scheduler.waiting._entries) == 0


class _Counted:
    """A waiting request that counts how often its token count is read."""
    reads = 0

    def __init__(self, i: int, tokens: int):
        self.request_id, self._tokens, self.num_computed_tokens = i, tokens, 0

    @property
    def num_known_tokens(self) -> int:
        _Counted.reads += 1
        return self._tokens


def test_queue_short_carries_its_count_over_appends_and_recounts_after_other_changes():
    """``Admission.queue_short`` equals a full count after any mix of appends, evictions to the
    front, admissions and aborts, and reads each request's tokens once over a burst of adds
    (was once per request per add: O(n^2))."""
    import random
    from types import SimpleNamespace

    from megatron_async.inference.engines.admission import Admission

    rng = random.Random(0)
    for max_requests, max_tokens in ((64, 256), (1024, 8192)):
        q = WaitingQueue()
        adm = Admission.__new__(Admission)
        adm.config, adm.scheduler, adm._count = SimpleNamespace(max_requests=max_requests, max_tokens=max_tokens), \
            SimpleNamespace(waiting=q), None

        def full():
            return len(q) < max_requests and sum(r.num_known_tokens - r.num_computed_tokens for r in q) < 2 * max_tokens

        ids = iter(range(10**6))
        for _ in range(600):
            op = rng.random()
            if op < 0.7 or not q:
                q.append(_Counted(next(ids), rng.randint(1, 40)))
            elif op < 0.8:
                q.popleft()
            elif op < 0.9:
                q.discard(rng.choice(list(q)))
            else:
                q.appendleft(_Counted(next(ids), rng.randint(1, 40)))
            assert adm.queue_short() == full()
        # a burst of tiny adds: each request's tokens read once, however many queries
        q2 = WaitingQueue()
        adm.scheduler, adm._count = SimpleNamespace(waiting=q2), None
        _Counted.reads = 0
        for i in range(min(max_requests - 1, 500)):
            q2.append(_Counted(i, 2))
            adm.queue_short()
        assert _Counted.reads <= min(max_requests - 1, 500)
