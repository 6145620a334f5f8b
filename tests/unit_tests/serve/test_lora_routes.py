"""LoRA adapters in the server's own process (the ASGI app, no front-end process): the adapter
routes are admin routes (the admin key; absent, 404, without --enable-admin-endpoints); the engine
loop's adapter list feeds /v1/models and a request's ``model`` (another name: 404); the engine operations answer an
engine without LoRA slots with a 400; --lora-modules parses NAME=PATH and turns --enable-lora on."""
import argparse
import asyncio

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)

from megatron_async import LLM  # noqa: E402
from megatron_async.cli.flags import inference_config_from_args  # noqa: E402
from megatron_async.dp_engine.engine_ops import EVERY_RANK_OPS, run_admin_op  # noqa: E402
from megatron_async.serve.__main__ import build_parser, build_state  # noqa: E402
from megatron_async.serve.app import create_app  # noqa: E402
from megatron_async.serve.http_guard import route_class  # noqa: E402
from megatron_async.serve.lora_modules import lora_module, resolve_lora_args  # noqa: E402
from tests.helpers.hf_models import make_tiny_checkpoint  # noqa: E402
from tests.helpers.asgi_call import get, post  # noqa: E402
from tests.helpers.lora_adapters import make_peft_adapter  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_routes")
    base = make_tiny_checkpoint("Qwen3ForCausalLM", root / "base")
    return base, make_peft_adapter(base, root / "a", 4, 8, ["q_proj", "down_proj"], seed=1)


def _server(base, *flags):
    args = build_parser().parse_args(["--model", str(base), "--max-requests", "4", "--num-kv-blocks", "64", *flags])
    llm = LLM(str(base), inference_config=inference_config_from_args(args))
    state = build_state(llm, args)
    return llm, state, create_app(state)


def test_adapter_routes_are_admin_routes():
    assert route_class("/v1/load_lora_adapter") == route_class("/v1/unload_lora_adapter") == "admin"
    assert route_class("/v1/models") == "api"
    assert {"load_lora_adapter", "unload_lora_adapter"} <= EVERY_RANK_OPS


def test_lora_modules_flag():
    assert lora_module("sql=/a/b=c") == ("sql", "/a/b=c")
    for bad in ("sql", "=/a", "sql="):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)
    args = build_parser().parse_args(["--lora-modules", "a=/nonexistent"])
    assert "not a directory" in resolve_lora_args(args, "base") and args.enable_lora
    args = build_parser().parse_args(["--lora-modules", "a=/tmp", "a=/tmp"])
    assert "twice" in resolve_lora_args(args, "base")
    args = build_parser().parse_args(["--lora-modules", "base=/tmp"])
    assert "served model's name" in resolve_lora_args(args, "base")
    args = build_parser().parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"])
    config = inference_config_from_args(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 3, 32)
    assert not inference_config_from_args(build_parser().parse_args([])).enable_lora


def test_routes_absent_without_admin_endpoints(files):
    base, adapter = files
    llm, _, app = _server(base, "--enable-lora")
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        status, answer = asyncio.run(post(app, path, body))
        assert status == 404 and answer["error"]["code"] == 404
    assert not llm.engine.context.lora.loaded


def test_engine_loop_adapters_feed_models_and_requests(files):
    base, adapter = files
    llm, state, app = _server(base, "--enable-lora", "--enable-admin-endpoints")
    state.engine_loop.start()
    try:
        async def main():
            assert (await post(app, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)}))[0] == 200
            status, listing = await get(app, "/v1/models")
            assert status == 200 and [m["id"] for m in listing["data"]] == [state.model_name, "a"]
            assert listing["data"][1]["parent"] == state.model_name
            status, out = await post(app, "/v1/completions", {"model": "a", "prompt": [3, 4, 5], "max_tokens": 3})
            assert status == 200 and out["model"] == "a" and out["usage"]["completion_tokens"] == 3
            status, out = await post(app, "/v1/completions", {"model": "b", "prompt": [3, 4, 5], "max_tokens": 3})
            assert status == 404 and out["error"]["param"] == "model" and "'a'" in out["error"]["message"]
            assert (await post(app, "/v1/unload_lora_adapter", {"lora_name": "a"}))[0] == 200
            return (await get(app, "/v1/models"))[1]

        listing = asyncio.run(main())
    finally:
        state.engine_loop.stop()
    assert [m["id"] for m in listing["data"]] == [state.model_name]


def test_operations_without_lora_slots_are_400(files):
    base, adapter = files
    llm = LLM(str(base), inference_config=inference_config_from_args(build_parser().parse_args(
        ["--max-requests", "4", "--num-kv-blocks", "64"])))
    for op, args in (("load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)}),
                     ("unload_lora_adapter", {"lora_name": "a"})):
        status, body = run_admin_op(llm.engine, None, op, args)
        assert status == 400 and "enable_lora" in body["error"]["message"], body
