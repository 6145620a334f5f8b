"""A request to a server whose engine is suspended (POST /suspend, no pause): 503 with an OpenAI
error object saying so, through the official ``openai`` client, streamed or not, served
in-process and by front-end processes (both routes share ``responses.respond``); no traceback in
the log. Under
a pause ("keep") a request waits instead and ends, once resumed, with the tokens it gets from
an engine that was never suspended; the server keeps serving."""
import asyncio
import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from megatron_async.serve.process import ServerProcess  # noqa: E402

FLAGS = ["--default-model", "tiny", "--device", "cpu", "--max-requests", "4", "--num-kv-blocks", "64",
         "--enable-admin-endpoints", "--enable-suspend"]
PROMPT = [5, 6, 7, 8]


def admin(url: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())


def assert_suspended_503(client, model: str) -> None:
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=stream)
        err = e.value
        assert err.status_code == 503, err
        assert err.body["code"] == 503 and err.body["type"] == "server_error"
        assert err.body["message"].startswith("the engine cannot generate now: cannot generate while ['kv_cache', "
                                              "'weights'] are suspended")


@pytest.mark.parametrize("servers", ["1", "2"], ids=["in-process", "front-ends"])
def test_suspended_engine_answers_503_and_a_paused_one_queues(servers):
    with ServerProcess([*FLAGS, "--api-server-count", servers]) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = srv.model_name

        def greedy() -> str:
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text

        want = greedy()
        assert admin(srv.url, "/suspend")["suspended"] == ["kv_cache", "weights"]
        assert_suspended_503(client, model)
        assert urllib.request.urlopen(srv.url + "/health", timeout=30).status == 200

        async def paused_request_waits_for_the_resume():
            assert admin(srv.url, "/pause_generation", {"mode": "keep"})["paused"]
            aclient = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
            try:
                waiting = asyncio.ensure_future(aclient.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                                                           temperature=0))
                await asyncio.sleep(1.0)
                assert not waiting.done()  # queued: the engine is paused and suspended
                await asyncio.to_thread(admin, srv.url, "/resume")
                await asyncio.sleep(0.5)
                assert not waiting.done()  # still paused
                await asyncio.to_thread(admin, srv.url, "/resume_generation")
                return (await asyncio.wait_for(waiting, 60)).choices[0].text
            finally:
                await aclient.close()

        assert asyncio.run(paused_request_waits_for_the_resume()) == want
        assert greedy() == want  # and it keeps serving
        output = srv.output()
    assert "Traceback" not in output and "engine step failed" not in output
