"""Token ids in and out of chat through the real server and the official ``openai`` client (a
multi-turn rollout that never re-tokenizes its earlier turns): ``return_token_ids`` puts the
prompt's ids at the top of the response (and of each choice's first chunk when streamed) and the
answer's in each choice; ``prompt_token_ids`` replaces the rendered messages, and the same ids
give the same answer; the next turn sends the earlier ids, the answer's ids and the new turn's;
bad combinations are 400s naming the field; ``metadata`` is accepted and ignored."""
import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

FLAGS = ["--num-kv-blocks", "200", "--block-size", "16", "--max-requests", "8", "--max-sequence-length", "384"]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("ids") / "tiny-chat",
                                with_tokenizer=True, vocab_size=512)
    save_chat_template(ckpt)
    with ServerProcess(["--model", str(ckpt), *FLAGS]) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        c.tokenize = lambda body: json.loads(urllib.request.urlopen(urllib.request.Request(
            f"{srv.url}/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}), timeout=60).read())
        yield c


def chat(client, **kw):
    extra = {**IDS, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model="tiny-chat", seed=3, max_tokens=8, extra_body=extra, **kw)


def test_token_ids_in_and_out_over_turns(client):
    messages = [{"role": "user", "content": "Name a river."}]
    first = chat(client, messages=messages, metadata={"run": "a"})
    p1, g1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    rendered = client.tokenize({"model": "tiny-chat", "messages": messages})
    assert p1 == rendered["tokens"] and first.choices[0].model_extra["prompt_token_ids"] == p1
    same = chat(client, messages=[], extra_body={"prompt_token_ids": p1})
    assert same.choices[0].model_extra["token_ids"] == g1 and same.model_extra["prompt_token_ids"] == p1
    assert same.choices[0].message.content == first.choices[0].message.content
    turn = client.tokenize({"model": "tiny-chat", "prompt": " And a sea?", "add_special_tokens": False})["tokens"]
    second = chat(client, messages=[], extra_body={"prompt_token_ids": p1 + g1 + turn})
    assert second.model_extra["prompt_token_ids"] == p1 + g1 + turn
    assert second.usage.prompt_tokens == len(p1 + g1 + turn) and len(second.choices[0].model_extra["token_ids"]) == 8


def test_streamed_chunks_carry_the_prompt_ids_first(client):
    ids = chat(client, messages=[{"role": "user", "content": "Hi"}]).model_extra["prompt_token_ids"]
    whole = chat(client, messages=[], extra_body={"prompt_token_ids": ids})
    chunks = list(chat(client, messages=[], stream=True, extra_body={"prompt_token_ids": ids}))
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == whole.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("kw, field", [
    (dict(messages=[{"role": "user", "content": "x"}], extra_body={"prompt_token_ids": [1, 2]}), "messages"),
    (dict(messages=[], extra_body={"prompt_token_ids": [1, 2], "chat_template_kwargs": {"a": 1}}),
     "chat_template_kwargs"),
    (dict(messages=[]), "messages"),
    (dict(messages=[], extra_body={"prompt_token_ids": [1, 10**6]}), "vocab"),
    (dict(messages=[], extra_body={"prompt_token_ids": []}), "prompt_token_ids"),
])
def test_bad_token_prompts_are_400(client, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert field in str(e.value)
    assert chat(client, messages=[{"role": "user", "content": "ok"}]).choices  # still serving
