"""Launch-ahead == serial, token for token, through every lifecycle event.

Each case also asserts that its event really happened (counters) and that the async run
kept the pipeline full (most decode steps overlapped)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts, run_arrivals, tokens_of

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=12)


def both_modes(path, arrivals, **cfg):
    results = {}
    for mode in (False, True):
        llm = make_llm(path, async_scheduling=mode, **cfg)
        outs = run_arrivals(llm, arrivals)
        assert len(outs) == len(arrivals)
        results[mode] = (outs, llm.engine.stats)
    assert tokens_of(results[True][0]) == tokens_of(results[False][0])
    serial, asyn = results[False][1], results[True][1]
    assert serial.overlapped_steps == 0
    if max(len(o.generated_tokens) for o in results[True][0].values()) > 1:  # a step could launch ahead
        assert asyn.overlapped_decode_steps > 0, asyn.as_dict()
    return results[False][0], results[True][0], serial, asyn


def test_greedy_all_at_once(qwen3_ckpt):
    arr = [Arrival(0, p, GREEDY) for p in random_prompts(8, 3, 30, 256, seed=2)]
    _, _, _, a = both_modes(qwen3_ckpt, arr)
    assert a.overlap_ratio >= 0.9, a.as_dict()


def test_seeded_top_k_top_p(qwen3_ckpt):
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=11, num_tokens_to_generate=14),
        SamplingParams(temperature=1.0, top_p=0.9, seed=12, num_tokens_to_generate=14),
        SamplingParams(temperature=1.3, top_k=50, top_p=0.8, seed=13, num_tokens_to_generate=14),
        SamplingParams(temperature=0.7, num_tokens_to_generate=14),  # engine-assigned seed
    ]
    prompts = random_prompts(8, 3, 25, 256, seed=3)
    arr = [Arrival(0, p, params[i % 4]) for i, p in enumerate(prompts)]
    s, _, _, a = both_modes(qwen3_ckpt, arr)
    assert a.overlap_ratio >= 0.9
    greedy = run_arrivals(make_llm(qwen3_ckpt), [Arrival(0, p, GREEDY) for p in prompts])
    assert tokens_of(s) != {i: o.generated_tokens[:14] for i, o in greedy.items()}  # really sampled


def test_staggered_arrivals_while_decoding(qwen3_ckpt):
    prompts = random_prompts(10, 3, 30, 256, seed=4)
    arr = [Arrival(3 * i, p, GREEDY) for i, p in enumerate(prompts)]
    _, _, s, a = both_modes(qwen3_ckpt, arr)
    assert a.prefill_steps > 1 and a.overlapped_steps > 0.8 * a.steps, a.as_dict()


def test_small_pool_pauses_and_evictions(qwen3_ckpt):
    arr = [Arrival(i, p, GREEDY) for i, p in enumerate(random_prompts(10, 5, 30, 256, seed=5))]
    _, _, s, a = both_modes(qwen3_ckpt, arr, num_kv_blocks=24, max_tokens=32)
    for st_ in (s, a):
        assert st_.paused > 0 and st_.evicted > 0, st_.as_dict()
    assert a.overlapped_steps > 0


def test_many_finish_lengths_and_block_crossings(qwen3_ckpt):
    prompts = random_prompts(12, 1, 20, 256, seed=6)
    arr = [Arrival(0, p, SamplingParams(top_k=1, num_tokens_to_generate=1 + 3 * i)) for i, p in enumerate(prompts)]
    s, a_outs, _, a = both_modes(qwen3_ckpt, arr, block_size_tokens=4)
    assert sorted(len(o.generated_tokens) for o in s.values()) == [1 + 3 * i for i in range(12)]
    assert a.overlap_ratio >= 0.9, a.as_dict()
    # every request crossed at least one block boundary while decoding
    assert all(len(o.prompt_tokens) // 4 != (len(o.prompt_tokens) + len(o.generated_tokens)) // 4 for o in s.values() if len(o.generated_tokens) >= 4)


def test_eos_finishes_discard_launch_ahead_rows(qwen3_ckpt):
    # make a frequent token the terminator so rows finish at unpredictable steps
    prompts = random_prompts(8, 3, 20, 256, seed=9)
    probe = run_arrivals(make_llm(qwen3_ckpt), [Arrival(0, p, SamplingParams(top_k=1, num_tokens_to_generate=30)) for p in prompts])
    eos = probe[0].generated_tokens[5]
    sp = SamplingParams(top_k=1, num_tokens_to_generate=30, termination_id=eos)
    s, _, _, a = both_modes(qwen3_ckpt, [Arrival(0, p, sp) for p in prompts])
    assert any(o.finish_reason == "stop" for o in s.values())
    assert a.discarded_rows > 0, a.as_dict()


def test_prefix_cache_hits(qwen3_ckpt):
    shared = random_prompts(1, 20, 20, 256, seed=10)[0]
    arr = [Arrival(2 * i, shared + t, GREEDY) for i, t in enumerate(random_prompts(6, 1, 8, 256, seed=11))]
    _, _, s, a = both_modes(qwen3_ckpt, arr, enable_prefix_caching=True)
    assert s.prefix_hit_tokens > 0 and a.prefix_hit_tokens > 0


def test_log_probs_equal(qwen3_ckpt):
    sp = SamplingParams(temperature=0.9, top_k=30, seed=5, num_tokens_to_generate=10, return_log_probs=True, top_n_logprobs=3)
    arr = [Arrival(0, p, sp) for p in random_prompts(6, 3, 20, 256, seed=12)]
    s, a, _, _ = both_modes(qwen3_ckpt, arr)
    for i in s:
        assert s[i].generated_log_probs == pytest.approx(a[i].generated_log_probs, abs=1e-5)
        assert [sorted(d) for d in s[i].generated_top_n_logprobs] == [sorted(d) for d in a[i].generated_top_n_logprobs]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    n=st.integers(1, 8),
    gaps=st.lists(st.integers(0, 4), min_size=8, max_size=8),
    lens=st.lists(st.integers(1, 24), min_size=8, max_size=8),
    outs=st.lists(st.integers(1, 16), min_size=8, max_size=8),
    blocks=st.integers(16, 80),
    block_size=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 1000),
)
def test_randomized_async_equals_serial(qwen3_ckpt, n, gaps, lens, outs, blocks, block_size, seed):
    prompts = [p[: lens[i]] for i, p in enumerate(random_prompts(n, 24, 24, 256, seed=seed))]
    t, arr = 0, []
    for i, p in enumerate(prompts):
        t += gaps[i]
        sp = SamplingParams(top_k=1, num_tokens_to_generate=outs[i]) if i % 2 else SamplingParams(temperature=1.0, top_p=0.9, seed=seed + i, num_tokens_to_generate=outs[i])
        arr.append(Arrival(t, p, sp))
    # the pool must hold the largest single request
    need = max(-(-(len(p) + o) // block_size) for p, o in zip(prompts, outs))
    both_modes(qwen3_ckpt, arr, num_kv_blocks=max(blocks // block_size * 4, need + 1), block_size_tokens=block_size, max_tokens=16)


def test_logging_steps_log_and_keep_the_chain(qwen3_ckpt, caplog):
    arr = [Arrival(0, p, GREEDY) for p in random_prompts(6, 3, 20, 256, seed=13)]
    with caplog.at_level("INFO", logger="megatron_async"):
        _, _, _, a = both_modes(qwen3_ckpt, arr, logging_step_interval=3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) >= 2 * (a.steps // 3) - 2  # both modes logged every third step
    assert a.overlap_ratio >= 0.9, a.as_dict()  # timing a step never breaks launch-ahead
