"""The real server process (python -m megatron_async.serve) on a tiny checkpoint, driven by the
official ``openai`` client over loopback: completions and chat, streaming and not, concurrent
streams, greedy token ids equal ``LLM.generate``, disconnects abort, bad requests get 400 (servers a
test starts for itself: test_server_own_process.py)."""
import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.server_load import LoadShape, prompt_for, run_load_test  # noqa: E402
from benchmarks.server_metrics import kv_leaked  # noqa: E402
from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.models.chat_template import load_chat_template  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.functional_tests.server_client import concurrent_greedy_streams  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

ENGINE = {"num_kv_blocks": 160, "block_size_tokens": 16, "max_requests": 32, "max_sequence_length": 256}
SERVER_FLAGS = ["--num-kv-blocks", "160", "--block-size", "16", "--max-requests", "32", "--max-sequence-length", "256",
                "--launch-ahead"]  # (serial by default on a CPU: these tests hold launch-ahead through the server)
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("served") / "tiny-chat",
                                with_tokenizer=True, vocab_size=512)
    save_chat_template(path)
    return path


@pytest.fixture(scope="module")
def server(ckpt):
    with ServerProcess(["--model", str(ckpt), *SERVER_FLAGS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), inference_config=InferenceConfig(**ENGINE))


def reference(llm, prompts, num_tokens):
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=num_tokens, ignore_eos=True))
    return [o.generated_tokens for o in outs]


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("" if set(s.labels) <= {"model_name"} else json.dumps(
                {k: v for k, v in s.labels.items() if k != "model_name"}, sort_keys=True))
            values[key] = s.value
    return values


def test_models_health_and_served_name(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"] == [server.model_name]
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        assert r.status == 200


def test_completions_greedy_equal_llm_generate_streamed_or_not(server, client, llm):
    prompts = ["Hello world! How are you", "The quick brown fox", [5, 17, 42, 99, 3]]
    ref = reference(llm, prompts, 12)
    for prompt, want in zip(prompts, ref):
        whole = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, **GREEDY)
        choice = whole.choices[0]
        assert choice.model_extra["token_ids"] == want and choice.finish_reason == "length"
        assert whole.usage.completion_tokens == 12
        ids, text, finishes = [], "", []
        for chunk in client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, stream=True, **GREEDY):
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids") or []
                text += c.text
                finishes += [c.finish_reason] if c.finish_reason else []
        assert ids == want and finishes == ["length"]
        assert text == choice.text  # the streamed deltas add up to the whole answer


def test_echo_and_prompt_logprobs(server, client, llm):
    """echo returns the prompt text before the completion; with logprobs the prompt tokens'
    log-probs (first null) equal the engine's prompt scores; max_tokens 0 scores only; vLLM's
    prompt_logprobs extra comes back in its shape."""
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    (ref,) = llm.generate([ids], SamplingParams(top_k=1, num_tokens_to_generate=4, ignore_eos=True,
                                                return_prompt_log_probs=True))
    scored = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_log_probs, abs=1e-5)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    both = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=4, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 3, "ignore_eos": True}, temperature=0.0)
    choice = both.choices[0]
    assert choice.text == prompt + ref.generated_text and len(choice.logprobs.tokens) == len(ids) + 4
    vllm = choice.model_extra["prompt_logprobs"]
    assert len(vllm) == len(ids) and vllm[0] is None
    for token, lp_ref, entry in zip(ids[1:], ref.prompt_log_probs, vllm[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(lp_ref, abs=1e-5)
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None) == [1, 2, 3]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-chat", prompt=prompt, max_tokens=4, echo=True, stream=True, **GREEDY))
    assert streamed == prompt + ref.generated_text
    for bad in ({"max_tokens": 0}, {"max_tokens": 0, "stream": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-chat", prompt=prompt, **bad)


def sse_chunks(server, body: dict) -> list[dict]:
    """A streamed /v1/completions answer, parsed by hand (fields the client does not know kept)."""
    req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[len(b"data: "):] for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined_logprobs(parts: list) -> dict:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: sum((getattr(p, k) or [] for p in parts if p is not None), []) for k in keys}


def test_streamed_prompt_logprobs_add_up_to_the_whole_answer(server, client):
    """A stream asking for prompt log-probs gets them in the chunk after the prefill: with echo and
    logprobs the streamed chunks' legacy logprobs and text concatenate to the whole answer's
    (prompt entries first, the first null), scoring only (max_tokens 0) too; vLLM's
    prompt_logprobs comes once, in the first chunk, equal to the whole answer's."""
    prompt = "The quick brown fox"
    for extra in ({"max_tokens": 5, "logprobs": 2, "n": 2}, {"max_tokens": 0, "logprobs": 1},
                  {"max_tokens": 3, "logprobs": 0}):
        ask = dict(model="tiny-chat", prompt=prompt, echo=True, temperature=0.0, extra_body={"ignore_eos": True}, **extra)
        wholes = client.completions.create(**ask).choices
        streamed = [c for chunk in client.completions.create(stream=True, **ask) for c in chunk.choices]
        for whole in wholes:
            chunks = [c for c in streamed if c.index == whole.index]
            assert "".join(c.text for c in chunks) == whole.text
            assert chunks[0].logprobs is not None and chunks[0].logprobs.token_logprobs[0] is None
            assert joined_logprobs([c.logprobs for c in chunks]) == joined_logprobs([whole.logprobs])
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1, "prompt_logprobs": 3}
    whole = client.completions.create(**{k: body[k] for k in ("model", "prompt", "max_tokens", "temperature",
                                                                "logprobs")},
                                      extra_body={"ignore_eos": True, "prompt_logprobs": 3}).choices[0]
    chunks = [c["choices"][0] for c in sse_chunks(server, body)]
    carrying = [k for k, c in enumerate(chunks) if "prompt_logprobs" in c]
    assert carrying == [0] and chunks[0]["prompt_logprobs"] == whole.model_extra["prompt_logprobs"]
    streamed = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert all(len(t) == 1 for lp in streamed for t in lp["top_logprobs"])  # logprobs 1, not prompt_logprobs' 3
    assert sum((lp["token_logprobs"] for lp in streamed), []) == whole.logprobs.token_logprobs
    assert "".join(c["text"] for c in chunks) == whole.text


def test_chat_uses_the_checkpoint_template(server, client, llm, ckpt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    prompt = llm.tokenizer.encode(load_chat_template(ckpt).render(messages), add_special_tokens=False)
    want = reference(llm, [prompt], 10)[0]
    whole = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, **GREEDY)
    choice = whole.choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompt and choice.model_extra["token_ids"] == want
    assert choice.message.role == "assistant" and whole.usage.prompt_tokens == len(prompt)
    deltas = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas if d.choices) == choice.message.content
    assert [d.choices[0].finish_reason for d in deltas if d.choices and d.choices[0].finish_reason] == ["length"]
    assert deltas[-1].usage.completion_tokens == 10 and not deltas[-1].choices
    counted = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, stream=True,
                                                  stream_options={"include_usage": True, "continuous_usage_stats": True},
                                                  **GREEDY))  # every chunk: its choice's usage so far
    so_far = [d.usage.completion_tokens for d in counted if d.choices]
    assert so_far == sorted(so_far) and so_far[-1] == 10 and len(so_far) >= 2
    assert {d.usage.prompt_tokens for d in counted} == {len(prompt)}


def test_concurrent_streams_keep_launch_ahead_beside_bad_requests(server, llm):
    n = 20
    prompts = [prompt_for(i, 6 + i % 5) for i in range(n)]
    ref = reference(llm, prompts, 16)
    before = metrics(server)
    bad = ({"prompt": "word " * 300, "max_tokens": 4}, {"prompt": [1, 99999], "max_tokens": 4},
           {"prompt": "hi", "max_tokens": 4, "extra_body": {"top_k": True}})
    assert concurrent_greedy_streams(server.url, "tiny-chat", prompts, 16, bad) == ref  # unchanged by the 400s
    after = metrics(server)
    decode = after["megatron_async_engine_decode_steps"] - before["megatron_async_engine_decode_steps"]
    overlapped = (after["megatron_async_engine_overlapped_decode_steps"]
                  - before["megatron_async_engine_overlapped_decode_steps"])
    assert decode >= 15 and overlapped >= 0.5 * decode  # requests joining between steps kept launch-ahead on


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client):
    abort_key = 'megatron_async_request_success_total{"finished_reason": "abort"}'
    aborted = metrics(server).get(abort_key, 0.0)
    stream = client.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=240, stream=True,
                                       **GREEDY)
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].model_extra.get("token_ids") or [])
        if got >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while True:
        m = metrics(server)
        done = (m.get(abort_key, 0.0) == aborted + 1
                and m["megatron_async_num_requests_running"] == 0 and m["megatron_async_kv_cache_usage_perc"] == 0)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert done, m
    assert m["megatron_async_generation_tokens_total"] < 1000  # it did not run its 240 tokens to the end


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server):
    import socket
    from urllib.parse import urlparse

    abort_key = 'megatron_async_request_success_total{"finished_reason": "abort"}'
    aborted = metrics(server).get(abort_key, 0.0)
    body = json.dumps({"model": "tiny-chat", "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True})
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 20
        while metrics(server)["megatron_async_num_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # close only once it runs (closing earlier is no work at all: no abort)
        sock.shutdown(socket.SHUT_RDWR)  # FIN now, even if a forked process holds a copy of the fd
    deadline = time.monotonic() + 20
    while metrics(server).get(abort_key, 0.0) < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = metrics(server)
    assert m.get(abort_key, 0.0) == aborted + 1 and m["megatron_async_num_requests_running"] == 0


def test_bad_requests_get_400_and_the_server_keeps_serving(server, client):
    bad = [
        dict(prompt="hi", max_tokens=4, extra_body={"temperature": "0.5"}),  # wrong type
        dict(prompt="hi", max_tokens=4, extra_body={"no_such_field": 1}),  # unknown field
        dict(prompt="hi", max_tokens=True),  # bool is not an int
        dict(prompt="word " * 300, max_tokens=4),  # too long for max_sequence_length 256
        dict(prompt=[1, 2, 100000], max_tokens=4),  # token id outside the vocab
        dict(prompt="hi", max_tokens=4, logit_bias={"5": 101.0}),  # beyond [-100, 100]
        dict(prompt="hi", max_tokens=4, top_p=0.0),  # OpenAI range (0, 1]
        dict(prompt="hi", max_tokens=4, n=0),
        dict(prompt="hi", max_tokens=4, logprobs=21, stream=True),  # more than OpenAI's 20
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-chat", **kwargs)
        assert e.value.status_code == 400 and e.value.message
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "wizard", "content": "hi"}])
    req = urllib.request.Request(f"{server.url}/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    ok = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=3, **GREEDY)
    assert len(ok.choices[0].model_extra["token_ids"]) == 3


def test_sampling_options_n_seed_stop_logprobs(server, client, llm):
    kw = dict(model="tiny-chat", prompt="The quick brown fox", max_tokens=8, temperature=1.0, seed=7, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    greedy = client.completions.create(model="tiny-chat", prompt="The quick brown fox", max_tokens=12, **GREEDY)
    text = greedy.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    cut = client.completions.create(model="tiny-chat", prompt="The quick brown fox", max_tokens=12, stop=[stop],
                                    temperature=0.0)
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)
    lp = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=4, logprobs=2, **GREEDY)
    logprobs = lp.choices[0].logprobs
    # top entries are keyed by token text: two byte-fragment tokens can share one ("\ufffd")
    assert len(logprobs.token_logprobs) == 4 and all(1 <= len(t) <= 2 for t in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)


def test_streamed_logprobs_equal_whole_answer_logprobs(client):
    """Completions and chat, sampled with a seed and a stop string that never matches (text is
    held back while tokens stream): per-chunk log-prob entries concatenate to the whole answer's."""
    kw = dict(model="tiny-chat", max_tokens=12, temperature=0.8, seed=3, stop=["never in the text"],
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(prompt="The quick brown fox", logprobs=3, **kw).choices[0]
    tokens, lps, tops, offsets, ids = [], [], [], [], []
    for chunk in client.completions.create(prompt="The quick brown fox", logprobs=3, stream=True, **kw):
        for c in chunk.choices:
            ids += c.model_extra.get("token_ids") or []
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    want = whole.logprobs
    assert ids == whole.model_extra["token_ids"] and len(lps) == 12
    assert (tokens, lps, tops, offsets) == (want.tokens, want.token_logprobs, want.top_logprobs, want.text_offset)
    assert any(len(t) == 3 for t in tops) and all(lp <= 0 for lp in lps)

    messages = [{"role": "user", "content": "Hello world!"}]
    ckw = dict(kw, messages=messages, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ckw).choices[0]
    entries = []
    for chunk in client.chat.completions.create(stream=True, **ckw):
        for c in chunk.choices:
            if c.logprobs is not None:
                entries += c.logprobs.content
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in whole.logprobs.content]
    assert len(entries) == 12 and all(len(e.top_logprobs) == 2 for e in entries)
    plain = client.chat.completions.create(stream=True, **{**ckw, "logprobs": False, "top_logprobs": None})
    assert all(c.logprobs is None for chunk in plain for c in chunk.choices)


def test_metrics_parse_as_prometheus_text(server):
    m = metrics(server)
    for name in ("megatron_async_num_requests_running", "megatron_async_num_requests_waiting",
                 "megatron_async_kv_cache_usage_perc", "megatron_async_time_to_first_token_seconds_count",
                 "megatron_async_inter_token_latency_seconds_count", "megatron_async_prompt_tokens_total",
                 "megatron_async_generation_tokens_total", "megatron_async_overlap_ratio"):
        assert name in m, name
    assert m["megatron_async_time_to_first_token_seconds_count"] > 0 and 0 < m["megatron_async_overlap_ratio"] <= 1


def test_small_load_test_loses_and_duplicates_nothing(server):
    report = asyncio.run(run_load_test(server.url, "tiny-chat", clients=24, requests=72, work=LoadShape(max_tokens=8)))
    assert report.ok, report.format()
    assert report.completed == 72 and report.output_tokens == 72 * 8
    assert report.ttft_p50_ms is not None and report.itl_p99_ms is not None


def _finished(server, reason: str) -> float:
    return metrics(server).get(f'megatron_async_request_success_total{{"finished_reason": "{reason}"}}', 0.0)


def test_load_with_disconnects_and_long_prompts_frees_every_block(server):
    """The CPU load test: 16 streams, 100 requests, 10 % leaving mid-stream, every 7th with a
    prompt near the longest the server takes; nothing lost, and afterwards no request or KV
    block is left in the engine. The requests that leave ask for 230 tokens and leave after 3:
    each ends as an abort (the server's counters say so), not by running to its length."""
    shape = LoadShape(max_tokens=9, prompt_words=16, token_prompts=True, disconnect_fraction=0.1,
                      long_prompt_every=7, long_prompt_words=240, disconnect_max_tokens=230)
    assert not any(shape.disconnects(i) and i % 7 == 6 for i in range(100))  # 16 + 230 tokens fit in 256
    aborts, lengths = _finished(server, "abort"), _finished(server, "length")
    report = asyncio.run(run_load_test(server.url, "tiny-chat", clients=16, requests=100, work=shape))
    report.kv_leaked = kv_leaked(server.url, settle_s=10)
    assert report.disconnected == sum(shape.disconnects(i) for i in range(100)) == 10, report.format()
    assert report.ok and report.completed == 90, report.format()
    assert _finished(server, "abort") - aborts == 10 and _finished(server, "length") - lengths == 90


@pytest.mark.parametrize("field, value", [("min_tokens", 6), ("min_p", 0.3), ("presence_penalty", 1.5),
                                          ("frequency_penalty", 1.5), ("repetition_penalty", 1.8)])
def test_vllm_sampling_fields_reach_the_engine(client, llm, field, value):
    """The field through HTTP == LLM.generate with the same SamplingParams field, and the field
    changed the answer: penalties change a greedy one; min_p a seeded draw (greedy keeps the top
    token whatever min_p is); min_tokens holds back a stop string the answer would stop on at once."""
    prompt = "The quick brown fox jumps over the lazy dog"
    base = dict(temperature=0.0, num_tokens_to_generate=10, ignore_eos=True)
    if field == "min_p":
        base.update(temperature=1.0, seed=7)
    if field == "min_tokens":  # the answer's first character stops it within its first tokens
        base["stop_words"] = [llm.generate([prompt], SamplingParams(**base))[0].generated_text.strip()[0]]
    without = llm.generate([prompt], SamplingParams(**base))[0].generated_tokens
    want = llm.generate([prompt], SamplingParams(**base, **{field: value}))[0].generated_tokens
    got = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=10, temperature=base["temperature"],
                                    seed=base.get("seed"), stop=base.get("stop_words"),
                                    extra_body={field: value, "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want
    assert want != without  # the field really changed the answer
    if field == "min_tokens":
        assert len(without) < value <= len(want)
