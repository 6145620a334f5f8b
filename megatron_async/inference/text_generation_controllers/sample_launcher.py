"""The device side of sampling in a step: penalties, the draw, the penalty-count update and
the raw log-probs (``SampleLauncher``: it enqueues the sampling.py / Triton ops a step runs).

Chooses the backend once (torch reference or sort-free Triton; same tokens) and reads only
fixed-address tensors (the step snapshot and the sampling-state rows), so the whole thing
is captured inside decode CUDA graphs. Nothing here syncs with the host."""
from __future__ import annotations

import importlib.util

import torch

from megatron_async.config import SamplingBackend
from megatron_async.inference.contexts.sampling_state import SamplingStateSlots
from megatron_async.inference.text_generation_controllers import sampling
from megatron_async.inference.text_generation_controllers.sampling import PenaltyRows, RowParams
from megatron_async.kernels.token_mask import apply_token_bitmask


def resolve_backend(backend: SamplingBackend | str, device: torch.device) -> SamplingBackend:
    backend = SamplingBackend(backend)
    if backend == SamplingBackend.AUTO:
        on_cuda = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return SamplingBackend.TRITON if on_cuda else SamplingBackend.TORCH
    return backend


def _triton_sampling():
    """The Triton kernels, imported on first use (the torch backend needs no Triton)."""
    from megatron_async.kernels import triton_sampling

    return triton_sampling


def _triton_log_probs():
    from megatron_async.kernels import triton_log_probs

    return triton_log_probs


class SampleLauncher:
    def __init__(self, backend: SamplingBackend | str, device: torch.device, state: SamplingStateSlots):
        self.backend = resolve_backend(backend, device)
        self.state = state

    @property
    def reads_model_dtype(self) -> bool:
        """The Triton kernels read bf16 / fp16 logits as float32 in registers (exact), so the
        step skips the [R, V] float32 copy: ~50 us and half the sampler's reads at 128 rows."""
        return self.backend == SamplingBackend.TRITON

    def sample_with_log_probs(self, logits: torch.Tensor, g, R: int, shape, batch_invariant: bool, masks=None):
        """A step's samples: tokens [R] int64 and, when ``shape`` (its StepShape) asks for them,
        the raw log-probs and top-n (``sampling.log_probs_of``; else None, None, None). A greedy
        step without penalties or grammar masks on the Triton backend takes its tokens from the
        log-prob pass (the first index of each row's largest logit, as argmax): one read of the
        logits, not two (not in batch-invariant mode: its top-n keys order ``x - lse``).
        ``masks``: (bitmask, row map) of the step's grammar rows (``kernels/token_mask.py``)."""
        if not (shape.any_log_probs or shape.max_top_n > 0):
            return self(logits, g, R, shape.any_sampling, shape.filters, shape.any_penalties, masks), None, None, None
        if (self.backend == SamplingBackend.TRITON and masks is None
                and not (shape.any_sampling or shape.any_penalties or batch_invariant)
                and shape.max_top_n <= _triton_log_probs().MAX_TOP_N):
            tokens = torch.full((R,), -1, dtype=torch.int64, device=logits.device)  # -1: the row's best id
            return tokens, *_triton_log_probs().log_probs(logits, tokens, shape.max_top_n)
        tokens = self(logits, g, R, shape.any_sampling, shape.filters, shape.any_penalties, masks)
        return tokens, *sampling.log_probs_of(logits, tokens, shape.max_top_n, batch_invariant,
                                              triton=self.reads_model_dtype)

    def penalties(self, g, R: int) -> PenaltyRows:
        st = self.state
        return PenaltyRows(g.sampling_slot[:R], g.presence_penalty[:R], g.frequency_penalty[:R],
                           g.repetition_penalty[:R], g.suppress_stop[:R], st.counts, st.prompt_mask, st.stop_mask,
                           st.bias_ids, st.bias_values, st.banned, st.history, st.word_prefix, st.word_last)

    def __call__(self, logits: torch.Tensor, g, R: int, any_random: bool, filters: tuple[bool, bool, bool],
                 any_penalties: bool, masks=None) -> torch.Tensor:
        """logits [R, V] (left unchanged; float32, or the model dtype when ``reads_model_dtype``)
        -> tokens [R] int64. ``g`` is the GPU view;
        the flags (``filters``: some row uses top-k, top-p, min-p) are host facts of the step
        that only skip work no row needs. ``masks``: the grammar rows' (bitmask, row map), applied
        after the penalties (a forbidden token is -inf whatever its penalties)."""
        triton_path = self.backend == SamplingBackend.TRITON
        if any_penalties:
            pen = self.penalties(g, R)
            if triton_path:
                logits = _triton_sampling().apply_penalties(
                    logits, pen.slot, pen.counts, pen.prompt_mask, pen.stop_mask, pen.presence, pen.frequency,
                    pen.repetition, pen.suppress_stop)
            else:
                logits = sampling.apply_penalties_reference(logits, pen)
            logits = sampling.apply_bias_and_bans(logits, pen)
        if masks is not None:
            logits = apply_token_bitmask(logits, *masks, triton=triton_path)
        if not any_random:  # Triton: the same first-index argmax over (rows x chunks), 34 -> 20 us at 128 rows
            tokens = _triton_sampling().argmax(logits) if triton_path else logits.argmax(dim=-1)
        else:
            params = RowParams(g.temperature[:R], g.top_k[:R], g.top_p[:R], g.min_p[:R], g.seed[:R],
                               g.sample_position[:R])
            if triton_path:
                tokens = _triton_sampling().sample(logits.contiguous(), params.temperature, params.top_k, params.top_p,
                                                params.min_p, params.seed, params.position, filters)
            else:
                tokens = sampling.sample_reference(logits, params, any(filters))
        if any_penalties:  # the next launch, queued after this one, sees this token
            self.state.count_samples(g.sampling_slot[:R], tokens)
        return tokens
