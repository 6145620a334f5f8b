"""The drafter a config asks for (``InferenceConfig.speculative_method``)."""
from __future__ import annotations

from megatron_async.config import Speculation, SpeculativeMethod
from megatron_async.inference.speculative.drafter import Drafter
from megatron_async.inference.speculative.mtp_drafter import MTPDrafter
from megatron_async.inference.speculative.ngram import NGramDrafter


def build_drafter(config: Speculation, model) -> Drafter:
    """"ngram": prompt lookup. "mtp": the model's MTP heads (models whose checkpoint has them:
    ``num_mtp_depths`` > 0); their KV layers are enabled here, so build the drafter before the
    KV pool is sized."""
    if config.speculative_method == SpeculativeMethod.NGRAM:
        return NGramDrafter(config.speculative_ngram_max, config.max_sequence_length)
    if getattr(model, "num_mtp_depths", 0) == 0:
        raise ValueError(f"speculative_method 'mtp' needs a checkpoint with MTP heads; {type(model).__name__} has "
                         "none (use speculative_method='ngram')")
    model.enable_mtp()
    return MTPDrafter(model, config.max_sequence_length)
