"""N-gram (prompt lookup) drafter, entirely on the device.

Each request keeps its token history (prompt + emitted tokens) in a device row of its spec
slot, filled at admission and extended by every step's emitted tokens. To draft, the last n
tokens (n = ``speculative_ngram_max`` down to 1) are looked up in the earlier history; at
the latest earlier occurrence, the tokens that followed it are proposed. When fewer than K
tokens follow before the present, the match is extended periodically (the continuation of
a repeated span is the span again). No match at all: the last token repeated (it will
likely be rejected, and the acceptance switch turns drafting off for such requests)."""
from __future__ import annotations

import torch

from megatron_async.inference.contexts.spec_state import SpecState
from megatron_async.inference.request import DynamicInferenceRequest
from megatron_async.inference.speculative.drafter import Drafter, TokenHistory, VerifyOutputs


class NGramDrafter(Drafter):
    name = "ngram"
    tracks_plain_steps = True

    def __init__(self, max_ngram: int, max_sequence_length: int):
        self.max_ngram = max_ngram
        self.max_sequence_length = max_sequence_length

    def bind(self, spec: SpecState) -> None:
        super().bind(spec)
        self.history = TokenHistory(spec, self.max_sequence_length)
        self._pos = torch.arange(self.history.length, device=spec.device.device)

    def on_admit(self, req: DynamicInferenceRequest, slot: int) -> None:
        self.history.fill(req, slot)

    def track(self, out: VerifyOutputs) -> None:
        self.history.record(out)  # the lookups of later drafts read every emitted token

    def propose(self, out: VerifyOutputs) -> torch.Tensor:
        K = self.spec.num_speculative_tokens
        L = self.history.length
        self.history.record(out)  # emitted (and later-overwritten) samples
        rows = self.history.tokens[out.slots]  # [R, L]
        last = out.last_pos.clamp(0, L - 1)  # newest known position of each row
        R = rows.shape[0]
        best_end = torch.full((R,), -1, dtype=torch.int64, device=rows.device)
        for n in range(1, self.max_ngram + 1):  # longer suffixes override shorter ones
            ends = self._match_ends(rows, last, n)
            best_end = torch.where(ends >= 0, ends, best_end)
        period = (last - best_end).clamp(min=1)
        m = torch.arange(K, device=rows.device)
        src = best_end[:, None] + 1 + m[None, :] % period[:, None]
        src = torch.where(best_end[:, None] >= 0, src, last[:, None])
        return rows.gather(1, src.clamp(0, L - 1))

    def _match_ends(self, rows: torch.Tensor, last: torch.Tensor, n: int) -> torch.Tensor:
        """[R]: the largest e < last with rows[e - n + 1 .. e] == rows[last - n + 1 .. last]; -1 if none."""
        ok = (self._pos[None, :] < last[:, None]) & (self._pos[None, :] >= n - 1)
        for q in range(n):  # compare token e - q with token last - q
            suffix = rows.gather(1, (last - q).clamp(min=0)[:, None])
            shifted = torch.roll(rows, shifts=q, dims=1)  # shifted[:, e] = rows[:, e - q]
            ok &= shifted == suffix
        ok &= last[:, None] >= n - 1
        return torch.where(ok, self._pos[None, :], torch.full_like(rows, -1)).amax(dim=1)
