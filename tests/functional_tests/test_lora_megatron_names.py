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
from megatron_async.models.megatron_layouts import Shard
from tests.helpers.engine_harness import make_llm, random_prompts
from tests.helpers.hf_models import make_tiny_checkpoint
from tests.helpers.lora_adapters import R, megatron_shards, peft_named, random_modules

ALPHA, NEW = 8.0, 6


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "LlamaForCausalLM"])
def llm(request, tmp_path_factory):
    base = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "base")
    return make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8)


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
def test_megatron_names_equalpeft_named(llm, canonical, tp):
    hf = random_modules(llm, canonical, seed=3 + tp)
    llm.load_lora("peft", peft_named(hf))
    shards = megatron_shards(llm, hf, canonical, tp, prefix="module." if tp == 2 else "")
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
    first, second = random_modules(llm, False, seed=11), random_modules(llm, False, seed=12)
    llm.load_lora("meg", ({"dim": R, "alpha": ALPHA}, megatron_shards(llm, first, False, 1)[0]))
    llm.load_lora("peft", peft_named(second))
    try:
        llm.update_lora("meg", megatron_shards(llm, second, False, 2))  # the adapter's config is kept
        assert _outputs(llm, "meg") == _outputs(llm, "peft")
    finally:
        llm.unload_lora("meg")
        llm.unload_lora("peft")


def test_bad_megatron_adapters_are_refused(llm):
    hf = random_modules(llm, False, seed=21)
    shards = megatron_shards(llm, hf, False, 2)
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
