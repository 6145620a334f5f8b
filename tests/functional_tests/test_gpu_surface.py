"""The request surface on CUDA, graphs on (the default, warm-up included), built-in tiny model:
n samples of one prompt prefill it once (counters) and, batch-invariant, each equals its request
alone; bad_words of several tokens hold in graph replays (the newest-token history moves inside
the graph), launch-ahead == serial == eager token for token. Skipped without a GPU."""
import random

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from tests.helpers.engine_harness import Arrival, count_replays_by_variant, run_arrivals, tokens_of

pytestmark = pytest.mark.gpu

BS = 16


def _llm(async_scheduling=True, graphs=True, **cfg) -> LLM:
    base = dict(block_size_tokens=BS, max_requests=16, max_tokens=256, max_sequence_length=512, num_kv_blocks=300)
    return LLM(None, device="cuda", inference_config=InferenceConfig(
        **base, async_scheduling=async_scheduling, cuda_graphs=graphs, **cfg))


def test_n_samples_prefill_once_and_equal_their_single_requests():
    prompt = [random.Random(1).randrange(1, 900) for _ in range(100)]
    params = [SamplingParams(temperature=0.9, top_k=50, seed=7 + i, num_tokens_to_generate=24, ignore_eos=True)
              for i in range(8)]
    llm = _llm(batch_invariant=True)
    group = [o.generated_tokens for o in llm.generate([prompt] * 8, params)]
    st = llm.engine.stats
    shared = (len(prompt) - 1) // BS * BS  # generate() adds while stepping: some copies arrive after the
    assert st.prompt_shares >= 1 and st.prefix_hit_tokens == 7 * shared, st.as_dict()  # blocks were published
    assert st.prefill_tokens == len(prompt) + 7 * (len(prompt) - shared), st.as_dict()
    alone = [llm.generate([prompt], p)[0].generated_tokens for p in params]
    assert group == alone and len({tuple(t) for t in group}) > 1


def _bad_words_run(async_scheduling: bool, graphs: bool):
    llm = _llm(async_scheduling, graphs)
    replays = count_replays_by_variant(llm.runner.graphs) if graphs else None
    tok, rng = llm.tokenizer, random.Random(2)
    prompts = [[rng.randrange(1, 900) for _ in range(rng.randint(5, 40))] for _ in range(12)]
    sp = [SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=32, ignore_eos=True) for i in range(12)]
    plain = [o.generated_tokens for o in _llm().generate(prompts, sp)]
    words = [[tok.decode(p[j:j + 2]) for j in (3, 9)] for p in plain]
    arr = [Arrival(i // 3, p, SamplingParams(temperature=0.8, seed=i, num_tokens_to_generate=32, ignore_eos=True,
                                             bad_words=[w for w in words[i] if w.strip()] or None))
           for i, p in enumerate(prompts)]
    return run_arrivals(llm, arr), llm, replays, words


def test_multi_token_bad_words_in_graphs_equal_serial_and_eager():
    outs, llm, replays, words = _bad_words_run(True, True)
    st = llm.engine.stats
    assert sum(replays.values()) > 0 and st.graph_captures_after_warmup == 0, (replays, st.as_dict())
    assert st.overlapped_decode_steps > 0.8 * st.decode_steps, st.as_dict()
    tok = llm.tokenizer
    for i, ws in enumerate(words):
        for w in ws:
            for s in {w, " " + w.lstrip()}:
                ids = tok.encode(s, add_special_tokens=False)
                if w.strip() and len(ids) > 1:
                    got = outs[i].generated_tokens
                    assert not any(got[j:j + len(ids)] == ids for j in range(len(got))), (i, s)
    serial, _, _, _ = _bad_words_run(False, True)
    eager, _, _, _ = _bad_words_run(True, False)
    assert tokens_of(outs) == tokens_of(serial) == tokens_of(eager)
