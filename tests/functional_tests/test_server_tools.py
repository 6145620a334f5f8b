"""Tools and reasoning through the real server (python -m megatron_async.serve --reasoning-parser
qwen3; the tool-call parser picked from the chat template) and the official ``openai`` client, on
a checkpoint whose answers are scripted (scripted_checkpoint.py): tools and tool_choice reach the
template, tool calls come back as ``tool_calls`` whole and as stream deltas, ``<think>`` sections
as ``reasoning_content``, and tool-call / tool messages go back into the template."""
import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import tokenizers  # noqa: E402

from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.functional_tests.scripted_checkpoint import make_scripted_checkpoint  # noqa: E402

TEMPLATE = (
    '{% if tools %}Call tools as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Tools:'
    "{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}"
    "{% for m in messages %}[{{ m.role }}{% if m.tool_call_id %} {{ m.tool_call_id }}{% endif %}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}{% endfor %}"
    "{% if add_generation_prompt and enable_thinking %}<think>{% endif %}"
)
SCRIPTS = {  # a prompt ending in the trigger is answered with these pieces, one token each
    "<|weather|>": ["Let me check.", "\n<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_',
                    'call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'],
    "<|bad|>": ['<tool_call>{"name"', ": oops}</tool_call>"],
    "<|think|>": ["<th", "ink>The user", " wants a greeting.</thi", "nk>\n\nHello", " there!"],
    "<think>": ["Inside reasoning.", "</think>", "Answer."],
    "<|both|>": ["<think>I should call get_weather.</think>\n",
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'],
    "<|done|>": ["It is 12 C", " in Paris."],
}
WEATHER_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}
FLAGS = ["--num-kv-blocks", "64", "--block-size", "16", "--max-requests", "8", "--max-sequence-length", "256",
         "--reasoning-parser", "qwen3"]
GREEDY = {"model": "scripted", "temperature": 0.0, "extra_body": {"return_token_ids": True}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("tools") / "scripted", SCRIPTS, TEMPLATE)


@pytest.fixture(scope="module")
def client(ckpt):
    with ServerProcess(["--model", str(ckpt), *FLAGS]) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt_of(ckpt):
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    return lambda choice: tok.decode(choice.model_extra["prompt_token_ids"])


def user(text):
    return [{"role": "user", "content": text}]


def streamed(client, **kwargs):
    """Per choice: (content pieces, reasoning pieces, tool calls, finish reasons, token ids) of a
    streamed answer, merged as a client merges them; asserts each call's id and name come before
    its arguments."""
    answers = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content, reasoning, calls, finishes, ids = answers.setdefault(c.index, ([], [], {}, [], []))
            d = c.delta
            content += [d.content] if d.content else []
            reasoning += [d.model_extra["reasoning_content"]] if d.model_extra.get("reasoning_content") else []
            for t in d.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.type == "function" and t.function.name and not t.function.arguments
                    calls[t.index] = [t.function.name, ""]
                else:
                    assert t.id is None and t.function.name is None
                    calls[t.index][1] += t.function.arguments
            finishes += [c.finish_reason] if c.finish_reason else []
            ids += c.model_extra.get("token_ids") or []
    return [(a[0], a[1], [tuple(a[2][i]) for i in sorted(a[2])], a[3], a[4]) for _, a in sorted(answers.items())]


def test_tool_calls_come_back_whole_and_streamed(client, prompt_of):
    kwargs = dict(messages=user("Weather in Paris?<|weather|>"), tools=[WEATHER, TIME], **GREEDY)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert "Tools: get_weather get_time[user]" in prompt_of(choice)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(t.type == "function" and t.id.startswith("call_") for t in choice.message.tool_calls)

    answers = streamed(client, n=2, **kwargs)  # a parser per choice
    assert len(answers) == 2
    for content, _, stream_calls, finishes, ids in answers:
        assert content and "".join(content) == "Let me check." and finishes == ["tool_calls"]  # no tag text leaked
        assert [(n, json.loads(a)) for n, a in stream_calls] == calls
        assert ids == choice.model_extra["token_ids"]  # every token's chunk was sent


def test_tool_choice_none_named_and_no_tools(client, prompt_of):
    none = client.chat.completions.create(messages=user("Weather?<|weather|>"), tools=[WEATHER, TIME], tool_choice="none",
                                          **GREEDY).choices[0]
    assert "Tools:" not in prompt_of(none)
    assert none.message.content == WEATHER_CALL and not none.message.tool_calls and none.finish_reason == "stop"
    no_tools = client.chat.completions.create(messages=user("Weather?<|weather|>"), **GREEDY).choices[0]
    assert no_tools.message.content == WEATHER_CALL and not no_tools.message.tool_calls
    named = client.chat.completions.create(messages=user("Time?<|weather|>"), tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           **GREEDY).choices[0]
    assert "Tools: get_time[user]" in prompt_of(named) and named.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in named.message.tool_calls] == [("get_time", "{}")]
    required = client.chat.completions.create(messages=user("x"), tools=[TIME], tool_choice="required",
                                              **GREEDY).choices[0]  # a grammar forces the call (sampling_fields.py)
    assert [t.function.name for t in required.message.tool_calls] == ["get_time"]
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(messages=user("x"), tools=[{"type": "function", "function": {"name": "a b"}}],
                                       **GREEDY)


def test_malformed_call_is_plain_content(client):
    kwargs = dict(messages=user("x<|bad|>"), tools=[WEATHER], **GREEDY)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == '<tool_call>{"name": oops}</tool_call>' and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    [(content, _, calls, finishes, _)] = streamed(client, **kwargs)
    assert "".join(content) == choice.message.content and not calls and finishes == ["stop"]


def test_tool_results_go_back_into_the_template(client, prompt_of):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*user("Weather in Paris?"), {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C<|done|>"}]
    choice = client.chat.completions.create(messages=messages, tools=[WEATHER], **GREEDY).choices[0]
    assert ('[assistant]<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            "[tool call_1]12 C") in prompt_of(choice)
    assert choice.message.content == "It is 12 C in Paris." and choice.finish_reason == "stop"


def test_reasoning_content_whole_and_streamed(client):
    kwargs = dict(messages=user("Hi<|think|>"), **GREEDY)
    msg = client.chat.completions.create(**kwargs).choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants a greeting." and msg.content == "Hello there!"
    [(content, reasoning, _, finishes, _)] = streamed(client, **kwargs)
    assert "".join(reasoning) == "The user wants a greeting." and "".join(content) == "Hello there!"
    # one delta or several: events waiting for a stream go out merged (incremental: test_chat_output.py)
    assert finishes == ["stop"] and len(reasoning) >= 1


def test_reasoning_opened_by_the_template(client, prompt_of):
    choice = client.chat.completions.create(
        messages=user("Hi"), model="scripted", temperature=0.0,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}}).choices[0]
    assert prompt_of(choice).endswith("<think>")
    assert choice.message.model_extra["reasoning_content"] == "Inside reasoning." and choice.message.content == "Answer."


def test_reasoning_then_tool_call(client):
    kwargs = dict(messages=user("Weather in Rome?<|both|>"), tools=[WEATHER], **GREEDY)
    choice = client.chat.completions.create(**kwargs).choices[0]
    msg = choice.message
    assert msg.model_extra["reasoning_content"] == "I should call get_weather." and msg.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [("get_weather", {"city": "Rome"})]
    [(content, reasoning, calls, finishes, _)] = streamed(client, **kwargs)
    assert not content and "".join(reasoning) == "I should call get_weather." and finishes == ["tool_calls"]
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Rome"})]
