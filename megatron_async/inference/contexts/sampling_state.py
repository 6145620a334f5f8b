"""Per-request device state of the penalties, ``min_tokens``, ``logit_bias`` and the token bans
(``allowed_token_ids``, ``bad_words``): one row per active request.

A request with penalties or ``min_tokens`` holds a slot from admission to release / eviction
(like a Mamba state slot). Its row holds, over the vocabulary: the output token counts
(frequency / presence, and repetition together with the prompt mask), the prompt mask, and
the mask of stop ids that ``min_tokens`` suppresses, the logit bias (up to ``MAX_BIAS`` (id, value)
pairs; padding pairs add 0.0 to token 0), the mask of banned tokens, and for ``bad_words`` of
several tokens the last ``MAX_BAD_WORD_TOKENS - 1`` generated tokens and the words (each word's
last token is banned while its other tokens are the newest generated ones, vLLM's rule: see
``sampling.apply_bias_and_bans``). The row is filled at admission from the
host's tokens (one small H2D copy; a recompute after eviction refills it from prompt +
generated tokens) and afterwards advanced ON THE DEVICE by ``count_samples`` from each
launch's sampled ids, so a launch-ahead step already sees the token still in flight.
Rows that sample nothing, padding rows and requests without penalties point at the extra
padding slot, whose contents are never read for a real row. Tensors are allocated on first
use, so engines that never see a penalty pay no memory."""
from __future__ import annotations

import torch

from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.request import DynamicInferenceRequest


MAX_BIAS = 300
"""(id, value) pairs of a row's logit bias (OpenAI's limit on ``logit_bias`` entries)."""
MAX_BAD_WORDS = 16
"""``bad_words`` spellings of several tokens a request may give."""
MAX_BAD_WORD_TOKENS = 8
"""Tokens in one such spelling."""
ANY_TOKEN, NO_WORD = -1, -2
"""A word's prefix entries: ``ANY_TOKEN`` before its first token (matches anything, also the
history's padding, which is -1 too); ``NO_WORD`` fills unused words (never matches)."""


class SamplingStateSlots:
    def __init__(self, max_requests: int, vocab_size: int, device: DeviceFacade):
        self.vocab_size = vocab_size
        self.padding_slot = max_requests
        self.device = device
        self._free = list(range(max_requests - 1, -1, -1))
        self.counts: torch.Tensor | None = None  # [slots + 1, V] int32 output token counts
        self.prompt_mask: torch.Tensor | None = None  # [slots + 1, V] bool
        self.stop_mask: torch.Tensor | None = None  # [slots + 1, V] bool, masked while < min_tokens
        self.bias_ids: torch.Tensor | None = None  # [slots + 1, MAX_BIAS] int64
        self.bias_values: torch.Tensor | None = None  # [slots + 1, MAX_BIAS] float32
        self.banned: torch.Tensor | None = None  # [slots + 1, V] bool
        self.history: torch.Tensor | None = None  # [slots + 1, W] int64 newest generated tokens, -1 padded
        self.word_prefix: torch.Tensor | None = None  # [slots + 1, MAX_BAD_WORDS, W] int64, right-aligned
        self.word_last: torch.Tensor | None = None  # [slots + 1, MAX_BAD_WORDS] int64
        self.num_assigned = 0  # slots handed out (admissions and re-admissions)

    @property
    def allocated(self) -> bool:
        return self.counts is not None

    def ensure_allocated(self) -> None:
        """Allocate the rows (also called before capturing graphs that read them). Normal
        tensors even under inference mode (warm-up): admission later fills rows outside it."""
        if self.counts is None:
            shape, dev = (self.padding_slot + 1, self.vocab_size), self.device.device
            with torch.inference_mode(False):
                self.counts = torch.zeros(shape, dtype=torch.int32, device=dev)
                self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
                self.stop_mask = torch.zeros(shape, dtype=torch.bool, device=dev)
                self.banned = torch.zeros(shape, dtype=torch.bool, device=dev)
                self.bias_ids = torch.zeros(shape[0], MAX_BIAS, dtype=torch.int64, device=dev)
                self.bias_values = torch.zeros(shape[0], MAX_BIAS, dtype=torch.float32, device=dev)
                W = MAX_BAD_WORD_TOKENS - 1
                self.history = torch.full((shape[0], W), ANY_TOKEN, dtype=torch.int64, device=dev)
                self.word_prefix = torch.full((shape[0], MAX_BAD_WORDS, W), NO_WORD, dtype=torch.int64, device=dev)
                self.word_last = torch.zeros(shape[0], MAX_BAD_WORDS, dtype=torch.int64, device=dev)

    def assign(self, req: DynamicInferenceRequest) -> None:
        """Give ``req`` a slot (if its params need one) and fill it from its known tokens."""
        if not req.sampling_params.needs_sampling_slot or req.sampling_slot >= 0:
            return
        self.ensure_allocated()
        slot = req.sampling_slot = self._free.pop()
        self.num_assigned += 1
        prompt, gen, stops = req.prompt_tokens, req.generated_tokens, stop_ids(req)
        ids = torch.tensor(prompt + gen + stops, dtype=torch.int64).to(self.device.device, non_blocking=True)
        n_p, n_g = len(prompt), len(gen)
        counts, pmask, smask = self.counts[slot], self.prompt_mask[slot], self.stop_mask[slot]
        counts.zero_()
        pmask.zero_()
        smask.zero_()
        pmask.index_fill_(0, ids[:n_p], True)
        counts.index_add_(0, ids[n_p : n_p + n_g], torch.ones(n_g, dtype=torch.int32, device=ids.device))
        smask.index_fill_(0, ids[n_p + n_g :], True)
        self._fill_choices(slot, req)

    def _fill_choices(self, slot: int, req: DynamicInferenceRequest) -> None:
        """The row's logit bias and banned tokens (``allowed_token_ids``: all others)."""
        sp, dev = req.sampling_params, self.device.device
        bias = sorted((sp.logit_bias or {}).items())
        ids = torch.zeros(MAX_BIAS, dtype=torch.int64)
        values = torch.zeros(MAX_BIAS, dtype=torch.float32)
        if bias:
            ids[: len(bias)] = torch.tensor([int(t) for t, _ in bias])
            values[: len(bias)] = torch.tensor([float(v) for _, v in bias])
        self.bias_ids[slot].copy_(ids.to(dev, non_blocking=True))
        self.bias_values[slot].copy_(values.to(dev, non_blocking=True))
        banned = self.banned[slot]
        if sp.allowed_token_ids is not None:
            banned.fill_(True)
            banned.index_fill_(0, torch.tensor(list(sp.allowed_token_ids), dtype=torch.int64).to(dev), False)
        else:
            banned.zero_()
        if req.banned_ids:
            banned.index_fill_(0, torch.tensor(list(req.banned_ids), dtype=torch.int64).to(dev), True)
        self._fill_words(slot, req)

    def _fill_words(self, slot: int, req: DynamicInferenceRequest) -> None:
        """The row's multi-token ``bad_words`` and its newest generated tokens (one H2D copy)."""
        W = MAX_BAD_WORD_TOKENS - 1
        table = torch.full((MAX_BAD_WORDS + 1, W + 1), NO_WORD, dtype=torch.int64)
        table[:, W] = 0  # unused words add 0.0 to token 0
        for i, word in enumerate(req.banned_sequences):
            table[i, : W - len(word) + 1] = ANY_TOKEN
            table[i, W - len(word) + 1 :] = torch.tensor(word, dtype=torch.int64)
        recent = req.generated_tokens[-W:]
        table[MAX_BAD_WORDS, : W - len(recent)] = ANY_TOKEN
        if recent:
            table[MAX_BAD_WORDS, W - len(recent) : W] = torch.tensor(recent, dtype=torch.int64)
        table = table.to(self.device.device, non_blocking=True)
        self.word_prefix[slot].copy_(table[:MAX_BAD_WORDS, :W])
        self.word_last[slot].copy_(table[:MAX_BAD_WORDS, W])
        self.history[slot].copy_(table[MAX_BAD_WORDS, :W])

    def free(self, req: DynamicInferenceRequest) -> None:
        if req.sampling_slot >= 0:
            self._free.append(req.sampling_slot)
            req.sampling_slot = -1

    def count_samples(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """counts[slots[r], tokens[r]] += 1 on the device (graph-safe scatter-add)."""
        flat = slots * self.vocab_size + tokens
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        # and each slot's newest tokens move by one (rows without a slot write the padding slot)
        self.history[slots] = torch.cat((self.history[slots][:, 1:], tokens[:, None]), dim=1)


def stop_ids(req: DynamicInferenceRequest) -> list[int]:
    """Ids ``min_tokens`` suppresses: EOS (unless ignored) and single-token stop sequences."""
    ids = [seq[0] for seq in req.stop_sequences if len(seq) == 1]
    if not req.sampling_params.ignore_eos:
        ids.extend(sorted(req.eos_ids))
    return ids
