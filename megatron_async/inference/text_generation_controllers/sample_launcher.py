"""The device side of sampling in a step: penalties, the draw, the penalty-count update
(``SampleLauncher``: it enqueues the sampling.py / Triton ops a step runs).

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


class SampleLauncher:
    def __init__(self, backend: SamplingBackend | str, device: torch.device, state: SamplingStateSlots):
        self.backend = resolve_backend(backend, device)
        self.state = state

    @property
    def reads_model_dtype(self) -> bool:
        """The Triton kernels read bf16 / fp16 logits as float32 in registers (exact), so the
        step skips the [R, V] float32 copy: ~50 us and half the sampler's reads at 128 rows."""
        return self.backend == SamplingBackend.TRITON

    def penalties(self, g, R: int) -> PenaltyRows:
        st = self.state
        return PenaltyRows(g.sampling_slot[:R], g.presence_penalty[:R], g.frequency_penalty[:R],
                           g.repetition_penalty[:R], g.suppress_stop[:R], st.counts, st.prompt_mask, st.stop_mask)

    def __call__(self, logits: torch.Tensor, g, R: int, any_random: bool, filters: tuple[bool, bool, bool],
                 any_penalties: bool) -> torch.Tensor:
        """logits [R, V] (left unchanged; float32, or the model dtype when ``reads_model_dtype``)
        -> tokens [R] int64. ``g`` is the GPU view;
        the flags (``filters``: some row uses top-k, top-p, min-p) are host facts of the step
        that only skip work no row needs."""
        triton_path = self.backend == SamplingBackend.TRITON
        if any_penalties:
            pen = self.penalties(g, R)
            if triton_path:
                logits = _triton_sampling().apply_penalties(
                    logits, pen.slot, pen.counts, pen.prompt_mask, pen.stop_mask, pen.presence, pen.frequency,
                    pen.repetition, pen.suppress_stop)
            else:
                logits = sampling.apply_penalties_reference(logits, pen)
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
