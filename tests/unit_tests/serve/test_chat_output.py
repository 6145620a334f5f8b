"""Reasoning and tool-call parsing of chat answers (serve/chat_output.py): exact messages for known answers, and for random answers cut at
random points, the streamed deltas add up to the non-streamed message."""
import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_async.serve.chat_output import ChatOutputFormat, TagStream, parse_call, starts_inside

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
BOTH = ChatOutputFormat("qwen3", "hermes")


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def message(fmt: ChatOutputFormat, text: str, reason: str = "stop"):
    return fmt.message(text, reason, new_id=ids())


def streamed(fmt: ChatOutputFormat, parts: list[str], reason: str = "stop"):
    """The deltas of ``parts`` merged as a client merges them, in the message's shape."""
    s = fmt.stream(new_id=ids())
    deltas = [d for p in parts for d in s.feed(p)] + s.finish()
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls and c["function"]["arguments"] == ""  # name first, then arguments
                calls[c["index"]] = {"id": c["id"], "type": c["type"], "function": dict(c["function"])}
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
        if "tool_calls" in d:
            assert set(d) == {"tool_calls"}
    assert sorted(calls) == list(range(len(calls)))
    msg = {"role": "assistant", "content": content}
    if fmt.reasoning_parser:
        msg["reasoning_content"] = reasoning or None
    if calls:
        msg["tool_calls"] = [calls[i] for i in range(len(calls))]
    if reasoning or calls:
        msg["content"] = content or None
    return msg, s.finish_reason(reason)


def test_tool_calls_are_parsed_out_of_the_content():
    text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{\"name\": \"now\"}}</tool_call>"
    msg, reason = message(ChatOutputFormat(tool_call_parser="hermes"), text)
    assert reason == "tool_calls"
    assert msg == {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "°C"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
    only_call, _ = message(ChatOutputFormat(tool_call_parser="hermes"), f"<tool_call>{CALL}</tool_call>")
    assert only_call["content"] is None


def test_malformed_or_unfinished_calls_stay_content():
    fmt = ChatOutputFormat(tool_call_parser="hermes")
    for text in ['<tool_call>{"name": oops}</tool_call>', '<tool_call>["a"]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
                 '<tool_call>' + "[" * 100_000 + '</tool_call>']:
        msg, reason = message(fmt, text)
        assert msg == {"role": "assistant", "content": text} and reason == "stop"
    msg, reason = message(fmt, '<tool_call>{"name": "f", "argu', "length")
    assert msg["content"] == '<tool_call>{"name": "f", "argu' and reason == "length"


def test_without_parsers_the_text_is_untouched():
    text = f"  <think>x</think>\n<tool_call>{CALL}</tool_call>\n "
    assert message(ChatOutputFormat(), text) == ({"role": "assistant", "content": text}, "stop")
    assert streamed(ChatOutputFormat(), [text[:5], text[5:]]) == ({"role": "assistant", "content": text}, "stop")


def test_reasoning_section_is_split_off():
    fmt = ChatOutputFormat(reasoning_parser="qwen3")
    msg, _ = message(fmt, "<think>\nThe user greets.\n</think>\n\nHello!")
    assert msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets."}
    plain, _ = message(fmt, "Hello!")  # thinking off: no section
    assert plain == {"role": "assistant", "content": "Hello!", "reasoning_content": None}
    cut, _ = message(fmt, "<think>still thinking", "length")
    assert cut == {"role": "assistant", "content": None, "reasoning_content": "still thinking"}


def test_reasoning_streams_as_it_comes():
    """Reasoning text goes out with the feed that brought it, not held until its section ends."""
    s = ChatOutputFormat(reasoning_parser="qwen3").stream()
    first, second = s.feed("<think>\nThe user"), s.feed(" greets.")
    assert "".join(d.get("reasoning_content", "") for d in first) == "The user"
    assert "".join(d.get("reasoning_content", "") for d in second) == " greets."


def test_reasoning_opened_by_the_prompt():
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert starts_inside(prompt) and not starts_inside("<think>\n\n</think>\n\n")
    msg, _ = message(ChatOutputFormat("qwen3", prompt=prompt), "The user greets.\n</think>\n\nHello!")
    assert msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets."}


def test_reasoning_then_a_tool_call():
    text = f"<think>I need the weather.</think>\n<tool_call>\n{CALL}\n</tool_call>"
    msg, reason = message(BOTH, text)
    assert reason == "tool_calls" and msg["content"] is None and msg["reasoning_content"] == "I need the weather."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    inner, _ = message(BOTH, f"<think><tool_call>{CALL}</tool_call></think>ok")  # calls inside reasoning: not calls
    assert "tool_calls" not in inner and inner["content"] == "ok"


def test_parse_call_shape():
    call = parse_call('{"name": "f", "arguments": {"a": [1, 2]}}', "call_x")
    assert call == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
    assert json.loads(call["function"]["arguments"]) == {"a": [1, 2]}


def test_tag_split_across_deltas_is_held_back():
    s = TagStream("<tool_call>", "</tool_call>")
    assert s.feed("Hi <tool") == [("outside", "Hi")]
    assert s.feed("_ca") == []
    assert s.feed("ll>{}</tool_c") == [("open", ""), ("inside", "{}")]
    assert s.feed("all> bye <to") == [("close", ""), ("outside", "bye")]
    assert s.finish() == [("outside", " <to")]


PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", CALL, '{"name": "now"}', '{"name": 1}', "Hello",
          " world", "\n", "  ", "<", "</", "<tool", "_call>", "think>", "é", "{", "}", "<think", "</tool_call"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=14), cuts=st.lists(st.integers(0, 400), max_size=8),
       fmt=st.sampled_from([BOTH, ChatOutputFormat("qwen3"), ChatOutputFormat(tool_call_parser="hermes"),
                            ChatOutputFormat("qwen3", "hermes", prompt="assistant\n<think>\n"), ChatOutputFormat()]),
       reason=st.sampled_from(["stop", "length"]))
def test_streamed_deltas_add_up_to_the_whole_message(pieces, cuts, fmt, reason):
    text = "".join(pieces)
    points = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert streamed(fmt, parts, reason) == message(fmt, text, reason)


TEXT = st.lists(st.sampled_from(["Hello", " world", "é", "<", "{", "a < b", "x>", "\n"]), min_size=1, max_size=5).map("".join)


@settings(max_examples=200, deadline=None)
@given(reasoning=TEXT, content=TEXT, names=st.lists(st.sampled_from(["f", "get_weather"]), max_size=3),
       cuts=st.lists(st.integers(0, 400), max_size=10))
def test_well_formed_answers_stream_exactly(reasoning, content, names, cuts):
    text = f"<think>\n{reasoning}\n</think>\n\n{content}\n" + "".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {{"i": {i}}}}}\n</tool_call>\n' for i, n in enumerate(names))
    points = sorted({min(c, len(text)) for c in cuts})
    parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    msg, reason = streamed(BOTH, parts)
    assert msg["reasoning_content"] == (reasoning.strip() or None)
    answer = content.strip() if names else (content + "\n").lstrip()  # whitespace touching a tag is dropped
    assert msg["content"] == ((answer or None) if names or reasoning.strip() else answer)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])] == \
        [(n, {"i": i}) for i, n in enumerate(names)]
    assert reason == ("tool_calls" if names else "stop")


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    two = f"<tool_call>{CALL}</tool_call>\n<tool_call>{CALL.replace('Paris', 'Oslo')}</tool_call>"
    fmt = ChatOutputFormat(None, "hermes")
    msg, reason = message(fmt, two)
    assert len(msg["tool_calls"]) == 2 and reason == "tool_calls"
    one = ChatOutputFormat(None, "hermes", max_tool_calls=1)
    msg, reason = message(one, two)
    assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == ["Paris"]
    assert reason == "tool_calls" and msg["content"] is None
    assert streamed(one, [two[:30], two[30:95], two[95:]]) == (msg, reason)  # the stream drops it too
