"""Reading a LoRA adapter in PEFT's format into plain (A, B) pairs per adapted module.

PEFT's ``save_pretrained`` writes ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ...) and ``adapter_model.safetensors`` with tensors named
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r], ``<module>``
being the Hugging Face module path (``model.layers.3.self_attn.q_proj``). The scale is PEFT's:
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``. What PEFT can save but an
unmerged LoRA product cannot serve (DoRA, per-module rank or alpha patterns, trained biases,
``modules_to_save``, embedding adapters) is refused, as is anything malformed."""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_async.models.slab_loading import WeightUpdateError


class LoRAError(WeightUpdateError):
    """An adapter that cannot be loaded, updated or unloaded (missing file, malformed config, a
    tensor the model has no place for, a shape of another base model, a rank over
    ``max_lora_rank``, no free slot, an unknown or busy name): raised before anything changes."""


CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, cfg: Mapping) -> AdapterConfig:
        """PEFT's ``adapter_config.json`` contents; LoRAError on what this engine cannot serve."""
        if not isinstance(cfg, Mapping):
            raise LoRAError(f"an adapter config must be a mapping, got {type(cfg).__name__}")
        if cfg.get("peft_type", "LORA") not in ("LORA", "lora"):
            raise LoRAError(f"not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
        r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise LoRAError(f"adapter config: r must be a positive integer, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise LoRAError(f"adapter config: lora_alpha must be a finite number, got {alpha!r}")
        for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
            if cfg.get(key, off) not in (off, None):
                raise LoRAError(f"adapter config: {key}={cfg[key]!r} is not supported (only {off!r})")
        for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
            if cfg.get(key):
                raise LoRAError(f"adapter config: {key} is not supported (got {cfg[key]!r})")
        rslora = cfg.get("use_rslora", False)
        if not isinstance(rslora, bool):
            raise LoRAError(f"adapter config: use_rslora must be a bool, got {rslora!r}")
        return cls(r, float(alpha), rslora)


@dataclass
class AdapterWeights:
    config: AdapterConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """HF module path -> (A [r, in], B [out, r]) full tensors."""


def read_adapter(source, config: AdapterConfig | None = None) -> AdapterWeights:
    """``source``: a directory saved by PEFT; a mapping of PEFT-named tensors (with ``config``, or
    scale 1 when None: alpha = r); or a pair (adapter config dict, such a mapping)."""
    if isinstance(source, (str, os.PathLike)):
        return _read_dir(Path(source))
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[0], Mapping):
        return pair_tensors(source[1], AdapterConfig.from_dict(source[0]))
    if isinstance(source, Mapping):
        return pair_tensors(source, config)
    raise LoRAError("an adapter is a PEFT directory, a mapping of PEFT-named tensors or (config dict, mapping); "
                    f"got {type(source).__name__}")


def _read_dir(path: Path) -> AdapterWeights:
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise LoRAError(f"{p}: no such file (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{cfg_path}: unreadable ({e})") from e
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path))
    except (OSError, SafetensorError, ValueError) as e:
        raise LoRAError(f"{weights_path}: unreadable ({e})") from e
    return pair_tensors(tensors, AdapterConfig.from_dict(cfg))


def pair_tensors(tensors: Mapping, config: AdapterConfig | None) -> AdapterWeights:
    """Group PEFT-named tensors into (A, B) per module; every tensor must be one of a whole pair."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise LoRAError(f"unexpected adapter tensor {name!r} (expected <module>.lora_A.weight / .lora_B.weight)")
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise LoRAError(f"adapter tensor {name!r} must be a 2-D floating-point tensor")
        halves.setdefault(m["module"], {})[m["which"]] = t
    if not halves:
        raise LoRAError("the adapter has no lora_A / lora_B tensors")
    modules = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{module}: lora_A and lora_B must come together (got only lora_{''.join(pair)})")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != b.shape[1]:
            raise LoRAError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree on the rank")
        modules[module] = (a, b)
    ranks = {a.shape[0] for a, _ in modules.values()}
    if config is None:
        config = AdapterConfig(max(ranks), float(max(ranks)))
    if ranks != {config.rank}:
        raise LoRAError(f"the tensors have ranks {sorted(ranks)}, the config says r={config.rank}")
    return AdapterWeights(config, modules)
