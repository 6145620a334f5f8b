"""A CUDA engine's start-up objects are frozen out of the cyclic collector's later collections
(``gc_pauses.settle`` ends its warm-up), so a full collection while serving traverses only what
serving allocated; closing the engine, or building another, gives them back; every collection's
pause reaches ``EngineStats``."""
import gc
import time
import weakref

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference import gc_pauses

CFG = dict(max_requests=4, num_kv_blocks=32)  # (not the 1 GB CPU default)
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True)


def _full_collection_seconds(repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - start)
    return best


def test_serving_collections_reach_engine_stats():
    llm = LLM(inference_config=InferenceConfig(**CFG))
    try:
        llm.generate([[1, 2, 3]], GREEDY)
        gc.collect()  # (a full collection while serving, as the threshold would start one)
        llm.generate([[4, 5]], GREEDY)
        stats = llm.engine.stats
        assert stats.gc_full_collections >= 1 and stats.gc_collections >= stats.gc_full_collections
        assert 0 < stats.gc_pause_max_seconds <= stats.gc_pause_seconds
    finally:
        llm.close()


def test_settled_start_up_leaves_full_collections_until_the_engine_closes():
    llm = LLM(inference_config=InferenceConfig(**CFG))
    try:
        dropped = LLM(inference_config=InferenceConfig(**CFG))
        engine = weakref.ref(dropped.engine)
        dropped.engine.cycle = dropped  # (kept alive only by a reference cycle)
        del dropped
        gc_pauses.settle()  # (what a CUDA engine's warm-up ends with)
        assert engine() is None  # garbage is collected, not frozen
        assert gc.get_freeze_count() > 10_000  # the modules, parameters and tables start-up built
        llm.generate([[1, 2, 3]], GREEDY)
        served = _full_collection_seconds()
        gc.unfreeze()
        everything = _full_collection_seconds()
        gc.freeze()
        assert served < everything / 3, (served, everything)
    finally:
        llm.close()
    assert gc.get_freeze_count() == 0  # (a closed engine's cycles are collectable)


def test_a_new_build_thaws_an_unclosed_engine():
    llm = LLM(inference_config=InferenceConfig(**CFG))
    gc_pauses.settle()
    engine = weakref.ref(llm.engine)
    llm.engine.cycle = llm
    del llm
    second = LLM(inference_config=InferenceConfig(**CFG))
    try:
        gc.collect()
        assert engine() is None
    finally:
        second.close()
