"""Streaming through the engine with scripted samples (the sampler is replaced so the model
"writes" chosen texts): multi-byte characters split over tokens, stop strings that span
them, serial and launch-ahead."""
import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.inference.text_generation_controllers import sampling
from tests.unit_tests.inference.engine_driver import drive

TEXTS = ["naïve café — 日本語 🙂 done", "Hello 🙂🙂 world, ça va? 日本", "über straße 🙂 fin"]
STOPS = [None, ["🙂 w"], ["aße 🙂"]]
PROMPT = [5, 6, 7]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_scripted_multibyte_stream(monkeypatch, async_scheduling):
    llm = LLM(inference_config=InferenceConfig(block_size_tokens=4, num_kv_blocks=64, max_requests=4, max_tokens=32,
                                               max_sequence_length=96, async_scheduling=async_scheduling))
    tok = llm.tokenizer
    scripts = {seed: tok.encode(text) for seed, text in enumerate(TEXTS)}
    assert any(any("\ufffd" in tok.decode([t]) for t in s) for s in scripts.values())  # split characters

    def scripted(logits, params, any_filter):
        out = [scripts[int(s)][p - len(PROMPT)] if p - len(PROMPT) < len(scripts[int(s)]) else 0
               for s, p in zip(params.seed.tolist(), params.position.tolist())]
        return torch.tensor(out, dtype=torch.int64, device=logits.device)

    monkeypatch.setattr(sampling, "sample_reference", scripted)  # the CPU (torch) sampling backend
    eng = llm.engine
    rids = [eng.add_request(PROMPT, SamplingParams(temperature=1.0, seed=i, num_tokens_to_generate=len(scripts[i]),
                                                   ignore_eos=True, stop_words=STOPS[i])) for i in range(len(TEXTS))]
    outs, updates = drive(eng)
    for i, rid in enumerate(rids):
        out, deltas = outs[rid], [u.new_text for u in updates[rid]]
        expected = TEXTS[i] if STOPS[i] is None else TEXTS[i][: TEXTS[i].index(STOPS[i][0])]
        assert out.generated_text == expected and "".join(deltas) == expected
        assert not any("\ufffd" in d for d in deltas)
        assert out.finish_reason == ("length" if STOPS[i] is None else "stop")
    if async_scheduling:
        assert eng.stats.discarded_rows == 2 and eng.stats.overlapped_steps > 5  # the two text stops
