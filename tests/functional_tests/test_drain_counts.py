"""EngineStats.drains counts real drains (the device idle behind the host: a launch landed with
no successor enqueued while work remained), not launch-ahead rejections."""
from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.engine_harness import random_prompts


def _run(async_scheduling: bool, lengths: list[int], **cfg):
    base = dict(num_kv_blocks=128, block_size_tokens=4, max_requests=8, max_tokens=64, max_sequence_length=128)
    base.update(cfg)
    llm = LLM(inference_config=InferenceConfig(async_scheduling=async_scheduling, **base))
    for p, n in zip(random_prompts(len(lengths), 3, 12, 1024, seed=7), lengths):
        llm.engine.add_request(p, SamplingParams(top_k=1, num_tokens_to_generate=n, ignore_eos=True))
    outs = llm.engine.run_until_done()
    return outs, llm.engine.stats


def test_serial_drains_at_every_step_that_leaves_work():
    outs, st = _run(False, [6, 6, 6])
    assert len(outs) == 3 and st.rejected_launches == 0
    assert st.drains == st.steps - 1  # the last step leaves nothing to wait for


def test_rejection_at_the_end_is_not_a_drain():
    outs, st = _run(True, [6, 6, 6])
    assert len(outs) == 3 and st.overlapped_steps == st.steps - 1
    # the final launch-ahead found nothing (every row at its length limit), but nothing remained
    assert st.rejected_launches == 1 and st.rejected_causes["length_limit"] == 1
    assert st.drains == 0


def test_memory_pressure_drains_are_counted_and_fewer_than_serial():
    kw = dict(num_kv_blocks=14, max_tokens=32)
    _, s = _run(False, [10, 14, 18, 22, 26], **kw)
    outs, a = _run(True, [10, 14, 18, 22, 26], **kw)
    assert len(outs) == 5 and a.paused > 0
    assert 0 < a.drains <= a.rejected_launches  # every drain followed a rejected launch-ahead
    assert a.drains < s.drains / 2
