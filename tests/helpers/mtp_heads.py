"""Add multi-token-prediction heads (``mtp.*`` tensors, see models/mtp_weights.py) to a checkpoint
for tests and benchmarks.

``init="random"``: N(0, initializer_range) matrices, unit norms: drafts are almost never right.
``init="copy_next"``: a head that drafts what the main model would predict from the next
token's embedding alone: ``fc`` passes the normed embedding through and ignores the hidden
state, the decoder layer adds nothing (zero ``o_proj`` / ``down_proj``), and ``mtp.norm`` is the
main model's final norm, so the draft logits are ``lm_head(final_norm(embed(t)))``. On a model
whose layers add little to the residual stream (``scale_layers``) most drafts are right."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_async.models.checkpoint import (INDEX_FILE, SINGLE_FILE, iter_safetensors, read_hf_config,
                                              safetensors_files)
from megatron_async.models.mtp_weights import DEPTH_KEYS, MTP_PREFIX
from megatron_async.models.registry import get_builder
from megatron_async.parallel.state import ParallelState

MTP_FILE = "model-mtp.safetensors"
INITS = ("random", "copy_next")
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight", "w2.weight")
"""Weights whose products are added to the residual stream (attention out, MLP / expert down)."""


def _with_depths(config: dict, depths: int) -> dict:
    return {k: v for k, v in config.items() if k not in DEPTH_KEYS} | {"num_nextn_predict_layers": depths}


def _mtp_shapes(config: dict, depths: int) -> tuple[dict[str, tuple[int, ...]], str]:
    """Shapes of the mtp.* tensors, and the HF name of the main model's final norm weight."""
    cfg = _with_depths(config, depths)
    model = get_builder(cfg["architectures"][0])(cfg, torch.float32, torch.device("meta"), ParallelState())
    shapes = {n: s for n, s in model.hf_shapes().items() if n.startswith(MTP_PREFIX)}
    return shapes, model.spec.hf_final_norm + ".weight"


@torch.no_grad()
def mtp_tensors(config: dict, base: dict[str, torch.Tensor], depths: int, seed: int, init: str,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of ``depths`` heads for the model of ``config`` (``base``: its tensors)."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    out = {}
    shapes, final_norm = _mtp_shapes(config, depths)
    for name, shape in shapes.items():
        if "norm" in name:
            t = torch.ones(shape)
        elif len(shape) == 1:
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, std, generator=gen)
        out[name] = t
    if init == "copy_next":
        hidden = out["mtp.fc.weight"].shape[0]
        out["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        out["mtp.norm.weight"] = base[final_norm].float().clone()
        for name in out:
            if name.endswith(_RESIDUAL_OUT):
                out[name].zero_()
    return {n: t.to(dtype).contiguous() for n, t in out.items()}


def add_mtp_heads(ckpt_in: str | Path, ckpt_out: str | Path, depths: int = 1, seed: int = 0,
                  init: str = "random", scale_layers: float | None = None) -> Path:
    """Copy ``ckpt_in`` to ``ckpt_out`` with ``depths`` MTP heads added (existing ones replaced)
    and ``num_nextn_predict_layers`` set in config.json. ``scale_layers``: multiply the main
    layers' ``o_proj`` / ``down_proj`` by it (a test model on which ``copy_next`` drafts well)."""
    src, dst = Path(ckpt_in), Path(ckpt_out)
    if depths < 1:
        raise ValueError(f"depths must be >= 1, got {depths}")
    if src.resolve() == dst.resolve():
        raise ValueError("ckpt_out must differ from ckpt_in")
    config = read_hf_config(src)
    base = {n: t for n, t in iter_safetensors(safetensors_files(src)) if not n.startswith(MTP_PREFIX)}
    dtype = next(iter(base.values())).dtype
    if scale_layers is not None:
        for n in base:
            if n.endswith(_RESIDUAL_OUT):
                base[n] = base[n] * scale_layers
    shutil.copytree(src, dst, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.safetensors", INDEX_FILE, "config.json"))
    heads = mtp_tensors(config, base, depths, seed, init, dtype)
    config = _with_depths(config, depths)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    base_file = "model-main.safetensors"
    save_file(base, str(dst / base_file))
    save_file(heads, str(dst / MTP_FILE))
    weight_map = {n: base_file for n in base} | {n: MTP_FILE for n in heads}
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (dst / SINGLE_FILE).unlink(missing_ok=True)
    return dst
