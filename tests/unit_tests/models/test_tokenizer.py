import json

import pytest

from megatron_async.models import load_tokenizer
from megatron_async.models.tiny_tokenizer import EOS_TOKEN, EOS_TOKEN_ID, save_tiny_tokenizer, train_tiny_tokenizer


def test_tiny_tokenizer_roundtrip_and_eos(tmp_path):
    save_tiny_tokenizer(tmp_path, vocab_size=512)
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 512 and tok.eos_token_id == EOS_TOKEN_ID
    text = "Hello world! Schedulers decode 123 tokens; ünïcode ✓"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id]) == EOS_TOKEN
    assert tok.decode([tok.eos_token_id] + ids, skip_special_tokens=True) == text


def test_no_tokenizer_json(tmp_path):
    assert load_tokenizer(tmp_path) is None
    assert load_tokenizer(None) is None


def test_eos_ids_keep_every_listed_id(tmp_path):
    """tokenizer_config's EOS token first, then every id of generation_config.json and config.json."""
    train_tiny_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).eos_token_id is None and load_tokenizer(tmp_path).eos_token_ids == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(tmp_path).eos_token_ids == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 9]}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (7, 5, 9) and tok.eos_token_id == 7
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS_TOKEN}}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (EOS_TOKEN_ID, 7, 5, 9) and tok.eos_token_id == EOS_TOKEN_ID
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, "x"]}))
    with pytest.raises(ValueError, match="config.json"):
        load_tokenizer(tmp_path)


def test_engine_stops_on_the_tokenizer_eos_ids(tmp_path):
    """The LLM's engine and its tokenizer agree on the EOS set (a list in generation_config.json)."""
    from megatron_async import LLM, InferenceConfig
    from tests.helpers.hf_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path, with_tokenizer=True)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, 12, 13]}))
    llm = LLM(str(ckpt), inference_config=InferenceConfig(max_sequence_length=64, num_kv_blocks=16))
    assert len(llm.tokenizer.eos_token_ids) == 4 and set(llm.tokenizer.eos_token_ids[1:]) == {11, 12, 13}
    assert llm.runner.eos_ids == llm.tokenizer.eos_token_ids
    assert llm.engine.validator.eos_ids == frozenset(llm.tokenizer.eos_token_ids)


def test_eos_ids_beyond_the_vocabulary_are_dropped_and_requests_still_run(tmp_path, caplog):
    """A config listing an EOS id the model cannot emit: dropped with a warning; requests that
    use the device-side stop masks (min_tokens, penalties) still run."""
    from megatron_async import LLM, InferenceConfig, SamplingParams
    from tests.helpers.hf_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path, with_tokenizer=True)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [11, vocab + 5]}))
    with caplog.at_level("WARNING", logger="megatron_async"):
        llm = LLM(str(ckpt), inference_config=InferenceConfig(max_sequence_length=64, num_kv_blocks=16))
    assert 11 in llm.runner.eos_ids and vocab + 5 not in llm.runner.eos_ids
    assert any("outside the vocabulary" in r.message for r in caplog.records)
    params = SamplingParams(temperature=0.8, seed=3, min_tokens=4, repetition_penalty=1.2, num_tokens_to_generate=6)
    (out,) = llm.generate([[5, 6, 7]], params)
    assert out.error is None and len(out.generated_tokens) >= 4
