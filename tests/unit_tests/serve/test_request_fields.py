"""docs/SERVING.md's table of request fields names exactly the fields the request models accept,
and a field outside them is a 400 naming it."""
import re
from pathlib import Path

import pytest

from megatron_async.serve.openai_protocol import BadRequest, ChatCompletionRequest, CompletionRequest
from megatron_async.serve.request_input import parse_body

SERVING = Path(__file__).resolve().parents[3] / "docs" / "SERVING.md"


def table_fields() -> set[str]:
    text = SERVING.read_text()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            name = name.split(".")[0].split(" ")[0]
            names.add("guided" + name if name.startswith("_") else name)
    return names


def model_fields() -> set[str]:
    return {f.alias or name for m in (CompletionRequest, ChatCompletionRequest) for name, f in m.model_fields.items()}


def test_the_table_lists_every_accepted_field():
    assert table_fields() == model_fields()


@pytest.mark.parametrize("field", ["use_beam_search", "length_penalty", "truncate_prompt_tokens", "functions", "store"])
def test_other_fields_are_refused_by_name(field):
    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": [
            {"role": "user", "content": "x"}]})):
        with pytest.raises(BadRequest) as e:
            parse_body(model, {**body, field: 1})
        assert e.value.param == field


def test_per_chunk_usage_needs_include_usage():
    """Served with include_usage (every chunk carries usage); without it it would be ignored: 400."""
    body = {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with pytest.raises(BadRequest, match="continuous_usage_stats"):
        parse_body(CompletionRequest, body)
    parse_body(CompletionRequest, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
