"""Multi-token-prediction (MTP) heads in a checkpoint: how many depths its config declares and
the Hugging Face names of their tensors.

We use Qwen3-Next's names (``transformers`` drops them on load; vLLM's ``qwen3_next_mtp``
reads them): one ``mtp.fc`` (2H -> H, input ``[norm(embedding) | norm(hidden)]``), its two
input norms ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` and the output norm
``mtp.norm``, all shared by the depths, and per depth ``d`` one decoder layer
``mtp.layers.<d>.`` named like a layer of the host family (``input_layernorm``,
``self_attn.{q,k,v,o}_proj`` [+ ``q_norm`` / ``k_norm``], ``post_attention_layernorm``,
``mlp.*``). The LM head and the embedding are the main model's."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from megatron_async.models.model_config import LayerKind
from megatron_async.models.weight_loading import HFTarget, load_hf_weights

MTP_PREFIX = "mtp."
DEPTH_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
"""config.json fields that give the number of MTP depths (DeepSeek-V3 / NemotronH, Qwen3-Next,
transformers' attribute alias), first one present wins."""


def mtp_depths(hf_config: dict) -> int:
    """Number of MTP depths the checkpoint config declares (0: none)."""
    for key in DEPTH_KEYS:
        value = hf_config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"config.json: {key!r} must be a non-negative integer, got {value!r}")
        return value
    return 0


def mtp_layer_blocks(depth: int, mlp_kind: LayerKind) -> list[tuple[LayerKind, str, str]]:
    """(kind, HF norm path, HF mixer path) of the blocks of depth ``depth``'s decoder layer:
    attention, then the MLP (or MoE) mixer."""
    layer = f"mtp.layers.{depth}"
    return [(LayerKind.ATTENTION, f"{layer}.input_layernorm", f"{layer}.self_attn"),
            (mlp_kind, f"{layer}.post_attention_layernorm", f"{layer}.mlp")]


def mtp_hf_prefixes(num_depths: int, mlp_kind: LayerKind) -> dict[str, str]:
    """Our module paths under ``DecoderModel.mtp`` -> HF module paths."""
    names = {f"mtp.{n}": f"mtp.{n}" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    for d in range(num_depths):
        for i, (_, norm, mixer) in enumerate(mtp_layer_blocks(d, mlp_kind)):
            names[f"mtp.layers.{d}.{i}.norm"] = norm
            names[f"mtp.layers.{d}.{i}.mixer"] = mixer
    return names


def load_main_and_mtp(targets: dict[str, HFTarget], weights: Iterable[tuple[str, torch.Tensor]],
                      skip: Callable[[str], bool], canonical: Callable[[str], str], what: str, model=None) -> bool:
    """Load a checkpoint whose config declares MTP heads. The ``mtp.*`` tensors (small) are set
    aside while the main model streams in, then loaded; returns False, loading nothing more,
    when the checkpoint has none at all (a config that declares heads its weights lack: the
    model serves without them). Some but not all present: ValueError naming the missing ones."""
    heads: list[tuple[str, torch.Tensor]] = []

    def main_only(items):
        for name, tensor in items:
            if not skip(name) and canonical(name).startswith(MTP_PREFIX):
                heads.append((name, tensor))
            else:
                yield name, tensor

    load_hf_weights({n: t for n, t in targets.items() if not n.startswith(MTP_PREFIX)}, main_only(weights), skip,
                    canonical, what, model)
    if not heads:
        return False
    load_hf_weights({n: t for n, t in targets.items() if n.startswith(MTP_PREFIX)}, heads, skip, canonical,
                    f"{what} MTP heads", model)
    return True
