"""The share of an MoE model's routed experts that one decode step reads, measured through
routing replay. A decode step of B rows reads, in each MoE layer, the weights of the union of its
rows' top-k experts: with uniform routing E (1 - (1 - k/E)^B) of E experts, all but a few at
B = 128 for Qwen3-30B-A3B's 128 experts, top 8; a trained router concentrates and reads fewer."""
from __future__ import annotations

import numpy as np

from megatron_async.inference.request import SamplingParams
from megatron_async.models.layers.moe import MoEMixer


def moe_expert_counts(model) -> list[int]:
    """Experts of each MoE layer that records its routing, in routing-replay order."""
    mixers = sorted((m for m in model.modules() if isinstance(m, MoEMixer) and m.moe_layer is not None),
                    key=lambda m: m.moe_layer)
    return [m.experts.num_experts for m in mixers]


def decode_expert_share(llm, prompts: list[list[int]], batch: int) -> float | None:
    """Mean share, over MoE layers, of the experts that a decode step of ``batch`` rows routes to:
    the first ``batch`` prompts, each row's first generated token (greedy; its routing-replay row
    is ``len(prompt)``). None for a model without routed experts."""
    counts = moe_expert_counts(llm.model)
    if not counts:
        return None
    rows = prompts[:max(1, batch)]
    outs = llm.generate(rows, SamplingParams(temperature=0.0, num_tokens_to_generate=2, ignore_eos=True,
                                             return_routed_experts=True))
    bad = [o for o in outs if o.routed_experts is None or len(o.routed_experts) <= len(o.prompt_tokens)]
    if bad:
        raise RuntimeError(f"routing replay gave no decode row for {len(bad)} of {len(outs)} requests "
                           f"({bad[0].finish_reason}: {bad[0].error})")
    picks = np.stack([o.routed_experts[len(o.prompt_tokens)] for o in outs])  # [rows, moe layer, k]
    return float(np.mean([len(np.unique(picks[:, layer])) / n for layer, n in enumerate(counts)]))
