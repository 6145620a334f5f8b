"""Random PEFT LoRA adapters of a tiny Hugging Face checkpoint, and their merged reference models;
random adapters of any engine's model as PEFT names or as a Megatron-Core trainer's shards."""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_async.models.megatron_layouts import NameMap, Shard, megatron_from_hf

from tests.helpers.hf_models import load_hf_reference

R = 4
"""The rank of ``random_modules``' adapters."""
L, H = "decoder.layers.{l}", "model.layers.{l}"


def make_peft_adapter(base_path: str | Path, out: str | Path, r: int, alpha: float, targets: list[str],
                      seed: int, use_rslora: bool = False) -> Path:
    """A PEFT adapter of rank ``r`` on ``targets`` with random A and B (B nonzero), saved to ``out``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, use_rslora=use_rslora,
                        lora_dropout=0.0)
    model = get_peft_model(load_hf_reference(base_path), config)
    with torch.no_grad():  # larger than PEFT's init, so each adapter moves greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    model.save_pretrained(out)
    return Path(out)


def merged_reference(base_path: str | Path, adapter_path: str | Path | None):
    """The base checkpoint with the adapter merged in (PEFT's ``merge_and_unload``); None: the base."""
    model = load_hf_reference(base_path)
    if adapter_path is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_path)).merge_and_unload().eval()


def write_random_adapter(adapters, out: str | Path, r: int, alpha: float, seed: int, scale: float = 0.5) -> Path:
    """A PEFT-format adapter directory of rank ``r`` with random A and B on every module an
    engine's ``LoRAAdapters`` (``llm.engine.context.lora``) adapts: adapters of a model that
    has no Hugging Face checkpoint (the built-in ones)."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, target in adapters.targets.items():
        shape_a, shape_b = target.slots.full_shapes(target.part, r)
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(shape_a, generator=gen) * scale
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(shape_b, generator=gen) * scale
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                          "target_modules": sorted({m.rsplit(".", 1)[-1] for m in adapters.targets})}))
    return out


def random_modules(llm, canonical: bool, seed: int) -> dict[str, torch.Tensor]:
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


def peft_named(hf: dict, alpha: float = 8.0) -> tuple[dict, dict]:
    tensors = {f"base_model.model.{k[:-2]}.lora_{k[-1]}.weight": v for k, v in hf.items()}
    return {"r": R, "lora_alpha": alpha}, tensors


def megatron_shards(llm, hf: dict, canonical: bool, tp: int, prefix: str = "") -> list[dict]:
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
