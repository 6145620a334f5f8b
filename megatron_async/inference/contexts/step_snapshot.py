"""What the step snapshot holds: the one declaration of every per-token, per-row and per-sample
table the host fills for a step and the device reads (``bookkeeping_layout.BookkeepingLayout``
cuts the host buffer and its device view from it)."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.bookkeeping_layout import FieldSpec


def bookkeeping_fields(max_tokens: int, max_rows: int, max_blocks: int, max_samples: int | None = None,
                       speculative: bool = False, mamba: bool = False, lora: bool = False) -> list[FieldSpec]:
    """The single declaration of the step snapshot (host buffer and device view alike).

    A "sample" is one sampled position: one per row, plus one per draft of a verify row
    (``max_samples`` == ``max_rows`` without speculative decoding)."""
    T, R = max_tokens, max_rows
    S = max_rows if max_samples is None else max_samples
    fields = [
        FieldSpec("input_ids", torch.int64, (T,)),
        FieldSpec("prev_sample_idx", torch.int64, (T,)),  # -1: token known on CPU
        FieldSpec("positions", torch.int64, (T,)),
        FieldSpec("slot_mapping", torch.int64, (T,)),
        FieldSpec("token_to_row", torch.int32, (T,)),
        FieldSpec("cu_query_lens", torch.int32, (R + 1,)),
        FieldSpec("kv_lens", torch.int32, (R,)),
        FieldSpec("attention_row_order", torch.int32, (R,)),  # rows longest KV first (decode attention's launch order)
        FieldSpec("sample_token_idx", torch.int64, (S,)),
        FieldSpec("sample_position", torch.int64, (S,)),
        FieldSpec("seed", torch.int64, (S,)),
        FieldSpec("temperature", torch.float32, (S,)),
        FieldSpec("top_k", torch.int64, (S,)),
        FieldSpec("top_p", torch.float32, (S,)),
        FieldSpec("state_slots", torch.int64, (R,)),
        FieldSpec("has_initial_state", torch.bool, (R,)),
        FieldSpec("block_table", torch.int32, (R, max_blocks)),
        # penalties / min-p / min_tokens (see sampling_state.py)
        FieldSpec("sampling_slot", torch.int64, (S,)),
        FieldSpec("min_p", torch.float32, (S,)),
        FieldSpec("presence_penalty", torch.float32, (S,)),
        FieldSpec("frequency_penalty", torch.float32, (S,)),
        FieldSpec("repetition_penalty", torch.float32, (S,)),
        FieldSpec("suppress_stop", torch.bool, (S,)),
    ]
    if lora:  # each token's LoRA adapter slot, -1: the base model (contexts/lora_rows.py)
        fields.append(FieldSpec("lora_slot", torch.int32, (T,)))
    if mamba:  # a mixed step's Mamba rows: several-token rows first (see kernels/mamba_varlen_ops.py)
        fields.append(FieldSpec("mamba_row_order", torch.int64, (R,)))
    if speculative:  # see contexts/spec_state.py and speculative/verify.py
        fields += [
            # -1: input id from the host; 0: slot's last token; j: draft j; -2: padding of a uniform
            # verify row (input 0, K/V to the dummy block; see ``initialize_attention_state``)
            FieldSpec("spec_src", torch.int64, (T,)),
            FieldSpec("spec_slot", torch.int64, (R,)),
            FieldSpec("spec_owner_slot", torch.int64, (R,)),  # the request's slot, also for rows that sample nothing
            FieldSpec("spec_inflight", torch.bool, (R,)),  # positions assume full acceptance of a launch in flight
            FieldSpec("num_drafts", torch.int64, (R,)),
            FieldSpec("sample_base", torch.int64, (R,)),  # the row's first sample
            FieldSpec("sample_to_row", torch.int64, (S,)),
        ]
    return fields
