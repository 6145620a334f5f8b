"""The engine against Megatron-Core itself, one comparison for the CPU reference tests (gloo, fp32)
and the GPU ones (CUDA, bf16 and fp32): what a trainer sends (``sent_items``), the Hugging Face
tensors equivalent to a GPTModel's, converted here from Megatron-Core's own layout and not through
the engine's tables (``hf_tensors``), and the measurements both kinds of test assert on
(``RefitCheck``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33]
GREEDY_TOKENS = 8
BF16_TOL = 2.0 ** -3
"""bf16 log-prob tolerance: four bf16 ulps of a logit in [4, 8) (these models' logits reach about
6). Megatron-Core rounds its logits to bf16 (half an ulp, 2^-6) and the two forwards round every
activation at different points. Measured on CPU: engine vs Megatron-Core 0.035-0.038, each vs the
float32 forward of the same weights 0.027-0.045; one swapped query group moves them by 3.8-5.1."""


def unwrap(model):
    while hasattr(model, "module"):  # Float16Module / DDP
        model = model.module
    return model


def te_names(items: list[tuple]) -> list[tuple]:
    """The names a Transformer-Engine-spec trainer gives the same tensors: norms fused into the
    next linear, grouped experts' ``experts.linear_fc1.weight{j}``."""
    out = []
    for name, *rest in items:
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            j, part = tail.split(".", 1)
            name = f"{head}.{part}{j}"
        out.append((name, *rest))
    return out


def sent_items(model, te: bool = False) -> list[tuple]:
    """What this rank of a Megatron-Core job sends: its ``named_parameters()`` with their Shard
    (``weight_transfer.megatron_tensors``), the tensors themselves (no copy), under the
    Transformer-Engine spec's names with ``te``."""
    from megatron_async.weight_transfer import megatron_tensors

    items = megatron_tensors(model)
    return te_names(items) if te else items


_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_TOP_RENAMES = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """The HF Qwen3 / Qwen3-MoE tensors of a TP 1 / EP 1 local-spec GPTModel, by Megatron-Core's
    layout as its source states it: ``linear_qkv`` rows are, per query group, its query heads,
    then its key head, then its value head (``SelfAttention.get_query_key_value_tensors``), and
    ``linear_fc1`` is ``[gate; up]`` (the gated MLP's ``chunk(2)``). Views, no copies."""
    model = unwrap(model)
    c = model.config
    groups, per = c.num_query_groups, c.num_attention_heads // c.num_query_groups
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if name in _TOP_RENAMES:
            out[_TOP_RENAMES[name]] = t
            continue
        layer, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
        pre = f"model.layers.{layer}."
        rest = re.sub(r"^mlp\.experts\.local_experts\.(\d+)\.", r"mlp.experts.\1.", rest)
        if rest == "self_attention.linear_qkv.weight":
            g = t.view(groups, per + 2, c.kv_channels, t.shape[-1])
            out[pre + "self_attn.q_proj.weight"] = g[:, :per].reshape(-1, t.shape[-1])
            out[pre + "self_attn.k_proj.weight"] = g[:, per].reshape(-1, t.shape[-1])
            out[pre + "self_attn.v_proj.weight"] = g[:, per + 1].reshape(-1, t.shape[-1])
        elif rest.endswith("linear_fc1.weight"):
            base = rest[: -len("linear_fc1.weight")]
            out[pre + base + "gate_proj.weight"], out[pre + base + "up_proj.weight"] = t.chunk(2)
        elif rest.endswith("linear_fc2.weight"):
            out[pre + rest[: -len("linear_fc2.weight")] + "down_proj.weight"] = t
        else:
            out[pre + _LAYER_RENAMES[rest]] = t
    return out


def log_probs_of(logits: torch.Tensor, prompt: list[int] = PROMPT) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1 from a forward's logits [len(prompt), vocab]."""
    lp = torch.log_softmax(logits.float(), -1)
    return [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


def engine_log_probs(llm, prompt: list[int] = PROMPT) -> list[float]:
    from megatron_async import SamplingParams

    out = llm.generate([prompt], SamplingParams(num_tokens_to_generate=0, return_prompt_log_probs=True))[0]
    return out.prompt_log_probs


def greedy_tokens(llm, prompt: list[int] = PROMPT) -> list[int]:
    from megatron_async import SamplingParams

    params = SamplingParams(top_k=1, num_tokens_to_generate=GREEDY_TOKENS, ignore_eos=True)
    return llm.generate([prompt], params)[0].generated_tokens


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == len(PROMPT) - 1, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


@dataclass
class RefitCheck:
    """Largest prompt log-prob differences (``want``: Megatron-Core's forward)."""
    before: float
    """The engine with its own unrelated weights vs ``want``: the comparison can tell them apart."""
    after: float
    """After the update vs ``want``."""
    version: int
    fresh: float | None = None
    """A fresh engine loaded from ``hf_tensors`` (written as a checkpoint) vs ``want``."""
    updated_vs_fresh: float | None = None
    tokens_equal: bool | None = None
    """Greedy tokens of the updated engine == the fresh engine's."""
    mcore_vs_float32: float | None = None
    """bf16: Megatron-Core's own forward vs its float32 forward of the same weights (its rounding)."""
    engine_vs_float32: float | None = None
    """bf16: the updated engine vs that float32 forward."""
    graph_replays: int | None = None
    """CUDA: graph replays of the updated engine (the update reached the captured graphs)."""
    seed: int | None = None

    HEADER = ("| case | seed | before | after | fresh HF checkpoint | updated vs fresh | tokens equal "
              "| Megatron-Core bf16 vs fp32 | engine vs fp32 | graph replays |")

    def row(self, case: str) -> str:
        """``HEADER`` and this check as a row under it, on lines of their own (pytest -s prints progress
        dots): ``grep '^| ' LOG | awk '!seen[$0]++'`` gathers a run's table."""
        cells = [self.seed, self.before, self.after, self.fresh, self.updated_vs_fresh, self.tokens_equal,
                 self.mcore_vs_float32, self.engine_vs_float32, self.graph_replays]
        return f"\n{self.HEADER}\n| " + " | ".join([case] + ["-" if v is None else f"{v:.2e}" if isinstance(v, float) else str(v)
                                          for v in cells]) + " |"

    def assert_within(self, tol: float) -> None:
        assert self.before > max(1e-2, 10 * tol), self  # unrelated weights before the update
        assert self.version == 1, self  # Megatron-Core names detected, one update
        assert self.after < tol, self
        if self.fresh is not None:
            assert self.fresh < tol and self.updated_vs_fresh < tol and self.tokens_equal, self
        if self.engine_vs_float32 is not None:  # bf16: both sides rounded indeed, the engine near exact
            assert self.mcore_vs_float32 > 1e-4 and self.after > 1e-4 and self.engine_vs_float32 < tol, self
        if self.graph_replays is not None:
            assert self.graph_replays > 0, self


def refit(llm, update: Callable[[], int], want: list[float]) -> RefitCheck:
    """``update()`` (``update_weights`` / ``update_weights_from_ipc``) measured against ``want``."""
    before = max_diff(engine_log_probs(llm), want)
    version = update()
    return RefitCheck(before=before, after=max_diff(engine_log_probs(llm), want), version=version)


def against_fresh(check: RefitCheck, llm, fresh, want: list[float]) -> RefitCheck:
    """``check`` with the fresh engine's log-probs and greedy tokens compared."""
    got, fresh_lp = engine_log_probs(llm), engine_log_probs(fresh)
    check.fresh, check.updated_vs_fresh = max_diff(fresh_lp, want), max_diff(got, fresh_lp)
    check.tokens_equal = greedy_tokens(llm) == greedy_tokens(fresh)
    return check
