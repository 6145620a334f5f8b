"""A drafter that knows each request's true continuation: tests and benchmarks only (it is no
``speculative_method``; inject it with ``LLM(..., drafter=...)``).

Built from a non-speculative run's outputs (prompt -> generated tokens), it proposes the
true next tokens, except that each (request, position) is corrupted with probability
``corrupt_rate`` by a hash of (request seed, position): acceptance per draft token is then
about ``1 - corrupt_rate``, the same in every mode and batch, and every accept / reject path
runs. Requests whose prompt it does not know get token 0 drafts (rejected). The corruption
rate is a device tensor and ``configure`` changes it and the continuations in place, so
CUDA graphs that captured ``propose`` follow a sweep over acceptance rates."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.spec_state import SpecState
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.sample_keys import mix32, row_keys
from megatron_async.inference.speculative.drafter import Drafter, VerifyOutputs, upload

_M24 = 1 << 24


class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt_rate: float, vocab_size: int,
                 max_generated: int):
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError(f"corrupt_rate must be in [0, 1], got {corrupt_rate}")
        self.continuations = continuations
        self.corrupt_rate = corrupt_rate
        self.vocab_size = vocab_size
        self.max_generated = max_generated

    def configure(self, continuations: dict[tuple[int, ...], list[int]], corrupt_rate: float) -> None:
        """New continuations (for requests admitted from now on) and corruption rate, in place."""
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError(f"corrupt_rate must be in [0, 1], got {corrupt_rate}")
        self.continuations, self.corrupt_rate = continuations, corrupt_rate
        if hasattr(self, "rate"):
            self.rate.fill_(corrupt_rate * _M24)

    def bind(self, spec: SpecState) -> None:
        super().bind(spec)
        dev = spec.device.device
        self.rate = torch.tensor(self.corrupt_rate * _M24, dtype=torch.float64, device=dev)
        M = self.max_generated + 1
        # a slot's row: its continuation (M), then its prompt length, known length and key, so
        # that an admission is one upload and one copy (a batch of 128 admits in the prefill steps)
        self.slots = torch.zeros(spec.num_slots, M + 3, dtype=torch.int64, device=dev)
        self.table = self.slots[:, :M]
        self.prompt_len, self.known_len, self.key = self.slots[:, M], self.slots[:, M + 1], self.slots[:, M + 2]

    def on_admit(self, req: DynamicInferenceRequest, slot: int) -> None:
        cont = list(self.continuations.get(tuple(req.prompt_tokens), []))[: self.max_generated]
        pad = [0] * (self.max_generated + 1 - len(cont))
        row = cont + pad + [len(req.prompt_tokens), len(cont), req.seed & ((1 << 62) - 1)]
        self.slots[slot] = upload(row, self.spec.device)

    def propose(self, out: VerifyOutputs) -> torch.Tensor:
        K = self.spec.num_speculative_tokens
        slots = out.slots
        q = out.last_pos[:, None] + 1 + torch.arange(K, device=slots.device)[None, :]  # draft positions
        gen = q - self.prompt_len[slots][:, None]
        valid = (gen >= 0) & (gen < self.known_len[slots][:, None])
        true = self.table[slots[:, None].expand_as(gen), gen.clamp(0, self.max_generated)]
        true = torch.where(valid, true, torch.zeros_like(true))
        h = mix32(row_keys(self.key[slots][:, None].expand_as(q), q) ^ 0x5BD1E995)
        corrupt = (h >> 8).to(torch.float64) < self.rate
        shift = 1 + (h % max(self.vocab_size - 1, 1))
        return torch.where(corrupt, (true + shift) % self.vocab_size, true)
