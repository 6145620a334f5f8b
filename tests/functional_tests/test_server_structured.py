"""Structured outputs through the real server and the official ``openai`` client (a tiny random
checkpoint): ``response_format`` json_schema (nested objects, enums, arrays with min / max items)
validates every time, whole and streamed, for every one of ``n`` samples; ``structured_outputs``
and the older ``guided_*`` names constrain regex and choice answers; a bad schema, regex or
grammar, two sources, or an unsupported sub-field is a 400 naming it, and the server keeps
serving."""
import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.functional_tests.server_client import json_request as post  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

FLAGS = ["--num-kv-blocks", "200", "--block-size", "16", "--max-requests", "16", "--max-sequence-length", "384"]
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "status": {"enum": ["open", "closed"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                                "admin": {"type": "boolean"}},
              "required": ["name", "admin"], "additionalProperties": False}},
    "required": ["id", "status", "tags", "owner"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("structured") / "tiny-chat",
                                with_tokenizer=True, vocab_size=512)
    save_chat_template(ckpt)
    with ServerProcess(["--model", str(ckpt), *FLAGS]) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


def test_json_schema_answers_validate_whole_and_streamed(client):
    for strict in (True, False):  # enforced either way, as vLLM does
        fmt = {**RESPONSE_FORMAT, "json_schema": {**RESPONSE_FORMAT["json_schema"], "strict": strict}}
        res = client.chat.completions.create(model="tiny-chat", messages=user("A ticket, please."), n=3, seed=5,
                                             temperature=1.0, max_tokens=150, response_format=fmt)
        for c in res.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), SCHEMA)
    pieces = {}
    for chunk in client.chat.completions.create(model="tiny-chat", messages=user("Another."), n=2, seed=9,
                                                max_tokens=150, response_format=RESPONSE_FORMAT, stream=True):
        for c in chunk.choices:
            pieces.setdefault(c.index, []).append(c.delta.content or "")
    assert len(pieces) == 2
    for texts in pieces.values():
        jsonschema.validate(json.loads("".join(texts)), SCHEMA)
    comp = client.completions.create(model="tiny-chat", prompt="ticket:", max_tokens=150, temperature=0.7, seed=1,
                                     extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)


def test_regex_and_choice_by_every_name(client):
    bodies = [{"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{3}"}}, {"guided_regex": r"[A-Z]{2}-[0-9]{3}"}]
    for body in bodies:
        for c in client.completions.create(model="tiny-chat", prompt="code:", max_tokens=20, n=3, seed=3,
                                           temperature=1.0, extra_body=body).choices:
            assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", c.text) and c.finish_reason == "stop", c
    for body in [{"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, {"guided_choice": ["yes", "no", "maybe"]}]:
        res = client.chat.completions.create(model="tiny-chat", messages=user("Well?"), max_tokens=10, n=4, seed=2,
                                             temperature=1.0, extra_body=body)
        assert all(c.message.content in ("yes", "no", "maybe") for c in res.choices)
    gbnf = 'root ::= "[" [0-9] ("," [0-9])* "]"'
    text = client.completions.create(model="tiny-chat", prompt="list:", max_tokens=30, temperature=0.0,
                                     extra_body={"structured_outputs": {"grammar": gbnf}}).choices[0].text
    assert re.fullmatch(r"\[[0-9](,[0-9])*\]", text), text


@pytest.mark.parametrize("body,status_param,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format", "strin"),
    ({"structured_outputs": {"regex": "(ab["}}, "structured_outputs", "nclosed"),
    ({"guided_grammar": 'root ::= "a" undefined_rule'}, "guided_grammar", "undefined_rule"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "both constrain"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "Extra inputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": True}, "ignore_eos": True}, None, "ignore_eos"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "outlines"),
])
def test_bad_constraints_are_400_naming_the_field(client, body, status_param, needle):
    with pytest.raises(openai.BadRequestError, match=re.escape(needle)) as e:
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=5, extra_body=body)
    if status_param is not None:
        assert e.value.body["param"] == status_param, e.value.body
    ok = client.completions.create(model="tiny-chat", prompt="x", max_tokens=5, extra_body={"guided_choice": ["ok"]})
    assert ok.choices[0].text == "ok"  # the server kept serving


def test_tokenize_and_detokenize(client):
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    chat = {"model": "tiny-chat", "messages": user("Hello there"), "return_token_strs": True}
    _, got = post(f"{base}/tokenize", chat)
    res = client.chat.completions.create(model="tiny-chat", messages=user("Hello there"), max_tokens=2,
                                         extra_body={"return_token_ids": True})
    assert got["tokens"] == res.choices[0].model_extra["prompt_token_ids"] and got["count"] == len(got["tokens"])
    _, tail = post(f"{base}/detokenize", {"tokens": got["tokens"][-3:]})
    assert got["max_model_len"] == 384 and "".join(got["token_strs"]).endswith(tail["prompt"])
    _, plain = post(f"{base}/tokenize", {"prompt": "a cat", "add_special_tokens": False})
    assert post(f"{base}/detokenize", {"tokens": plain["tokens"]}) == (200, {"prompt": "a cat"})
    for url, body, param in [("/detokenize", {"tokens": [0, 10**6]}, "tokens"),
                             ("/tokenize", {"prompt": "x", "messages": user("y")}, "prompt"),
                             ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                             ("/tokenize", {"prompt": "x", "extra": 1}, "extra")]:
        status, err = post(f"{base}{url}", body)
        assert status in (400, 404) and err["error"]["param"] == param, err
