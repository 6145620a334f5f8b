"""A float Hugging Face checkpoint written in the published FP8 block-scaled layout (see
``quantization.py``): what ``quantization="fp8"`` does at load, done once offline."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_async.kernels.fp8_quant import quantize_weight
from megatron_async.models.checkpoint import INDEX_FILE, iter_safetensors, safetensors_files
from megatron_async.models.quantization import Fp8Config


def write_fp8_checkpoint(src: str | Path, dst: str | Path, ignored: tuple[str, ...] = ()) -> dict[str, int]:
    """Quantize a bf16 / fp32 HF checkpoint directory into the published FP8 layout at ``dst``
    (other files copied). Returns {"fp8": n, "kept": m} tensor counts."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = Fp8Config(ignored=tuple(ignored))
    out: dict[str, torch.Tensor] = {}
    counts = {"fp8": 0, "kept": 0}
    for name, t in iter_safetensors(safetensors_files(src)):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.dim() == 2 and cfg.quantizes(module):
            out[name], out[module + ".weight_scale_inv"] = quantize_weight(t)
            counts["fp8"] += 1
        else:
            out[name] = t.contiguous()
            counts["kept"] += 1
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": list(ignored)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_FILE):
            shutil.copy(extra, dst / extra.name)
    return counts
