"""admission_order: re-admissions first, then by class (priority less one per ``aging``
admissions waited), FIFO within a class."""
from megatron_async import SamplingParams
from megatron_async.inference.engines.admission_order import admission_order
from megatron_async.inference.request import DynamicInferenceRequest


def req(rid, priority=0, queued_after=0, readmitted=False):
    r = DynamicInferenceRequest(rid, [1, 2], SamplingParams(priority=priority), seed=rid)
    r.queued_after, r.weights_epoch = queued_after, 0 if readmitted else -1
    return r


def test_classes_then_queue_order_and_readmissions_first():
    q = [req(0, 5), req(1, 0), req(2, 5), req(3, -2), req(4, 0), req(5, 9, readmitted=True)]
    assert admission_order(q, admissions=0, aging=100) == [5, 3, 1, 4, 0, 2]


def test_waiting_lowers_the_class():
    q = [req(0, 3, queued_after=0), req(1, 0, queued_after=5), req(2, 1, queued_after=6)]
    assert admission_order(q, admissions=6, aging=2) == [0, 1, 2]  # 3 - 3 = 0: ties go to the older
    assert admission_order(q, admissions=5, aging=2) == [1, 0, 2]  # 3 - 2 = 1 > 0
    assert admission_order(q, admissions=5, aging=1) == [0, 1, 2]
