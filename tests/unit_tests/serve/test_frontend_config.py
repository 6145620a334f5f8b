"""What a front-end process is told through its stdin (serve/ipc.py) is JSON and comes
back equal: its tokenizer encodes and decodes as the engine's does, with the same EOS ids; keys,
limits, template and grammar settings unchanged."""
import dataclasses
import json

from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer
from megatron_async.models.tokenizer import Tokenizer
from megatron_async.serve.ipc import FrontendConfig
from megatron_async.serve.http_guard import HttpPolicy


def config(**kw) -> FrontendConfig:
    return FrontendConfig(
        index=1, directory="/tmp/megatron-async-x", secret=bytes(range(32)), fd=7, parent_pid=42, model_name="m",
        tokenizer=Tokenizer(train_tiny_tokenizer(), (EOS_TOKEN_ID, 3)), chat_template=("{{ messages }}", {"eos": "</s>"}),
        max_model_len=128, max_requests=4, max_request_bytes=1 << 20, created=123, tool_call_parser="hermes",
        reasoning_parser=None, admin_endpoints=True, grammars=((2, 1), 512, "auto", 2),
        policy=HttpPolicy(api_key="k", admin_api_key="a", allowed_origins=("https://x",), max_prompts_per_body=9),
        log_level="info", **kw)


def test_the_config_travels_as_json_and_comes_back_equal():
    sent = config()
    data = sent.to_json()
    assert json.loads(data)["secret"] == bytes(range(32)).hex()
    back = FrontendConfig.from_json(data)
    plain = lambda c: {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "tokenizer"}  # noqa: E731
    assert plain(back) == plain(sent)
    assert type(back.policy.allowed_origins) is tuple and type(back.chat_template) is tuple
    text = "Hello there, a tiny tokenizer!"
    assert back.tokenizer.encode(text) == sent.tokenizer.encode(text)
    ids = sent.tokenizer.encode(text)
    assert back.tokenizer.decode(ids) == sent.tokenizer.decode(ids)
    assert back.tokenizer.eos_token_ids == (EOS_TOKEN_ID, 3) and back.tokenizer.vocab_size == sent.tokenizer.vocab_size


def test_no_tokenizer_no_template_no_grammars():
    sent = dataclasses.replace(config(), tokenizer=None, chat_template=None, grammars=None, policy=HttpPolicy())
    back = FrontendConfig.from_json(sent.to_json())
    assert back == sent
