"""The drafter a config asks for (``InferenceConfig.speculative_method``)."""
from __future__ import annotations

from megatron_async.config import InferenceConfig, SpeculativeMethod
from megatron_async.inference.speculative.drafter import Drafter
from megatron_async.inference.speculative.ngram import NGramDrafter


def build_drafter(config: InferenceConfig, model) -> Drafter:
    """"ngram": prompt lookup. "mtp": the model's MTP heads (``model.build_mtp_drafter()``,
    offered by models whose checkpoint has them)."""
    method = SpeculativeMethod(config.speculative_method)
    if method == SpeculativeMethod.NGRAM:
        return NGramDrafter(config.speculative_ngram_max, config.max_sequence_length)
    build = getattr(model, "build_mtp_drafter", None)
    drafter = build(config) if build is not None else None
    if drafter is None:
        raise ValueError(f"speculative_method 'mtp' needs a checkpoint with MTP heads; {type(model).__name__} has "
                         "none (use speculative_method='ngram')")
    return drafter
