"""Response bodies: a stream chunk built from its precomputed JSON template is byte for byte the
chunk ``json.dumps`` writes from the whole body."""
import json

import pytest

from megatron_async.serve import responses as resp
from megatron_async.serve.chat_routes import chat_chunk_choice
from megatron_async.serve.completion_routes import completion_chunk_choice


@pytest.mark.parametrize("text", ["", " hello", 'a "quoted" \\ back\nslash', "日本語 ✓", "\x00\x1f", resp.TEXT_SLOT,
                                  "\ufffd", "}, {"])
def test_json_template_equals_json_dumps(text):
    head = resp.ResponseHead("text_completion", "m", resp.new_id("cmpl"))
    for i in (0, 3):
        template = resp.JsonTemplate(head.body([completion_chunk_choice(i, resp.TEXT_SLOT, None, None)]))
        whole = head.body([completion_chunk_choice(i, text, None, None)])
        assert template(text) == json.dumps(whole, ensure_ascii=False)
        assert resp.sse(template(text)) == resp.sse(whole)


@pytest.mark.parametrize("text", ["", " hi", 'q"\\', "日本"])
def test_json_template_with_token_ids_equals_json_dumps(text):
    head = resp.ResponseHead("chat.completion.chunk", "m", resp.new_id("chatcmpl"))
    slots = (resp.TEXT_SLOT, resp.TOKENS_SLOT)
    for tokens in ([], [5], [1, 2, 3]):
        completion = resp.JsonTemplate(head.body([completion_chunk_choice(1, resp.TEXT_SLOT, None,
                                                                                resp.TOKENS_SLOT)]), slots)
        assert completion(text, tokens) == json.dumps(head.body([completion_chunk_choice(1, text, None, tokens)]),
                                                      ensure_ascii=False)
        chat = resp.JsonTemplate(head.body([chat_chunk_choice(0, {"content": resp.TEXT_SLOT}, None,
                                                                   resp.TOKENS_SLOT)]), slots)
        assert chat(text, tokens) == json.dumps(head.body([chat_chunk_choice(0, {"content": text}, None, tokens)]),
                                                ensure_ascii=False)
