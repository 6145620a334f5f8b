"""The server's admin endpoints, through the ASGI app in process: absent (404) without
--enable-admin-endpoints; with it an RL driver pauses a running request, suspends, resumes the
weights, updates them from a checkpoint directory, resumes the KV cache and generation, and the
request ends with the tokens of an uninterrupted run; wrong orders are 409s, bad bodies 400s."""
import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from megatron_async import LLM, InferenceConfig, SamplingParams  # noqa: E402
from megatron_async.cli.flags import inference_config_from_args  # noqa: E402
from megatron_async.serve.__main__ import build_parser, build_state  # noqa: E402
from megatron_async.serve.app import create_app  # noqa: E402
from megatron_async.serve.submission import Choice, Submission  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.asgi_call import post  # noqa: E402

CONFIG = dict(max_sequence_length=64, num_kv_blocks=64, max_requests=4, max_tokens=32, enable_suspend=True)
PROMPT, PARAMS = [3, 4, 5, 6, 7], SamplingParams(top_k=1, num_tokens_to_generate=40, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path_factory.mktemp("admin") / "qwen3", seed=0)


def _server(ckpt, *flags):
    args = build_parser().parse_args(["--model", str(ckpt), "--max-sequence-length", "64", "--num-kv-blocks", "64",
                                      "--max-requests", "4", "--max-tokens", "32", *flags])
    config = inference_config_from_args(args)
    assert config.enable_suspend == ("--enable-suspend" in flags)
    llm = LLM(str(ckpt), inference_config=config)
    state = build_state(llm, args)
    return llm, state, create_app(state)


def test_admin_endpoints_are_off_by_default(ckpt):
    _, _, app = _server(ckpt)
    status, body = asyncio.run(post(app, "/suspend", {}))
    assert status == 404 and body["error"]["code"] == 404


def test_rl_driver_order_over_http(ckpt):
    want = LLM(str(ckpt), inference_config=InferenceConfig(**CONFIG)).generate(PROMPT, PARAMS)[0].generated_tokens
    llm, state, app = _server(ckpt, "--enable-admin-endpoints", "--enable-suspend")
    loop = state.engine_loop
    loop.start()
    try:
        async def main():
            sub = Submission([Choice(PROMPT, PARAMS)], asyncio.get_running_loop())
            loop.submit(sub)
            await sub.admitted
            first = await asyncio.wait_for(sub.events.get(), 30)  # it runs
            assert first.update is not None
            assert (await post(app, "/pause_generation", {"mode": "stop"}))[0] == 400
            status, body = await post(app, "/pause_generation", {"mode": "keep"})
            assert status == 200 and body["paused"] and body["weight_version"] == 0
            status, body = await post(app, "/suspend", {"tags": ["weights", "kv_cache"], "keep_weights_on_host": False})
            assert status == 200 and body["suspended"] == ["kv_cache", "weights"], body
            assert llm.engine.context.active, "the request is running (paused) while suspended"
            for path, payload, code in [("/suspend", {"tags": ["kv_cache"]}, 409),  # twice
                                        ("/resume_generation", {}, 409),  # still suspended
                                        ("/resume", {"tags": ["kv_cache"]}, 409),  # weights first
                                        ("/update_weights", {"path": str(ckpt)}, 409),  # into suspended weights
                                        ("/suspend", {"tags": ["gpu"]}, 400),
                                        ("/resume", b"{not json", 400),
                                        ("/update_weights", {}, 400)]:
                status, body = await post(app, path, payload)
                assert status == code and body["error"]["code"] == code, (path, status, body)
            assert (await post(app, "/resume", {"tags": ["weights"]}))[0] == 200
            assert (await post(app, "/resume", {"tags": ["kv_cache"]}))[0] == 409  # dropped weights not refilled
            assert (await post(app, "/update_weights", {"path": "/nonexistent"}))[0] == 400
            status, body = await post(app, "/update_weights", {"path": str(ckpt), "version": 5})
            assert status == 200 and body["weight_version"] == 5
            status, body = await post(app, "/resume", {"tags": ["kv_cache"]})
            assert status == 200 and body["suspended"] == []
            status, body = await post(app, "/resume_generation")
            assert status == 200 and not body["paused"]
            tokens, out = list(first.update.new_tokens), None
            while out is None:
                ev = await asyncio.wait_for(sub.events.get(), 30)
                assert ev.error is None
                tokens += ev.update.new_tokens if ev.update is not None else []
                out = ev.output
            return tokens, out

        tokens, out = asyncio.run(main())
    finally:
        loop.stop()
    assert tokens == want == out.generated_tokens
    assert set(out.weight_versions) == {0, 5}  # the same weights again, under a new version
