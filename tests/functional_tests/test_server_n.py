"""``n`` and ``best_of`` through the real server and the official ``openai`` client: sample i of
a seeded request equals a single request with seed + i, the n samples prefilled their prompt
once (the engine's shared-prompt counter on /metrics grows by the tokens saved), ``best_of``
returns the n samples with the highest cumulative log-prob, best first, and counts every sample
in usage; impossible combinations are 400s naming ``best_of``."""
import re
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402

BS = 16
FLAGS = ["--num-kv-blocks", "200", "--block-size", str(BS), "--max-requests", "8", "--max-sequence-length", "256"]
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(45)]  # two complete blocks a copy may share
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("n") / "tiny-chat",
                                with_tokenizer=True, vocab_size=512)
    save_chat_template(ckpt)
    with ServerProcess(["--model", str(ckpt), *FLAGS]) as srv:
        yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def shared_tokens(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return float(re.search(r"^megatron_async_engine_shared_prompt_tokens\{[^}]*\} (\S+)$", text, re.M).group(1))


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_completions_n_equals_single_requests_and_prefills_once(server):
    srv, client = server
    before = shared_tokens(srv.url)
    res = client.completions.create(model="tiny-chat", prompt=PROMPT, n=4, seed=11, max_tokens=10, temperature=0.9,
                                    extra_body=EXTRA)
    assert shared_tokens(srv.url) - before == 3 * ((len(PROMPT) - 1) // BS * BS)
    got = [ids(c) for c in sorted(res.choices, key=lambda c: c.index)]
    single = [ids(client.completions.create(model="tiny-chat", prompt=PROMPT, seed=11 + i, max_tokens=10,
                                            temperature=0.9, extra_body=EXTRA).choices[0]) for i in range(4)]
    assert got == single and len({tuple(t) for t in got}) > 1
    assert res.usage.completion_tokens == 40


def test_chat_n_equals_single_requests_and_prefills_once(server):
    srv, client = server
    messages = [{"role": "user", "content": "Tell me a long story about rivers, mountains and the sea. " * 3}]
    before = shared_tokens(srv.url)
    res = client.chat.completions.create(model="tiny-chat", messages=messages, n=3, seed=5, max_tokens=8,
                                         extra_body=EXTRA)
    assert shared_tokens(srv.url) - before >= 2 * BS
    got = [ids(c) for c in sorted(res.choices, key=lambda c: c.index)]
    single = [ids(client.chat.completions.create(model="tiny-chat", messages=messages, seed=5 + i, max_tokens=8,
                                                 extra_body=EXTRA).choices[0]) for i in range(3)]
    assert got == single


def test_best_of_returns_the_n_most_likely_samples(server):
    _, client = server
    res = client.completions.create(model="tiny-chat", prompt=PROMPT, n=2, best_of=5, seed=3, max_tokens=6,
                                    temperature=1.0, extra_body=EXTRA)
    candidates = []
    for i in range(5):
        c = client.completions.create(model="tiny-chat", prompt=PROMPT, seed=3 + i, max_tokens=6, temperature=1.0,
                                      logprobs=0, extra_body=EXTRA).choices[0]
        candidates.append((-sum(c.logprobs.token_logprobs), i, ids(c)))
    best = [t for _, _, t in sorted(candidates)[:2]]
    assert [ids(c) for c in res.choices] == best and [c.index for c in res.choices] == [0, 1]
    assert all(c.logprobs is None for c in res.choices)  # not asked for
    assert res.usage.completion_tokens == 5 * 6  # every sample generated counts
    with_lp = client.completions.create(model="tiny-chat", prompt=PROMPT, n=1, best_of=5, seed=3, max_tokens=6,
                                        temperature=1.0, logprobs=1, extra_body=EXTRA).choices
    assert ids(with_lp[0]) == best[0] and len(with_lp[0].logprobs.token_logprobs) == 6


@pytest.mark.parametrize("call, needle", [
    (lambda c: c.completions.create(model="tiny-chat", prompt="x", n=3, best_of=2), "at least n"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="x", best_of=3, stream=True), "streamed"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}],
                                         extra_body={"best_of": 2}), "best_of"),
])
def test_best_of_refusals_name_it(server, call, needle):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        call(client)
    assert needle in str(e.value) and "best_of" in str(e.value)
