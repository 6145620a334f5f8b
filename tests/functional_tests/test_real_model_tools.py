"""A real chat template (SmolLM2-135M-Instruct, see test_real_model.py) with a tool conversation:
the messages and tools a chat request hands the template render as transformers renders them, and
a template with no tool-call format gets no tool-call parser (answers stay text)."""
import pytest

pytest.importorskip("pydantic")

from megatron_async.models.chat_template import load_chat_template  # noqa: E402
from megatron_async.serve.chat_output import choose_parser  # noqa: E402
from megatron_async.serve.chat_routes import template_tools  # noqa: E402
from megatron_async.serve.openai_protocol import ChatCompletionRequest  # noqa: E402
from megatron_async.serve.request_input import parse_body  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
BODY = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
]}


def test_tool_conversation_renders_as_transformers_does(smollm2_ckpt):
    from transformers import AutoTokenizer

    req = parse_body(ChatCompletionRequest, BODY)
    messages, tools = [m.as_template_message() for m in req.messages], template_tools(req)
    ours = load_chat_template(smollm2_ckpt)
    hf = AutoTokenizer.from_pretrained(smollm2_ckpt).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.render(messages, True, tools=tools) == hf
    assert "<|im_start|>tool\n12 C<|im_end|>" in hf
    assert choose_parser("auto", ours) is None  # no <tool_call> format in this template: answers stay text
