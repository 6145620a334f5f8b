"""With ``InferenceConfig.gc_freeze`` an engine's start-up objects are frozen out of the cyclic
collector's later collections (``gc_pauses.settle`` ends its build), so a full collection while
serving traverses only what serving allocated, and closing the engine gives them back; off (the
library default) nothing is frozen; every collection's pause reaches ``EngineStats``; the main
job's and the server's own processes turn the freeze on unless a flag says otherwise."""
import argparse
import gc
import time
import weakref

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli import flags

CFG = dict(max_requests=4, num_kv_blocks=32)  # (not the 1 GB CPU default)
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)


def _full_collection_seconds(repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - start)
    return best


def test_serving_collections_reach_engine_stats_and_nothing_is_frozen_by_default():
    frozen = gc.get_freeze_count()  # (the test run's own freeze, tests/conftest.py)
    llm = LLM(inference_config=InferenceConfig(**CFG))
    try:
        assert gc.get_freeze_count() <= frozen  # (frozen objects may still be freed, none was added)
        llm.generate([[1, 2, 3]], GREEDY)
        gc.collect()  # (a full collection while serving, as the threshold would start one)
        llm.generate([[4, 5]], GREEDY)
        stats = llm.engine.stats
        assert stats.gc_full_collections >= 1 and stats.gc_collections >= stats.gc_full_collections
        assert 0 < stats.gc_pause_max_seconds <= stats.gc_pause_seconds
    finally:
        llm.close()
    assert gc.get_freeze_count() <= frozen


def test_a_frozen_start_up_leaves_full_collections_until_the_engine_closes():
    dropped = LLM(inference_config=InferenceConfig(**CFG))
    engine = weakref.ref(dropped.engine)
    dropped.engine.cycle = dropped  # (kept alive only by a reference cycle)
    del dropped
    llm = LLM(inference_config=InferenceConfig(**CFG, gc_freeze=True))
    try:
        assert engine() is None  # start-up's garbage was collected, not frozen
        assert gc.get_freeze_count() > 10_000  # the modules, parameters and tables start-up built
        llm.generate([[1, 2, 3]], GREEDY)
        served = _full_collection_seconds()
        gc.unfreeze()
        everything = _full_collection_seconds()
        gc.freeze()
        assert served < everything / 3, (served, everything)
    finally:
        llm.close()
        gc.collect()
        gc.freeze()  # (the test run's own freeze again)


def test_own_processes_freeze_unless_a_flag_says_otherwise():
    for given, taken in ((None, True), (False, False), (True, True)):
        args = argparse.Namespace(gc_freeze=given)
        flags.own_process(args)
        assert args.gc_freeze is taken
