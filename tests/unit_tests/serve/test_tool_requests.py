"""Chat requests with tools: the schema (bad shapes are BadRequest naming the field), what
tool_choice hands the template, tool-call and tool messages as the template sees them, and which
parser the server picks."""
import pytest

pytest.importorskip("pydantic")

from megatron_async.models.chat_template import ChatTemplate  # noqa: E402
from megatron_async.serve.chat_output import choose_parser  # noqa: E402
from megatron_async.serve.chat_routes import template_tools  # noqa: E402
from megatron_async.serve.openai_protocol import BadRequest, ChatCompletionRequest  # noqa: E402
from megatron_async.serve.request_input import parse_body  # noqa: E402

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"messages": USER, **fields})


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": {}}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_tool_shapes_name_the_field(fields, param):
    with pytest.raises(BadRequest) as e:
        parse_body(ChatCompletionRequest, {"messages": USER, **fields})
    assert e.value.param == param, str(e.value)


def test_tool_choice_decides_what_the_template_gets():
    assert template_tools(request()) is None
    assert template_tools(request(tools=[WEATHER, TIME])) == [WEATHER, TIME]
    assert template_tools(request(tools=[WEATHER, TIME], tool_choice="auto")) == [WEATHER, TIME]
    assert template_tools(request(tools=[WEATHER, TIME], tool_choice="none")) is None
    named = {"type": "function", "function": {"name": "get_time"}}
    assert template_tools(request(tools=[WEATHER, TIME], tool_choice=named)) == [TIME]
    assert template_tools(request(tools=[WEATHER], tool_choice="required")) == [WEATHER]  # a grammar forces a call


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_tool_choices_that_cannot_be_honoured_are_refused(fields, param):
    with pytest.raises(BadRequest) as e:
        template_tools(request(**fields))
    assert e.value.param == param


def test_tool_call_and_tool_messages_reach_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    odd = {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    req = request(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call, odd]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}])
    msgs = [m.as_template_message() for m in req.messages]
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}
    assert msgs[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    template = ChatTemplate(
        "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
        "{% endfor %}", {})
    assert template.render(msgs, tools=template_tools(request(tools=[WEATHER]))) == (
        'get_weather;[user]Weather in Paris?[assistant]get_weather{"city": "Paris"}f"not json"[tool]12 C')


def test_parser_choice():
    hermes_template = ChatTemplate("{% if tools %}Call tools as <tool_call>{json}</tool_call>{% endif %}", {})
    plain_template = ChatTemplate("{{ messages }}", {})
    assert choose_parser("auto", hermes_template) == "hermes"
    assert choose_parser("auto", plain_template) is None and choose_parser("auto", None) is None
    assert choose_parser("hermes", plain_template) == "hermes"
    assert choose_parser("none", hermes_template) is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        choose_parser("mistral", plain_template)


def test_parser_flags(capsys):
    from megatron_async.serve.__main__ import build_parser

    args = build_parser().parse_args(["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "qwen3")
    defaults = build_parser().parse_args([])
    assert (defaults.tool_call_parser, defaults.reasoning_parser) == ("auto", None)
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([flag, "nope"])
        assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_tools_for_a_template_that_cannot_render_them_are_refused():
    """The model would never see them: 400 naming ``tools`` (the template renders nothing else
    with a probe tool than without it); a template that shows them takes them."""
    from tests.helpers.chat_templates import TINY_CHAT_TEMPLATE

    blind = ChatTemplate(TINY_CHAT_TEMPLATE, {"eos_token": "</s>"})
    shows = ChatTemplate("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}" + TINY_CHAT_TEMPLATE,
                         {"eos_token": "</s>"})
    assert not blind.renders_tools and shows.renders_tools
    with pytest.raises(BadRequest) as e:
        template_tools(request(tools=[WEATHER]), blind)
    assert e.value.param == "tools" and "does not render tools" in str(e.value)
    assert template_tools(request(tools=[WEATHER]), shows) == [WEATHER]
    assert template_tools(request(tools=[WEATHER], tool_choice="none"), blind) is None  # nothing to render
