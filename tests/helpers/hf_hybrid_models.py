"""Tiny random Hugging Face hybrid checkpoints (NemotronH, Bamba, Mamba2) for parity tests.

Built from configs (no downloads), float32, ``initializer_range=0.2`` so greedy logit gaps
are wide. The Mamba parameters are then re-drawn so that the tests are sensitive to
carried state and stay clear of transformers' prefill/decode inconsistencies:

* slow decays (A in [-1, -0.1], step sizes ~0.05-0.3) so a state carried across prefill
  chunks or into decode really changes the outputs;
* dt kept far above ``time_step_min``: transformers' NemotronH prefill clamps dt at
  time_step_min but its torch decode step does not clamp at all (and Mamba2 / Bamba decode
  ignores ``time_step_limit``), so a dt below the limit would make HF disagree with itself;
* norm weights, biases and D perturbed away from 1 / 0 so a mis-mapped tensor shows.

Older transformers (e.g. 5.17) normalise the Mamba2 / Bamba gated RMSNorm over the whole
inner width, ignoring ``n_groups`` (mamba_ssm, NemotronH and transformers 5.23 normalise per
group). There, the Bamba / Mamba2 tiny configs default to one group, where both agree.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_models import perturb_norms_and_biases

HYBRID_ARCHS = ("NemotronHForCausalLM", "BambaForCausalLM", "Mamba2ForCausalLM")
_SHORT_NAMES = {"nemotron_h": "NemotronHForCausalLM", "bamba": "BambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}

_COMMON = {"vocab_size": 128, "hidden_size": 32, "initializer_range": 0.2}
TINY_DEFAULTS: dict[str, dict] = {
    # Mamba inner width 4 * 12 = 48 != expand * hidden (64): NemotronH ignores `expand`.
    "NemotronHForCausalLM": dict(
        hybrid_override_pattern="M*M-", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, mamba_num_heads=4, mamba_head_dim=12, ssm_state_size=8, n_groups=2,
        conv_kernel=4, chunk_size=4,
    ),
    "BambaForCausalLM": dict(
        num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=4, max_position_embeddings=512,
    ),
    "Mamba2ForCausalLM": dict(
        num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4, chunk_size=4,
    ),
}


def hybrid_arch(name: str) -> str:
    """Accept an HF architecture name or its model_type ("nemotron_h", "bamba", "mamba2")."""
    arch = _SHORT_NAMES.get(name, name)
    if arch not in HYBRID_ARCHS:
        raise ValueError(f"unknown hybrid architecture {name!r}; one of {HYBRID_ARCHS} or {tuple(_SHORT_NAMES)}")
    return arch


def hf_gated_norm_is_grouped() -> bool:
    """Whether the installed transformers' Mamba2 / Bamba gated RMSNorm honours n_groups."""
    import inspect

    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    return "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters


def make_tiny_hybrid_config(arch: str, **overrides):
    """A transformers config object of ``arch`` with tiny defaults, ``overrides`` applied."""
    import transformers

    arch = hybrid_arch(arch)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    defaults = dict(TINY_DEFAULTS[arch])
    if arch != "NemotronHForCausalLM" and not hf_gated_norm_is_grouped():
        defaults["mamba_n_groups" if arch == "BambaForCausalLM" else "n_groups"] = 1
    config = config_cls(**{**_COMMON, **defaults, **overrides})
    config.architectures = [arch]
    return config


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


@torch.no_grad()
def _redraw_mamba_params(model: torch.nn.Module, gen: torch.Generator) -> None:
    for name, module in model.named_modules():
        if not hasattr(module, "A_log"):
            continue
        heads = module.A_log.shape[0]
        module.A_log.copy_(torch.log(0.1 + 0.9 * torch.rand(heads, generator=gen)))
        module.D.copy_(1.0 + 0.5 * torch.randn(heads, generator=gen))
        module.dt_bias.copy_(_inverse_softplus(0.05 + 0.25 * torch.rand(heads, generator=gen)))
        # The last `heads` rows of in_proj produce dt: shrink them so softplus(dt + dt_bias)
        # stays near the chosen step sizes, far above time_step_min.
        module.in_proj.weight[-heads:] *= 0.25


@torch.no_grad()
def make_tiny_hybrid_checkpoint(arch: str, path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Build a seeded random float32 HF ``arch`` model and ``save_pretrained`` it to ``path``.

    ``overrides`` are config fields (e.g. ``tie_word_embeddings=True``,
    ``hybrid_override_pattern="M-M*"``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = make_tiny_hybrid_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    perturb_norms_and_biases(model, gen)
    _redraw_mamba_params(model, gen)
    root = Path(path)
    model.save_pretrained(root)
    return root
