"""LoRA adapters named as Megatron-Core names them (NeMo / Megatron-Bridge ``LoRA``: one adapter on
the fused linear_qkv and linear_fc1; ``CanonicalLoRA``: one per projection), whole or as the
shards of tensor-parallel trainer ranks: the engine's slots hold exactly what the same adapter in
PEFT's format puts there, so the logits (greedy tokens and log-probs) are identical; shards missing
or given twice, and names this model has no linear for, are refused with nothing changed."""
from __future__ import annotations

import pytest
import torch

from megatron_async import SamplingParams
from megatron_async.models.lora import LoRAError
from megatron_async.models.megatron_layouts import NameMap, Shard, megatron_from_hf
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import make_tiny_checkpoint

R, ALPHA, NEW = 4, 8.0, 6
L, H = "decoder.layers.{l}", "model.layers.{l}"


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM"])
def llm(request, tmp_path_factory):
    base = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "base")
    return make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8)


def _hf_adapter(llm, canonical: bool, seed: int) -> dict[str, torch.Tensor]:
    """Full A / B per HF module (``{module}.A`` / ``.B``); the fused form shares A over q/k/v and gate/up."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, target in llm.engine.context.lora.targets.items():
        shape_a, shape_b = target.slots.full_shapes(target.part, R)
        out[f"{module}.A"] = torch.randn(shape_a, generator=gen)
        out[f"{module}.B"] = torch.randn(shape_b, generator=gen)
    if not canonical:
        for m in [m for m in out if m.endswith((".k_proj.A", ".v_proj.A"))]:
            out[m] = out[m.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.")]
        for m in [m for m in out if m.endswith(".up_proj.A")]:
            out[m] = out[m.replace(".up_proj.", ".gate_proj.")]
    return out


def _peft(hf: dict) -> tuple[dict, dict]:
    tensors = {f"base_model.model.{k[:-2]}.lora_{k[-1]}.weight": v for k, v in hf.items()}
    return {"r": R, "lora_alpha": ALPHA}, tensors


def _megatron(llm, hf: dict, canonical: bool, tp: int, prefix: str = "") -> list[dict]:
    """The trainer ranks' shards, cut as Megatron's ParallelLinearAdapter cuts them."""
    names, dims = NameMap.for_arch(llm.model.spec.name), llm.model.megatron_dims()
    layers = len({k.split(".")[2] for k in hf})
    ranks = []
    for rank in range(tp):
        shard, out = Shard(rank, tp), {}

        def cut(t, dim=0):
            return t.chunk(tp, dim)[rank].contiguous()

        def laid(meg, modules, which):  # laid out and cut as the base weight is
            return megatron_from_hf(names, dims, {f"{m}.weight": hf[f"{m}.{which}"] for m in modules}, [meg], shard)[meg]

        for l in range(layers):
            att, mlp, ml = f"{H}.self_attn".format(l=l), f"{H}.mlp".format(l=l), L.format(l=l)
            qkv, fc1 = f"{ml}.self_attention.linear_qkv", f"{ml}.mlp.linear_fc1"
            if canonical:
                for p, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                    out[f"{qkv}.adapter.adapter_{p}.linear_in.weight"] = cut(hf[f"{att}.{proj}.A"])
                    out[f"{qkv}.adapter.adapter_{p}.linear_out.weight"] = cut(hf[f"{att}.{proj}.B"])
                for p in ("gate", "up"):
                    out[f"{fc1}.adapter.adapter_{p}.linear_in.weight"] = cut(hf[f"{mlp}.{p}_proj.A"])
                    out[f"{fc1}.adapter.adapter_{p}.linear_out.weight"] = cut(hf[f"{mlp}.{p}_proj.B"])
            else:
                out[f"{qkv}.adapter.linear_in.weight"] = cut(hf[f"{att}.q_proj.A"])
                out[f"{qkv}.adapter.linear_out.weight"] = laid(f"{qkv}.weight", [f"{att}.{p}_proj" for p in "qkv"], "B")
                out[f"{fc1}.adapter.linear_in.weight"] = cut(hf[f"{mlp}.gate_proj.A"])
                out[f"{fc1}.adapter.linear_out.weight"] = laid(f"{fc1}.weight", [f"{mlp}.gate_proj", f"{mlp}.up_proj"], "B")
            for meg, module in ((f"{ml}.self_attention.linear_proj", f"{att}.o_proj"),
                                (f"{ml}.mlp.linear_fc2", f"{mlp}.down_proj")):
                out[f"{meg}.adapter.linear_in.weight"] = laid(f"{meg}.weight", [module], "A")
                out[f"{meg}.adapter.linear_out.weight"] = cut(hf[f"{module}.B"])
        ranks.append({prefix + k: v for k, v in out.items()})
    return ranks


def _slots(llm, name):
    adapters = llm.engine.context.lora
    slot = adapters.slot_of(name)
    seen = {id(t.slots): t.slots for t in adapters.targets.values()}
    return [(s.a[slot].clone(), s.b[slot].clone(), s.scale[slot].clone()) for s in seen.values()]


def _outputs(llm, name):
    prompts = random_prompts(3, 4, 12, 256, seed=5)
    outs = llm.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=NEW, lora=name, return_log_probs=True))
    return [(o.generated_tokens, o.generated_log_probs) for o in outs]


@pytest.mark.parametrize("canonical", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_names_equal_peft(llm, canonical, tp):
    hf = _hf_adapter(llm, canonical, seed=3 + tp)
    llm.load_lora("peft", _peft(hf))
    shards = _megatron(llm, hf, canonical, tp, prefix="module." if tp == 2 else "")
    try:
        llm.load_lora("meg", ({"dim": R, "alpha": ALPHA}, shards if tp > 1 else shards[0]))
        for (pa, pb, ps), (ma, mb, ms) in zip(_slots(llm, "peft"), _slots(llm, "meg")):
            assert torch.equal(pa, ma) and torch.equal(pb, mb) and torch.equal(ps, ms)
        peft, meg = _outputs(llm, "peft"), _outputs(llm, "meg")
        assert peft == meg and peft != _outputs(llm, None)  # identical logits, and the adapter changes them
    finally:
        for name in ("peft", "meg"):
            if name in llm.engine.context.lora.loaded:
                llm.unload_lora(name)


def test_update_in_megatron_names(llm):
    first, second = _hf_adapter(llm, False, seed=11), _hf_adapter(llm, False, seed=12)
    llm.load_lora("meg", ({"dim": R, "alpha": ALPHA}, _megatron(llm, first, False, 1)[0]))
    llm.load_lora("peft", _peft(second))
    try:
        llm.update_lora("meg", _megatron(llm, second, False, 2))  # the adapter's config is kept
        assert _outputs(llm, "meg") == _outputs(llm, "peft")
    finally:
        llm.unload_lora("meg")
        llm.unload_lora("peft")


def test_bad_megatron_adapters_are_refused(llm):
    hf = _hf_adapter(llm, False, seed=21)
    shards = _megatron(llm, hf, False, 2)
    other = {k: torch.cat([v, v], 1) if "linear_in" in k and "linear_qkv" in k else v for k, v in shards[0].items()}
    cases = [
        ([(shards[0], Shard(0, 2))], "missing"),  # one rank of two
        ([shards[0]], "rows"),  # a shard given as the whole adapter
        ([(shards[0], Shard(0, 2)), (shards[0], Shard(0, 2))], "twice"),
        (shards + [{"decoder.layers.0.mlp.linear_fc9.adapter.linear_in.weight": torch.zeros(R, 4)}], "unexpected"),
        ([{k: v for k, v in s.items() if "linear_out" not in k or "linear_qkv" not in k} for s in shards],
         "no linear_out"),
        ([other, shards[1]], "outside"),
    ]
    for source, message in cases:
        with pytest.raises(LoRAError, match=message):
            llm.load_lora("bad", source)
        assert "bad" not in llm.engine.context.lora.loaded
