"""``SamplingParams.priority`` on the tiny checkpoint: with one request running at a time the
requests finish in class order (FIFO within a class), a low class still gets through while a
higher one keeps arriving, and launch-ahead == serial with random classes and arrivals (the
counter shows admissions really passed earlier requests)."""
import random

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals, tokens_of


def greedy(priority: int, n: int = 3) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True, priority=priority)


def finish_order(llm, arrivals) -> list[int]:
    eng, order, ids, steps = llm.engine, [], {}, 0
    pending = list(enumerate(arrivals))
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1].step <= steps:
            i, a = pending.pop(0)
            ids[eng.add_request(a.prompt, a.params)] = i
        order += [ids[o.request_id] for o in eng.step().finished]
        steps += 1
    return order


def test_lower_classes_first_fifo_within(qwen3_ckpt):
    prompts = random_prompts(6, 4, 8, 256, seed=1)
    classes = [5, 5, 0, 0, 9, -1]
    llm = make_llm(qwen3_ckpt, max_requests=1)
    order = finish_order(llm, [Arrival(0, p, greedy(c)) for p, c in zip(prompts, classes)])
    assert order == [5, 2, 3, 0, 1, 4]
    assert llm.engine.stats.admitted_out_of_order == 3  # 5, 2 and 3 passed earlier requests


def test_a_low_class_still_progresses(qwen3_ckpt):
    prompts = random_prompts(12, 4, 8, 256, seed=2)
    arrivals = [Arrival(0, prompts[0], greedy(3))] + [Arrival(s, p, greedy(0)) for s, p in enumerate(prompts[1:])]
    llm = make_llm(qwen3_ckpt, max_requests=1, priority_aging=1)
    order = finish_order(llm, arrivals)
    assert 0 < order.index(0) < len(order) - 1  # passed by some, not by all


def test_async_equals_serial_with_classes(qwen3_ckpt):
    rng = random.Random(3)
    prompts = random_prompts(14, 3, 30, 256, seed=3)
    arrivals = [Arrival(rng.randrange(0, 12), p, SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=8,
                                                               priority=rng.choice([0, 0, 1, 4, -2])))
                for i, p in enumerate(prompts)]
    arrivals.sort(key=lambda a: a.step)
    results = {}
    for mode in (False, True):
        llm = make_llm(qwen3_ckpt, async_scheduling=mode, max_requests=3, priority_aging=3)
        results[mode] = (tokens_of(run_arrivals(llm, arrivals)), llm.engine.stats)
    (s_tok, s), (a_tok, a) = results[False], results[True]
    assert s_tok == a_tok and s.admitted_out_of_order == a.admitted_out_of_order > 0, a.as_dict()
    assert a.overlapped_decode_steps > 0
