"""LoRA adapters in the engine against PEFT: a request with adapter X generates what PEFT's merged
model with X generates (greedy tokens and log-probs); a batch mixing adapters and the base model
gives each row its own model's tokens, launch-ahead or serial; an adapter update rewrites it in
place; bad adapters and requests are refused with nothing changed."""
import json
import math

import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.inference.request import InvalidRequestError
from megatron_async.models.lora import LoRAError
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import hf_greedy, hf_logits, make_tiny_checkpoint
from tests.helpers.lora_adapters import make_peft_adapter, merged_reference

from tests.helpers.requirements import installed  # noqa: E402

pytestmark = pytest.mark.skipif(not installed("peft"), reason="peft not installed")  # (importing it: ~2 s a worker)

NEW = 8
ADAPTERS = {  # name: (rank, alpha, targets, rslora)
    "x": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "y": (4, 8, ["q_proj", "v_proj", "down_proj"], True),
    "z": (2, 4, ["up_proj", "o_proj"], False),
}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_checkpoint(request.param, root / "base")
    paths = {name: make_peft_adapter(base, root / name, r, alpha, targets, seed=i, use_rslora=rs)
             for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())}
    prompts = random_prompts(6, 3, 30, 256, seed=2)
    refs = {name: merged_reference(base, paths.get(name)) for name in (None, *paths)}
    expected = {name: [hf_greedy(ref, p, NEW) for p in prompts] for name, ref in refs.items()}
    return base, paths, prompts, refs, expected


def _llm(base, paths, names=("x", "y", "z"), **cfg):
    llm = make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8, **cfg)
    for name in names:
        llm.load_lora(name, paths[name])
    return llm


def _greedy(lora=None, new=NEW, **kw):
    return SamplingParams(top_k=1, num_tokens_to_generate=new, lora=lora, **kw)


def test_adapters_change_the_outputs(setup):
    _, _, _, _, expected = setup
    for name in ("x", "y", "z"):
        assert expected[name] != expected[None], name  # the comparisons below test something


@pytest.mark.parametrize("name", ["x", "y", "z"])
def test_adapter_tokens_and_log_probs_equal_peft_merged(setup, name):
    base, paths, prompts, refs, expected = setup
    llm = _llm(base, paths, max_tokens=24)  # chunked prefill too
    outs = llm.generate(prompts, _greedy(name, return_log_probs=True))
    assert [o.generated_tokens for o in outs] == expected[name]
    for p, o in zip(prompts, outs):
        full = p + o.generated_tokens
        lp = torch.log_softmax(hf_logits(refs[name], full), dim=-1)
        want = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(o.generated_tokens)]
        assert o.generated_log_probs == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_each_row_its_own_model(setup, async_scheduling):
    base, paths, prompts, _, expected = setup
    llm = _llm(base, paths, async_scheduling=async_scheduling)
    names = [None, "x", "y", "z", "x", None]
    ids = [llm.engine.add_request(p, _greedy(n)) for p, n in zip(prompts, names)]
    outs = {o.request_id: o for o in llm.engine.run_until_done()}
    for i, (rid, n) in enumerate(zip(ids, names)):
        assert outs[rid].generated_tokens == expected[n][i], (i, n)


def test_batch_invariant_mixed_batch_equals_alone(setup, tmp_path):
    base, _, prompts, _, _ = setup
    # the interpreter runs every kernel of a layer once per step, and attention programs per KV
    # head: one layer with 2 query heads on 1 KV head, adapters x and y (every target, rsLoRA) on it
    arch = json.loads((base / "config.json").read_text())["architectures"][0]
    narrow = make_tiny_checkpoint(arch, tmp_path / "narrow", num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1)
    paths = {name: make_peft_adapter(narrow, tmp_path / name, r, alpha, targets, seed=i, use_rslora=rs)
             for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items()) if name in ("x", "y")}
    llm = _llm(narrow, paths, names=("x", "y"), batch_invariant=True)
    names = ["x", "y", None, "x"]  # two adapters, the base model, one adapter twice
    # prompts of 12, 7, 12 and 12 tokens, a prefill and three decode steps of the mixed batch
    prompts = [p[:12] for p in prompts[:4]]
    together = [o.generated_tokens for o in llm.generate(prompts, [_greedy(n, new=4) for n in names])]
    alone = [llm.generate([p], _greedy(n, new=4))[0].generated_tokens for p, n in zip(prompts, names)]
    assert together == alone


def test_prefix_cache_keeps_adapters_apart(setup):
    base, paths, prompts, _, expected = setup
    llm = _llm(base, paths, enable_prefix_caching=True)
    for name in (None, "x", "y", None, "x"):
        assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy(name))] == expected[name][:2]
    assert llm.engine.stats.prefix_hit_tokens > 0  # repeats hit their own entries


def test_update_unload_and_reload(setup, tmp_path):
    base, paths, prompts, _, expected = setup
    llm = _llm(base, paths, names=("x",), enable_prefix_caching=True)
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("x"))] == expected["x"][:2]
    cfg = json.loads((paths["z"] / "adapter_config.json").read_text())
    from safetensors.torch import load_file

    version = llm.update_lora("x", (cfg, load_file(str(paths["z"] / "adapter_model.safetensors"))))
    assert version == llm.engine.weight_version == 1
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("x"))] == expected["z"][:2]
    llm.unload_lora("x")
    with pytest.raises(InvalidRequestError, match="no such adapter"):
        llm.engine.add_request(prompts[0], _greedy("x"))
    llm.load_lora("y", paths["y"])
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("y"))] == expected["y"][:2]


def test_unload_refused_while_in_use(setup):
    base, paths, prompts, _, expected = setup
    llm = _llm(base, paths, names=("x",))
    rid = llm.engine.add_request(prompts[0], _greedy("x"))
    llm.engine.step()
    with pytest.raises(LoRAError, match="in use"):
        llm.unload_lora("x")
    outs = {o.request_id: o for o in llm.engine.run_until_done()}
    assert outs[rid].generated_tokens == expected["x"][0]
    llm.unload_lora("x")


def test_bad_adapters_refused_nothing_changed(setup, tmp_path):
    base, paths, prompts, _, expected = setup
    llm = _llm(base, paths, names=("y",))
    slots = llm.engine.context.lora
    before = {k: (t.slots.a.clone(), t.slots.b.clone()) for k, t in list(slots.targets.items())[:3]}
    from safetensors.torch import load_file

    good = load_file(str(paths["x"] / "adapter_model.safetensors"))
    cfg = json.loads((paths["x"] / "adapter_config.json").read_text())
    other = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "other", hidden_size=32, intermediate_size=64)
    bad = {
        "missing dir": tmp_path / "nowhere",
        "over rank": make_peft_adapter(base, tmp_path / "big", 16, 16, ["q_proj"], seed=9),
        "other base": make_peft_adapter(other, tmp_path / "otherx", 4, 8, ["q_proj"], seed=9),
        "unknown tensor": (cfg, {**good, "base_model.model.model.layers.0.mlp.gate_proj.lora_magnitude_vector": next(iter(good.values()))}),
        "half pair": (cfg, {k: v for k, v in good.items() if "layers.1.self_attn.q_proj.lora_B" not in k}),
        "nan": (cfg, {k: v * math.nan if "layers.1.mlp.down_proj.lora_A" in k else v for k, v in good.items()}),
        "dora": ({**cfg, "use_dora": True}, good),
        "no such module": (cfg, {k.replace("layers.1.", "layers.7."): v for k, v in good.items()}),
    }
    for what, source in bad.items():
        with pytest.raises(LoRAError):
            llm.load_lora("new", source)
        assert "new" not in slots.loaded, what
    with pytest.raises(LoRAError, match="already loaded"):
        llm.load_lora("y", paths["x"])
    with pytest.raises(LoRAError):
        llm.update_lora("y", {k: v[:, :2] if "lora_B" in k else v[:2] for k, v in good.items()})
    for k, (a, b) in before.items():
        assert torch.equal(slots.targets[k].slots.a, a) and torch.equal(slots.targets[k].slots.b, b), k
    with pytest.raises(InvalidRequestError, match="no such adapter"):
        llm.engine.add_request(prompts[0], _greedy("nope"))
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("y"))] == expected["y"][:2]


def test_requests_name_adapters_only_with_lora_enabled(setup):
    base, _, prompts, _, _ = setup
    llm = make_llm(base)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.engine.add_request(prompts[0], _greedy("x"))
    with pytest.raises(LoRAError, match="enable_lora"):
        llm.load_lora("x", {})
