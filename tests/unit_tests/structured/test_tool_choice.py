"""tool_choice "required" / a named function as a grammar of the hermes tool-call format: the
calls it accepts are those the tool-call parser reads back, with arguments held to each tool's
schema; a second call only where parallel calls are allowed."""
import json

import pytest

from megatron_async.inference.structured.grammars import Grammars
from megatron_async.models.tiny_tokenizer import EOS_TOKEN_ID, train_tiny_tokenizer
from megatron_async.serve.openai_protocol import BadRequest, FunctionTool, NamedToolChoice
from megatron_async.serve.chat_output import HermesToolCalls
from megatron_async.serve.sampling_fields import tool_choice_spec

pytest.importorskip("llguidance")
pytest.importorskip("pydantic")

TOOLS = [FunctionTool.model_validate(t) for t in (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}})]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(1024)


def accepts(tok, spec, text: str) -> bool:
    g = Grammars(tok, (EOS_TOKEN_ID,), 1024, mode="auto", threads=1).matcher(spec)
    return g.accept(tok.encode(text, add_special_tokens=False).ids) and g.accept([EOS_TOKEN_ID])


def test_required_allows_one_call_or_more_of_any_tool(tok):
    spec = tool_choice_spec(TOOLS, "required", None, "hermes")
    assert spec.kind == "grammar"
    for text in (WEATHER, TIME, WEATHER + "\n" + TIME):
        assert accepts(tok, spec, text), text
    for text in ("", "Sure: " + TIME, WEATHER.replace("city", "town"), TIME.replace("{}", '{"x": 1}')):
        assert not accepts(tok, spec, text), text
    assert not accepts(tok, tool_choice_spec(TOOLS, "required", False, "hermes"), WEATHER + "\n" + TIME)
    calls = HermesToolCalls()
    calls.feed(WEATHER + "\n" + TIME)
    calls.finish()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_named_function_allows_only_one_call_of_it(tok):
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    spec = tool_choice_spec(TOOLS, named, None, "hermes")
    assert accepts(tok, spec, TIME)
    assert not accepts(tok, spec, WEATHER) and not accepts(tok, spec, TIME + "\n" + TIME)
    assert tool_choice_spec(TOOLS, "auto", None, "hermes") is None
    with pytest.raises(BadRequest, match="tool-call parser"):
        tool_choice_spec(TOOLS, "required", None, None)
