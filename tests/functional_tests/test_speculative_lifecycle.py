"""Speculative decoding through the engine's lifecycle events, serial and launch-ahead:
finishes inside an accepted run, KV block boundaries inside the draft window, small pools
with pauses and evictions, prefix caching, penalties, and speculation switching itself off.
Each case asserts that its event happened (EngineStats) and that outputs equal plain decoding."""
from megatron_async import SamplingParams
from tests.helpers.engine_harness import Arrival, make_llm, random_prompts
from tests.helpers.spec_harness import assert_partial_acceptance, run_plain_and_spec

GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=14)


def _continuations(path, prompts, n):
    outs = make_llm(path).generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=n))
    return [o.generated_tokens for o in outs]


def test_eos_and_stop_sequences_inside_accepted_runs(qwen3_ckpt):
    prompts = random_prompts(6, 3, 15, 256, seed=31)
    conts = _continuations(qwen3_ckpt, prompts, 16)
    arr = []
    for i, (p, c) in enumerate(zip(prompts, conts)):
        if i % 2:  # a stop sequence from the middle of the continuation
            params = SamplingParams(top_k=1, num_tokens_to_generate=16, stop_words=[c[6:8]], return_log_probs=True)
        else:  # EOS = a token of the continuation
            params = SamplingParams(top_k=1, num_tokens_to_generate=16, termination_id=c[5], return_log_probs=True)
        arr.append(Arrival(i, p, params))
    # the oracle knows the continuation past the stop, so accepted runs extend beyond it
    for plain, spec, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.0).values():
        assert all(o.finish_reason == "stop" for o in plain.values())
        assert all(len(o.generated_tokens) < 16 for o in plain.values())
        assert st.spec_truncated_rows > 0, st.as_dict()


def test_length_limits_cap_the_drafts(qwen3_ckpt):
    arr = [Arrival(0, p, SamplingParams(top_k=1, num_tokens_to_generate=n))
           for p, n in zip(random_prompts(4, 3, 12, 256, seed=32), (7, 8, 9, 2))]
    for plain, spec, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.0,
                                              max_sequence_length=30).values():
        assert [len(spec[i].generated_tokens) for i in range(4)] == [7, 8, 9, 2]
        depth = st.spec_draft_tokens_per_depth
        assert depth[0] > depth[2], st.as_dict()  # rows near a limit verified fewer drafts


def test_block_boundaries_inside_the_draft_window(qwen3_ckpt):
    arr = [Arrival(i, p, GREEDY) for i, p in enumerate(random_prompts(5, 3, 13, 256, seed=33))]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.35, block_size_tokens=2).values():
        assert_partial_acceptance(st)


def test_small_pool_pauses_and_evictions(qwen3_ckpt):
    arr = [Arrival(i, p, GREEDY) for i, p in enumerate(random_prompts(10, 5, 30, 256, seed=5))]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=2, drafter_rate=0.3, num_kv_blocks=24,
                                       max_tokens=32).values():
        assert st.paused > 0 and st.evicted > 0, st.as_dict()
        assert st.spec_accepted_tokens > 0


def test_prefix_caching(qwen3_ckpt):
    shared = random_prompts(1, 12, 12, 256, seed=34)[0]
    prompts = [shared + p for p in random_prompts(6, 2, 9, 256, seed=35)]
    arr = [Arrival(3 * i, p, GREEDY) for i, p in enumerate(prompts)]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.3, enable_prefix_caching=True).values():
        assert st.prefix_hit_tokens > 0, st.as_dict()
        assert_partial_acceptance(st)


def test_penalty_requests_do_not_draft(qwen3_ckpt):
    pen = SamplingParams(temperature=0.9, seed=3, presence_penalty=0.5, repetition_penalty=1.2, min_tokens=4,
                         num_tokens_to_generate=12)
    prompts = random_prompts(4, 3, 12, 256, seed=36)
    arr = [Arrival(0, p, pen if i % 2 else GREEDY) for i, p in enumerate(prompts)]
    for _, _, st in run_plain_and_spec(qwen3_ckpt, arr, k=2, drafter_rate=0.3).values():
        assert st.spec_off_rows["penalties"] > 0 and st.spec_accepted_tokens > 0, st.as_dict()


def test_switches_off_by_acceptance_and_batch(qwen3_ckpt):
    arr = [Arrival(0, p, GREEDY) for p in random_prompts(6, 3, 12, 256, seed=37)]
    for *_, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=1.0, speculative_min_acceptance=0.5,
                                     speculative_probe_interval=4).values():
        off = st.spec_off_rows["acceptance"]
        assert off > 0 and st.spec_verify_rows > 0, st.as_dict()  # off, with probes between
    arr = [Arrival(0, p, SamplingParams(top_k=1, num_tokens_to_generate=3 + 2 * i))
           for i, p in enumerate(random_prompts(6, 3, 12, 256, seed=39))]
    for *_, st in run_plain_and_spec(qwen3_ckpt, arr, k=3, drafter_rate=0.0, speculative_max_batch_size=3).values():
        assert st.spec_off_rows["batch"] > 0 and st.spec_accepted_tokens > 0, st.as_dict()
