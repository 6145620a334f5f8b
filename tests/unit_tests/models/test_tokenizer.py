import json

from megatron_async.models import load_tokenizer
from megatron_async.testing.tiny_tokenizer import EOS_TOKEN, EOS_TOKEN_ID, save_tiny_tokenizer, train_tiny_tokenizer


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


def test_eos_fallbacks(tmp_path):
    train_tiny_tokenizer(300).save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).eos_token_id is None
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(tmp_path).eos_token_id == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    assert load_tokenizer(tmp_path).eos_token_id == 7
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOS_TOKEN}}))
    assert load_tokenizer(tmp_path).eos_token_id == EOS_TOKEN_ID
