"""Stop strings on the decoded text through the engine (also across token boundaries), EOS
text left out, a list of EOS ids in the checkpoint, the model's position limit, and
async == serial with all of it (launch-ahead drops the row past a text stop)."""
import json
import logging

import pytest

from megatron_async import LLM, InferenceConfig, InvalidRequestError, SamplingParams
from megatron_async.inference.text_stream import REPLACEMENT_CHAR
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.unit_tests.inference.engine_driver import drive

CFG = dict(block_size_tokens=4, num_kv_blocks=128, max_requests=4, max_tokens=32, max_sequence_length=96)
PROMPTS = ["The quick brown fox", "Hello world! How are you", "Rivers flow to the sea", "def add(a, b):"]
NEW = 24


def _llm(async_scheduling: bool = True, **overrides) -> LLM:
    return LLM(inference_config=InferenceConfig(**{**CFG, "async_scheduling": async_scheduling, **overrides}))


@pytest.fixture(scope="module")
def greedy():
    llm = _llm(False)
    outs = llm.generate(PROMPTS, SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True))
    return llm.tokenizer, [o.generated_tokens for o in outs]


def _boundary_stop(tok, gen: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next one's,
    and the number of tokens after which the decoded text first contains it."""
    pieces = [tok.decode([t]) for t in gen]
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 2 and len(b) >= 2 and REPLACEMENT_CHAR not in a + b:
            stop = a[-2:] + b[:2]
            k = next(k for k in range(1, len(gen) + 1) if stop in tok.decode(gen[:k]))
            return stop, k
    raise AssertionError("no clean token boundary in the greedy text")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])
def test_stop_string_across_a_token_boundary(greedy, async_scheduling, include):
    tok, gen = greedy
    stop, k = _boundary_stop(tok, gen[0])
    llm = _llm(async_scheduling)
    sp = SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True, stop_words=["\x00never", stop],
                        include_stop_str_in_output=include)
    out = llm.generate([PROMPTS[0]], sp)[0]
    full = tok.decode(gen[0][:k])
    end = full.index(stop) + (len(stop) if include else 0)
    assert out.finish_reason == "stop" and out.generated_tokens == gen[0][:k]
    assert out.generated_text == full[:end]
    assert llm.engine.stats.discarded_rows == (1 if async_scheduling and k < NEW else 0)


def test_stop_words_are_not_encoded_with_special_tokens(greedy):
    tok, gen = greedy
    stop, k = _boundary_stop(tok, gen[1])
    llm = _llm()
    added = []
    original = llm.tokenizer.encode
    llm.tokenizer.encode = lambda text, add_special_tokens=True: added.append(text) or original(text, add_special_tokens)
    out = llm.generate([tok.encode(PROMPTS[1])], SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=stop,
                                                               ignore_eos=True))[0]
    assert added == [] and out.finish_reason == "stop" and len(out.generated_tokens) == k


def test_eos_text_is_not_in_the_output(greedy):
    tok, gen = greedy
    cont = gen[2]
    i = next(i for i in range(2, NEW) if cont[i] not in cont[:i] and REPLACEMENT_CHAR not in tok.decode(cont[:i]))
    llm = _llm()
    out = llm.generate([PROMPTS[2]], SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=cont[i]))[0]
    assert out.finish_reason == "stop" and out.generated_tokens == cont[: i + 1]
    assert out.generated_text == tok.decode(cont[:i])  # the stopping token's text is left out


def test_async_equals_serial_with_text_stops_and_staggered_arrivals(greedy):
    tok, gen = greedy
    stops = [_boundary_stop(tok, g)[0] for g in gen[:2]]
    params = [
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True, stop_words=[stops[0]]),
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True, stop_words=[stops[1]],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0.9, seed=7, num_tokens_to_generate=NEW, stop_words=["e", "a"]),
        SamplingParams(top_k=1, num_tokens_to_generate=NEW, stop_words=[gen[3][4:6]], ignore_eos=True),
    ]
    arrivals = [0, 0, 3, 5]
    results = {}
    for mode in (False, True):
        llm = _llm(mode)
        eng, outs, updates = llm.engine, {}, {}
        for step in range(200):
            for i, at in enumerate(arrivals):
                if at == step:
                    eng.add_request(PROMPTS[i], params[i], request_id=100 + i)
            if step > max(arrivals) and not eng.has_unfinished_requests():
                break
            res = eng.step()
            outs.update({o.request_id: o for o in res.finished})
            for u in res.updates:
                updates[u.request_id] = updates.get(u.request_id, "") + u.new_text
        results[mode] = [(o.generated_tokens, o.generated_text, o.finish_reason) for _, o in sorted(outs.items())]
        assert all(updates[rid] == o.generated_text for rid, o in outs.items())
        if mode:
            st = eng.stats
            assert st.overlapped_steps > st.steps // 2 and st.discarded_rows >= 3, st.as_dict()
    assert results[True] == results[False]
    assert [r[2] for r in results[True]] == ["stop"] * 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama_eos"))


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_every_eos_id_of_a_list_stops(llama_dir, tmp_path, where):
    base = LLM(str(llama_dir), inference_config=InferenceConfig(**CFG))
    cont = base.generate([[3, 14, 15, 92]], SamplingParams(top_k=1, num_tokens_to_generate=8))[0].generated_tokens
    i = next(i for i in range(2, 8) if cont[i] not in cont[:i])
    absent = next(t for t in range(256) if t not in cont)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in llama_dir.iterdir():
        (ckpt / f.name).symlink_to(f)
    path = ckpt / where
    cfg = json.loads((llama_dir / where).read_text()) if (llama_dir / where).exists() else {}
    cfg["eos_token_id"] = [absent, cont[i]]  # the stopping id is not the first one
    if path.exists():
        path.unlink()
    path.write_text(json.dumps(cfg))
    llm = LLM(str(ckpt), inference_config=InferenceConfig(**CFG))
    out = llm.generate([[3, 14, 15, 92]], SamplingParams(top_k=1, num_tokens_to_generate=8))[0]
    assert out.finish_reason == "stop" and out.generated_tokens == cont[: i + 1]


def test_max_sequence_length_is_clamped_to_the_model_positions(llama_dir, caplog):
    cfg = InferenceConfig(**{**CFG, "max_sequence_length": 4096, "num_kv_blocks": 400})
    with caplog.at_level(logging.WARNING, logger="megatron_async"):
        llm = LLM(str(llama_dir), inference_config=cfg)
    limit = llm.model.max_position_embeddings
    assert limit == 512 and llm.config.max_sequence_length == limit and cfg.max_sequence_length == 4096
    assert "max_position_embeddings 512" in caplog.text
    with pytest.raises(InvalidRequestError, match="exceeds max_sequence_length 512"):
        llm.engine.add_request([1] * 1400, SamplingParams(num_tokens_to_generate=4))
    outs = llm.generate([[1] * 1400, [1, 2, 3]], SamplingParams(top_k=1, num_tokens_to_generate=4))
    assert outs[0].finish_reason == "error" and len(outs[1].generated_tokens) == 4
