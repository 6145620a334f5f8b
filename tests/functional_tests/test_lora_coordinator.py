"""LoRA adapters behind a data-parallel coordinator, with the engines as separate processes: a
request naming an adapter runs on an engine that holds it (the least loaded of them: the engines'
own ``lora_requests`` counters say where each ran) and generates what the offline engine with that
adapter generates; loading and unloading through the client apply to every engine or to the named
ones, and the coordinator routes on what the engines answered; a request for an adapter no engine
holds is refused alone while the others are served; a server in front of the coordinator loads
and unloads through it, lists the engines' adapters and serves a ``model`` naming one."""
from __future__ import annotations

import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.client import SyncInferenceClient
from megatron_async.client.client import ControlError
from tests.functional_tests.server_client import json_request
from tests.helpers.coordinator_procs import Cluster
from tests.helpers.lora_adapters import write_random_adapter

NEW = 6
LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
ENGINE = ("--max-requests", "4", "--block-size", "8", "--num-kv-blocks", "128", *LORA)
PROMPTS = [[5 + i, 6, 7, 8 + i, 9, 10, 11 + i] for i in range(6)]


def _greedy(lora=None):
    return SamplingParams(top_k=1, num_tokens_to_generate=NEW, ignore_eos=True, lora=lora)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    ref = LLM(None, "cpu", "float32", InferenceConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                                                       block_size_tokens=8, max_requests=8, num_kv_blocks=128))
    paths = {name: write_random_adapter(ref.engine.context.lora, root / name, r, 2 * r, seed)
             for name, r, seed in (("a", 4, 1), ("b", 8, 2))}
    expected = {None: [o.generated_tokens for o in ref.generate(PROMPTS, _greedy())]}
    for name, path in paths.items():
        ref.load_lora(name, path)
        expected[name] = [o.generated_tokens for o in ref.generate(PROMPTS, _greedy(name))]
    assert expected["a"] != expected[None] and expected["b"] != expected[None]  # the checks below see adapters
    cluster = Cluster("load_balanced")
    try:
        cluster.start_engine("e0", *ENGINE)
        cluster.start_engine("e1", *ENGINE, "--lora-modules", f"b={paths['b']}")  # held from its registration
        cluster.start_engine("e2", *ENGINE)
        index = {n: cluster.wait_engine(n) for n in ("e0", "e1", "e2")}
        client = SyncInferenceClient(cluster.address)
        yield cluster, client, index, paths, expected
        client.close()
    finally:
        cluster.close()


def _held(client) -> dict[int, list[str]]:
    return {e["index"]: e["loras"] for e in client.engines()["engines"]}


def _lora_requests(client) -> dict[int, int]:
    return {int(i): c["lora_requests"] for i, c in client.engine_stats()["engines"].items()}


def test_requests_run_on_engines_that_hold_their_adapter(setup):
    _, client, index, paths, expected = setup
    e0, e1, e2 = index["e0"], index["e1"], index["e2"]
    assert _held(client) == {e0: [], e1: ["b"], e2: []}
    body = client.load_lora_adapter("a", str(paths["a"]), engines=[e0, e2])
    assert sorted(body["engines"]) == sorted([str(e0), str(e2)])  # only the named engines ran it
    assert _held(client) == {e0: ["a"], e1: ["b"], e2: ["a"]}
    assert client.client.adapters() == ["a", "b"]  # told before the answer came
    before = _lora_requests(client)
    asked = [("a", k) for k in range(6)] + [("b", k) for k in range(3)] + [(None, k) for k in range(3, 6)]
    outs = client.generate([PROMPTS[k] for _, k in asked], [_greedy(n) for n, _ in asked])
    for o, (n, k) in zip(outs, asked):
        assert o.finish_reason == "length", (n, k, o.error)
        assert o.generated_tokens == expected[n][k], (n, k)
    ran = {e: c - before[e] for e, c in _lora_requests(client).items()}
    assert ran[e1] == 3  # every "b" request on the one engine that holds it
    assert ran[e0] == 3 and ran[e2] == 3  # the "a" requests split between its two holders by load


def test_an_adapter_no_engine_holds_is_refused_alone(setup):
    _, client, index, _, expected = setup
    names = ["zzz", "b", None, "zzz", "b"]
    outs = client.generate(PROMPTS[:5], [_greedy(n) for n in names])
    for i, (o, n) in enumerate(zip(outs, names)):
        if n == "zzz":
            assert o.finish_reason == "error" and "no engine holds this LoRA adapter" in o.error and "'b'" in o.error
        else:
            assert o.finish_reason == "length" and o.generated_tokens == expected[n][i]
    assert client.engines()["counts"]["no_adapter"] >= 2


def test_unload_from_some_engines_then_all(setup):
    _, client, index, paths, expected = setup
    e0, e1, e2 = index["e0"], index["e1"], index["e2"]
    if "a" not in _held(client)[e0]:
        client.load_lora_adapter("a", str(paths["a"]), engines=[e0, e2])
    client.unload_lora_adapter("a", engines=[e0])
    assert _held(client)[e0] == [] and "a" in _held(client)[e2]
    before = _lora_requests(client)
    outs = client.generate(PROMPTS, _greedy("a"))
    assert [o.generated_tokens for o in outs] == expected["a"]
    ran = {e: c - before[e] for e, c in _lora_requests(client).items()}
    assert ran == {e0: 0, e1: 0, e2: 6}  # the one engine left holding it took them all
    with pytest.raises(ControlError) as err:  # an engine that is not there: nothing runs
        client.unload_lora_adapter("a", engines=[e2, 99])
    assert err.value.status == 404 and "a" in _held(client)[e2]
    body = client.unload_lora_adapter("a")  # every engine that holds it
    assert list(body["engines"]) == [str(e2)]
    assert all("a" not in held for held in _held(client).values())
    assert client.client.adapters() == ["b"]
    with pytest.raises(ControlError) as err:
        client.unload_lora_adapter("a")
    assert err.value.status == 404 and "no engine holds LoRA adapter 'a'" in str(err.value)
    out = client.generate(PROMPTS[:1], _greedy("a"))[0]
    assert out.finish_reason == "error" and "no engine holds" in out.error


def test_a_server_in_front_of_the_coordinator(setup):
    cluster, _, index, paths, expected = setup
    _, url = cluster.start_server("--default-model", "tiny", "--device", "cpu", "--enable-admin-endpoints")
    status, body = json_request(url + "/v1/load_lora_adapter",
                         {"lora_name": "a", "lora_path": str(paths["a"]), "engines": [index["e2"]]})
    assert status == 200 and list(body["engines"]) == [str(index["e2"])]
    ids = [m["id"] for m in json_request(url + "/v1/models")[1]["data"]]
    assert ids == ["tiny", "a", "b"]
    for name in ("a", "b", "tiny"):
        status, body = json_request(url + "/v1/completions", {"model": name, "prompt": PROMPTS[0], "max_tokens": NEW,
                                                      "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert status == 200 and body["model"] == name
        assert body["choices"][0]["token_ids"] == expected[None if name == "tiny" else name][0], name
    status, body = json_request(url + "/v1/completions", {"model": "zzz", "prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 404 and body["error"]["param"] == "model" and "'a'" in body["error"]["message"]
    assert json_request(url + "/v1/unload_lora_adapter", {"lora_name": "a"})[0] == 200
    assert [m["id"] for m in json_request(url + "/v1/models")[1]["data"]] == ["tiny", "b"]
