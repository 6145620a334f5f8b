"""LoRA adapters through the real server process (python -m megatron_async.serve --lora-modules,
one HTTP front-end process): a completion whose ``model`` names an adapter carries the offline
engine's greedy tokens with that adapter, the base model's name its own; /v1/models lists the
adapters under their parent; chat (streamed) and /tokenize take an adapter's name, an unknown
name is a 404 (OpenAI's error object, ``param`` "model"); /v1/load_lora_adapter and /v1/unload_lora_adapter run while
another request streams (which ends with its own tokens), behind the admin key and
--allowed-weights-dir, with 400 / 403 / 404 / 409 for what they refuse; a bad --lora-modules
stops the start with exit status 2."""
import asyncio
import http.client
import json
import subprocess
import sys
from urllib.parse import urlparse

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)

from megatron_async import SamplingParams  # noqa: E402
from megatron_async.serve.process import ServerProcess  # noqa: E402
from tests.helpers.chat_templates import save_chat_template  # noqa: E402
from tests.helpers.engine_harness import make_llm  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.lora_adapters import make_peft_adapter  # noqa: E402

ADMIN = "sk-test-admin-lora-31c8"
PROMPTS = [[5, 9, 17, 33, 2, 71], [40, 41, 42, 8]]
NEW, LONG = 8, 120
ENGINE = dict(max_loras=3, max_lora_rank=8, max_requests=4, num_kv_blocks=128, max_sequence_length=256)
FLAGS = ["--max-requests", "4", "--num-kv-blocks", "128", "--max-sequence-length", "256", "--max-loras", "3",
         "--max-lora-rank", "8", "--log-level", "info"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base", with_tokenizer=True)
    save_chat_template(base)
    allowed = root / "adapters"
    paths = {"x": make_peft_adapter(base, allowed / "x", 8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"], seed=1),
             "y": make_peft_adapter(base, allowed / "y", 4, 8, ["k_proj", "gate_proj", "up_proj"], seed=2),
             "big": make_peft_adapter(base, allowed / "big", 16, 16, ["q_proj"], seed=3),
             "outside": make_peft_adapter(base, root / "outside", 4, 8, ["q_proj"], seed=4)}
    (allowed / "empty").mkdir()
    llm = make_llm(base, enable_lora=True, **ENGINE)
    for name in ("x", "y"):
        llm.load_lora(name, paths[name])
    expected = {}
    for name, new in ((None, NEW), ("x", NEW), ("y", NEW), ("x", LONG)):
        params = SamplingParams(top_k=1, num_tokens_to_generate=new, ignore_eos=True, lora=name)
        expected[name, new] = [o.generated_tokens for o in llm.generate(PROMPTS, params)]
    llm.close()
    return base, allowed, paths, expected


@pytest.fixture(scope="module")
def server(files):
    base, allowed, paths, _ = files
    with ServerProcess(["--model", str(base), *FLAGS, "--lora-modules", f"x={paths['x']}", "--enable-admin-endpoints",
                        "--admin-api-key", ADMIN, "--allowed-weights-dir", str(allowed)]) as srv:
        yield srv


def _client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(client, model: str, prompt: list[int], new: int = NEW) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


def _post(srv, path: str, body, key: str | None = ADMIN) -> tuple[int, dict]:
    u = urlparse(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {key}"} if key else {})})
    res = conn.getresponse()
    status, data = res.status, res.read()
    conn.close()
    return status, json.loads(data) if data else {}


def test_adapter_and_base_tokens_equal_the_offline_engine(server, files):
    expected = files[3]
    assert expected["x", NEW] != expected[None, NEW]  # the comparison below tests something
    client = _client(server)
    for i, prompt in enumerate(PROMPTS):
        assert _greedy(client, "x", prompt) == expected["x", NEW][i]
        assert _greedy(client, server.model_name, prompt) == expected[None, NEW][i]
    cards = {m.id: m for m in client.models.list()}
    assert set(cards) >= {server.model_name, "x"}
    assert cards["x"].model_extra["parent"] == server.model_name


def test_chat_stream_and_tokenize_take_an_adapter(server):
    client = _client(server)
    chunks = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=6, temperature=0.0, stream=True))
    assert chunks and all(c.model == "x" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    status, body = _post(server, "/tokenize", {"model": "x", "prompt": "hello"}, key=None)
    assert status == 200 and body["count"] > 0


def test_unknown_model_is_a_404(server):
    client = _client(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == 404 and e.value.body["param"] == "model"
    assert "'x'" in e.value.body["message"]  # the adapters loaded now are named
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    status, body = _post(server, "/tokenize", {"model": "nope", "prompt": "hi"}, key=None)
    assert status == 404 and body["error"]["param"] == "model"


def test_load_and_unload_while_a_request_streams(server, files):
    _, allowed, paths, expected = files

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = await client.completions.create(model="x", prompt=PROMPTS[0], max_tokens=LONG, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        tokens, answers = [], {}
        async for chunk in stream:
            tokens += chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
            if len(tokens) >= 4 and not answers:  # mid-stream, from another thread (blocking calls)
                answers["load"] = await asyncio.to_thread(
                    _post, server, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(paths["y"])})
                answers["busy"] = await asyncio.to_thread(
                    _post, server, "/v1/unload_lora_adapter", {"lora_name": "x"})
                answers["y"] = await asyncio.to_thread(_greedy, _client(server), "y", PROMPTS[1])
        await client.close()
        return tokens, answers

    tokens, answers = asyncio.run(main())
    assert tokens == expected["x", LONG][0]  # the stream ended with its own tokens
    assert answers["load"][0] == 200, answers["load"]
    status, body = answers["busy"]
    assert status == 409 and "in use" in body["error"]["message"]
    assert answers["y"] == expected["y", NEW][1]
    assert {m.id for m in _client(server).models.list()} >= {"x", "y"}
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "x"})[0] == 200
    status, body = _post(server, "/v1/unload_lora_adapter", {"lora_name": "x"})
    assert status == 404 and "no LoRA adapter 'x'" in body["error"]["message"]
    assert "x" not in {m.id for m in _client(server).models.list()}
    with pytest.raises(openai.NotFoundError):
        _greedy(_client(server), "x", PROMPTS[0])
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(paths["x"])})[0] == 200
    assert _greedy(_client(server), "x", PROMPTS[1]) == expected["x", NEW][1]


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/load_lora_adapter", {"lora_path": "P"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "z"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "P", "extra": 1}, 400, "unknown field"),
    ("/v1/load_lora_adapter", b"[1, 2]", 400, "JSON object"),
    ("/v1/unload_lora_adapter", {"lora_name": 3}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "big"}, 400, "max_lora_rank"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "empty"}, 400, "adapter_config.json"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "missing"}, 400, "not a checkpoint directory"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "outside"}, 403, "--allowed-weights-dir"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "y/../../outside"}, 403, "--allowed-weights-dir"),
    ("/v1/unload_lora_adapter", {"lora_name": "never"}, 404, "no LoRA adapter"),
    ("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "y", "engines": [0]}, 400, "coordinator"),
    ("/update_lora_from_ipc", {"lora_name": "x"}, 400, "handles"),
    ("/update_lora_from_distributed", {"lora_name": "x", "manifest": {}}, 400, "no weight transfer group"),
    ("/update_lora_from_distributed", {"manifest": {}}, 400, "lora_name"),
])
def test_refusals(server, files, path, body, status, words):
    _, allowed, paths, _ = files
    if isinstance(body, dict) and isinstance(body.get("lora_path"), str) and body["lora_path"] != "P":
        where = paths["outside"] if body["lora_path"] == "outside" else allowed / body["lora_path"]
        body = {**body, "lora_path": str(where)}
    got, answer = _post(server, path, body)
    assert got == status and words in answer["error"]["message"], answer
    assert "z" not in {m.id for m in _client(server).models.list()}


def test_admin_key_guards_the_adapter_routes(server, files):
    body = {"lora_name": "z", "lora_path": str(files[2]["y"])}
    for key in (None, "sk-wrong"):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert _post(server, path, body if "load_" in path else {"lora_name": "x"}, key=key)[0] == 401
    assert {m.id for m in _client(server).models.list()} >= {"x"}


def test_bad_lora_modules_stop_the_start(files):
    base, allowed, paths, _ = files
    for module, words in ((f"z={allowed / 'missing'}", "is not a directory"),
                          (f"z={paths['big']}", "max_lora_rank"), ("z", "NAME=PATH")):
        proc = subprocess.run([sys.executable, "-m", "megatron_async.serve", "--model", str(base), *FLAGS,
                               "--port", "0", "--lora-modules", module], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert "serving" not in proc.stdout
