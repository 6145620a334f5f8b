"""Random PEFT LoRA adapters of a tiny Hugging Face checkpoint, and their merged reference models."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_models import load_hf_reference


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
