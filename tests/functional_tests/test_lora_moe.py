"""LoRA adapters on MoE experts in the engine (``tiny-moe``: layer 0 routed experts, layer 1 a
dense MLP): PEFT's per-expert names (``model.layers.0.mlp.experts.5.gate_proj``), each request of
adapter X generating what the model with X merged into its weights generates (tokens and
log-probs, fp32 on the CPU); rows of two adapters and the base model in one batch, launch-ahead or
serial; ``update_lora`` and the IPC refit rewriting expert adapters in place; bad expert adapters
refused with nothing changed. On a GPU (``gpu``): bf16 with CUDA graphs, the graphed steps against
the same engine's eager steps."""
import math

import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.models.lora import LoRAError
from tests.helpers.engine_harness import random_prompts
from tests.helpers.lora_moe import expert_adapter, merge_into, tiny_moe

NEW = 8
LORA = dict(enable_lora=True, max_loras=3, max_lora_rank=8, lora_experts=True)


def _is_expert(m):
    return ".experts." in m


ADAPTERS = {  # name: (rank, alpha, modules, rslora)
    "x": (8, 16, lambda m: _is_expert(m) or m.endswith(("o_proj", "layers.1.mlp.down_proj")), False),
    "y": (4, 8, _is_expert, True),
}


def _greedy(lora=None, **kw):
    return SamplingParams(top_k=1, num_tokens_to_generate=NEW, lora=lora, **kw)


@pytest.fixture(scope="module")
def setup():
    probe = tiny_moe(**LORA)
    adapters = {name: expert_adapter(probe, r, alpha, seed=i, include=inc, use_rslora=rs)
                for i, (name, (r, alpha, inc, rs)) in enumerate(ADAPTERS.items())}
    prompts = random_prompts(6, 3, 24, 1000, seed=3)
    refs = {name: tiny_moe() if name is None else merge_into(tiny_moe(), adapters[name]) for name in (None, *adapters)}
    expected = {name: [o.generated_tokens for o in ref.generate(prompts, _greedy(return_log_probs=True))]
                for name, ref in refs.items()}
    return adapters, prompts, refs, expected


def _llm(adapters, names=("x", "y"), **cfg):
    llm = tiny_moe(**LORA, **cfg)
    for name in names:
        llm.load_lora(name, adapters[name])
    return llm


def test_expert_targets_named_per_expert(setup):
    adapters, _, _, expected = setup
    names = [k for k in adapters["y"][1] if "layers.0.mlp.experts.7.up_proj.lora_B" in k]
    assert names == ["base_model.model.model.layers.0.mlp.experts.7.up_proj.lora_B.weight"]
    moe_layers = {k.split(".")[4] for k in adapters["y"][1]}
    assert all(_is_expert(k) for k in adapters["y"][1]) and len(adapters["y"][1]) == len(moe_layers) * 8 * 3 * 2
    assert "1" not in moe_layers and adapters["y"][0]["target_modules"] == ["down_proj", "gate_proj", "up_proj"]
    for name in ADAPTERS:
        assert expected[name] != expected[None], name  # the comparisons below test something


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_tokens_and_log_probs_equal_merged(setup, name):
    adapters, prompts, refs, expected = setup
    llm = _llm(adapters, max_tokens=16)  # chunked prefill too
    outs = llm.generate(prompts, _greedy(name, return_log_probs=True))
    assert [o.generated_tokens for o in outs] == expected[name]
    want = refs[name].generate(prompts, _greedy(return_log_probs=True))
    for o, w in zip(outs, want):
        assert o.generated_log_probs == pytest.approx(w.generated_log_probs, abs=1e-4)
    assert llm.engine.stats.lora_requests == len(prompts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_each_row_its_own_model(setup, async_scheduling):
    adapters, prompts, _, expected = setup
    llm = _llm(adapters, async_scheduling=async_scheduling)
    names = [None, "x", "y", "x", None, "y"]
    ids = [llm.engine.add_request(p, _greedy(n)) for p, n in zip(prompts, names)]
    outs = {o.request_id: o for o in llm.engine.run_until_done()}
    for i, (rid, n) in enumerate(zip(ids, names)):
        assert outs[rid].generated_tokens == expected[n][i], (i, n)
    assert llm.engine.stats.lora_requests == 4


def test_update_and_ipc_refit_rewrite_expert_adapters(setup):
    from megatron_async.weight_transfer import ipc

    adapters, prompts, _, expected = setup
    llm = _llm(adapters, names=("x",), enable_prefix_caching=True)
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("x"))] == expected["x"][:2]
    assert llm.update_lora("x", adapters["y"]) == 1  # y's config and tensors in x's slot
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("x"))] == expected["y"][:2]
    items = [(k, v.clone().share_memory_()) for k, v in adapters["x"][1].items()]
    llm.update_lora("x", (adapters["x"][0], {k: torch.zeros_like(v) for k, v in items}))  # x's config back
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("x"))] == expected[None][:2]
    assert llm.engine.update_lora_from_ipc("x", ipc.share(items, weights_format="hf")) == 3
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("x"))] == expected["x"][:2]


def test_bad_expert_adapters_refused_nothing_changed(setup):
    adapters, prompts, _, expected = setup
    llm = _llm(adapters, names=("y",))
    lora = llm.engine.context.lora
    experts = lora.targets["model.layers.0.mlp.experts.0.gate_proj"].slots
    before = (experts.a.clone(), experts.b.clone(), experts.scale.clone())
    cfg, good = adapters["x"]
    b_name = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight"
    bad = {
        "expert B of another width": {**good, b_name: good[b_name][:-1]},
        "no such expert": {k.replace("experts.7.", "experts.8."): v for k, v in good.items()},
        "half pair": {k: v for k, v in good.items() if "experts.2.up_proj.lora_A" not in k},
        "nan": {k: v * math.nan if "experts.5.gate_proj.lora_A" in k else v for k, v in good.items()},
    }
    for what, tensors in bad.items():
        with pytest.raises(LoRAError):
            llm.load_lora("new", (cfg, tensors))
        assert "new" not in lora.loaded, what
    with pytest.raises(LoRAError, match="max_lora_rank"):
        llm.load_lora("new", expert_adapter(llm, 16, 16, seed=5, include=_is_expert))
    with pytest.raises(LoRAError, match="experts.3.down_proj"):
        llm.update_lora("y", (adapters["y"][0], {**adapters["y"][1], b_name: adapters["y"][1][b_name][:-1]}))
    for was, now in zip(before, (experts.a, experts.b, experts.scale)):
        assert torch.equal(was, now)
    assert [o.generated_tokens for o in llm.generate(prompts[:2], _greedy("y"))] == expected["y"][:2]


def test_without_lora_experts_the_experts_take_no_slots(setup):
    """``lora_experts`` off (the default): the routed experts keep their fused path and no slots, an
    adapter naming an expert is refused (the message names the field), one on the other projections
    still loads and serves."""
    adapters, prompts, _, _ = setup
    llm = tiny_moe(**{**LORA, "lora_experts": False})
    lora = llm.engine.context.lora
    assert not any(_is_expert(m) for m in lora.targets) and "model.layers.0.self_attn.o_proj" in lora.targets
    experts = next(b.mixer.experts for b in llm.model.blocks if hasattr(b.mixer, "experts"))
    assert experts.down_proj.lora is None
    with pytest.raises(LoRAError, match="lora_experts"):
        llm.load_lora("y", adapters["y"])
    assert "y" not in lora.loaded
    cfg, tensors = adapters["x"]
    llm.load_lora("x-dense", (cfg, {k: v for k, v in tensors.items() if not _is_expert(k)}))
    assert len(llm.generate(prompts[:1], _greedy("x-dense"))[0].generated_tokens) == NEW


@pytest.mark.gpu
def test_gpu_fp32_equals_cpu_and_bf16_graphs_equal_eager(setup):
    """fp32 on CUDA (the Triton plan, LoRA and combine kernels, eager): the tokens of the same GPU
    model with each adapter merged (the built-in model's random weights come from a generator on
    its device: a CPU engine holds other weights); bf16 with CUDA graphs (torch's grouped GEMM on
    Hopper): each row's tokens those of the same engine eager."""
    adapters, prompts, _, _ = setup
    names = [None, "x", "y", "x", None, "y"]
    expected = {name: [o.generated_tokens for o in ref.generate(prompts, _greedy())]
                for name, ref in ((None, tiny_moe("cuda")), *((n, merge_into(tiny_moe("cuda"), adapters[n]))
                                                             for n in ("x", "y")))}
    assert expected["x"] != expected[None] and expected["y"] != expected[None]
    fp32 = _llm(adapters, device="cuda", cuda_graphs=False)
    outs = fp32.generate(prompts, [_greedy(n) for n in names])
    assert [o.generated_tokens for o in outs] == [expected[n][i] for i, n in enumerate(names)]
    tokens = {}
    for graphs in (False, True):
        llm = tiny_moe("cuda", "bfloat16", **LORA, cuda_graphs=graphs)
        for name in ("x", "y"):
            llm.load_lora(name, adapters[name])
        tokens[graphs] = [o.generated_tokens for o in llm.generate(prompts, [_greedy(n) for n in names])]
        if graphs:
            assert llm.engine.stats.graph_replays > 0
            base = [o.generated_tokens for o in llm.generate(prompts, _greedy())]
    assert tokens[True] == tokens[False]
    assert all((tokens[True][i] == base[i]) == (n is None) for i, n in enumerate(names))
    print(f"\n{'rows':>6} {'fp32 cuda == cpu':>18} {'bf16 graphs == eager':>22}\n{len(names):>6} {'yes':>18} {'yes':>22}")


@pytest.mark.parametrize("arch, names", [("MixtralForCausalLM", (".block_sparse_moe.experts.", ".w1", ".w2", ".w3")),
                                         ("NemotronHForCausalLM", (".mixer.experts.", ".shared_experts.up_proj"))])
def test_mixtral_and_shared_expert_adapters_equal_merged(arch, names, tmp_path):
    from tests.helpers.engine_harness import make_llm
    from tests.helpers.hf_moe_models import make_tiny_moe_checkpoint

    base = make_tiny_moe_checkpoint(arch, tmp_path / "base")
    llm = make_llm(base, **LORA)
    adapter = expert_adapter(llm, 4, 8, seed=7, include=lambda m: ".experts." in m or ".shared_experts." in m)
    for part in names:
        assert any(part in k for k in adapter[1]), part
    llm.load_lora("e", adapter)
    prompts = random_prompts(3, 3, 12, 128, seed=4)
    want = [o.generated_tokens for o in merge_into(make_llm(base), adapter).generate(prompts, _greedy(ignore_eos=True))]
    assert all(len(t) == NEW for t in want)
    assert want != [o.generated_tokens for o in make_llm(base).generate(prompts, _greedy(ignore_eos=True))]
    assert [o.generated_tokens for o in llm.generate(prompts, _greedy("e", ignore_eos=True))] == want
