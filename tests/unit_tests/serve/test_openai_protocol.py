"""OpenAI request bodies: strict parsing (wrong types, unknown fields are BadRequest) and the
mapping to SamplingParams."""
import pytest

pytest.importorskip("pydantic")

from megatron_async.serve.completion_routes import completion_plan, completion_prompts  # noqa: E402
from megatron_async.serve.openai_protocol import BadRequest, ChatCompletionRequest, CompletionRequest  # noqa: E402
from megatron_async.serve.request_input import parse_body  # noqa: E402
from megatron_async.serve.sampling_fields import choice_params, sampling_params  # noqa: E402


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "stop": [5]}, "stop"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({}, "prompt"),
])
def test_bad_bodies_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        parse_body(CompletionRequest, body)
    assert e.value.param == param and param in str(e.value)


def test_body_must_be_an_object():
    with pytest.raises(BadRequest, match="JSON object"):
        parse_body(CompletionRequest, [1, 2])


def test_prompt_forms():
    assert completion_prompts(parse_body(CompletionRequest, {"prompt": "hi"})) == ["hi"]
    assert completion_prompts(parse_body(CompletionRequest, {"prompt": [1, 2]})) == [[1, 2]]
    assert completion_prompts(parse_body(CompletionRequest, {"prompt": [[1], [2, 3]]})) == [[1], [2, 3]]
    assert completion_prompts(parse_body(CompletionRequest, {"prompt": ["a", "b"]})) == ["a", "b"]
    with pytest.raises(BadRequest):
        completion_prompts(parse_body(CompletionRequest, {"prompt": []}))


def test_sampling_mapping_uses_engine_conventions():
    req = parse_body(CompletionRequest, {"prompt": "x", "top_p": 1.0, "top_k": -1, "stop": "END", "seed": 3,
                                         "ignore_eos": True})
    sp = sampling_params(req, max_tokens=7, logprobs=None)
    assert (sp.top_p, sp.top_k, sp.stop_words, sp.seed, sp.ignore_eos) == (0.0, 0, ["END"], 3, True)
    assert sp.num_tokens_to_generate == 7 and sp.temperature == 1.0 and not sp.return_log_probs
    sp = sampling_params(parse_body(CompletionRequest, {"prompt": "x", "top_p": 0.9, "temperature": 0}), 4, 2)
    assert sp.top_p == 0.9 and sp.is_greedy and sp.return_log_probs and sp.top_n_logprobs == 2
    sp = sampling_params(parse_body(CompletionRequest, {
        "prompt": "x", "min_p": 0.1, "min_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.3, "skip_special_tokens": False, "include_stop_str_in_output": True}), 4, None)
    assert (sp.min_p, sp.min_tokens, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (
        0.1, 2, 0.5, -0.5, 1.3)
    assert not sp.skip_special_tokens and sp.include_stop_str_in_output
    sp = sampling_params(parse_body(CompletionRequest, {"prompt": "x", "logit_bias": {"1": 2.0}, "allowed_token_ids": [1, 2],
                                                        "bad_words": ["no"]}), 4, None)
    assert (sp.logit_bias, sp.allowed_token_ids, sp.bad_words) == ({1: 2.0}, [1, 2], ["no"])
    with pytest.raises(BadRequest, match="logit_bias"):
        sampling_params(parse_body(CompletionRequest, {"prompt": "x", "logit_bias": {"a": 2.0}}), 4, None)
    with pytest.raises(BadRequest, match="stop"):
        sampling_params(parse_body(CompletionRequest, {"prompt": "x", "stop": [""]}), 4, None)
    with pytest.raises(BadRequest, match="suffix"):
        completion_plan(parse_body(CompletionRequest, {"prompt": "x", "suffix": "s"}))


def test_chat_messages():
    req = parse_body(ChatCompletionRequest, {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert [m.as_template_message() for m in req.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    for bad in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}):
        with pytest.raises(BadRequest):
            parse_body(ChatCompletionRequest, bad)


def test_echo_options():
    """max_tokens 0 scores the prompt (echo or prompt_logprobs), streamed or not; alone it is refused."""
    from megatron_async.serve.completion_routes import check_echo_options, prompt_top_n

    def parsed(**body):
        return parse_body(CompletionRequest, {"prompt": "x", **body})

    for bad, param in (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "stream": True}, "max_tokens")):
        with pytest.raises(BadRequest) as e:
            check_echo_options(parsed(**bad))
        assert e.value.param == param
    check_echo_options(parsed(max_tokens=0, echo=True))
    for good in ({"stream": True, "echo": True}, {"stream": True, "prompt_logprobs": 1},
                 {"stream": True, "echo": True, "logprobs": 1, "max_tokens": 0}):
        check_echo_options(parsed(**good))
    req = parsed(max_tokens=3, echo=True, logprobs=1, prompt_logprobs=4)
    sp = choice_params(req, 3, 1, 0, prompt_top_n=prompt_top_n(req))
    assert sp.return_prompt_log_probs and sp.top_n_logprobs == 4
    req = parsed(echo=True)
    assert not choice_params(req, 3, None, 0, prompt_top_n=prompt_top_n(req)).return_prompt_log_probs


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed with stream"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, "needs include_usage"),
])
def test_stream_options_that_would_be_ignored_are_refused(body, message):
    with pytest.raises(BadRequest) as e:
        parse_body(CompletionRequest, body)
    assert e.value.param == "stream_options" and message in str(e.value)


def test_every_chunk_can_carry_its_usage():
    """continuous_usage_stats: a body, a template's JSON text and a list of bodies each get it."""
    import json

    from megatron_async.serve import responses as resp

    counts = resp.usage(5, 2)
    template = resp.chunk_template({"id": "c", "choices": [{"index": 0, "text": resp.TEXT_SLOT}]})
    assert json.loads(resp.with_usage(template("hi"), counts)) == {"id": "c", "choices": [{"index": 0, "text": "hi"}],
                                                                    "usage": counts}
    assert resp.with_usage({"a": 1}, counts) == {"a": 1, "usage": counts}
    assert resp.with_usage([{"a": 1}, {"b": 2}], counts) == [{"a": 1, "usage": counts}, {"b": 2, "usage": counts}]
