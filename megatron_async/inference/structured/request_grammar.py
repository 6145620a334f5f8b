"""One request's grammar state: the tokens it generated so far, as its grammar library sees them.

A grammar advances only by tokens the request book landed (``accept``), so its state is a
function of the request's generated tokens alone: the same in serial and launch-ahead mode, and
unchanged by a pause, an eviction (the generated tokens stay) or a recompute. ``fill`` writes the
mask of the next position into one row of an int32 bitmask (bit ``t % 32`` of word ``t // 32``
set: token t is allowed) and does not change the state.

The grammar's end is an ordinary stop: where the output may end, the mask allows the request's
stop ids (the backend's EOS ids, or the request's own ``termination_id``), the request samples
one and finishes with "stop". ``GuidanceGrammar`` (guidance_backend.py) and ``XGrammarGrammar``
(xgrammar_backend.py) wrap the libraries' matchers."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a server's front-end processes check specs without loading torch
    import torch


class BaseGrammar:
    def __init__(self, backend, stop_ids=None):
        """``backend``: the library's side (its ``eos_ids``); ``stop_ids``: the ids that end this
        request (None: the backend's EOS ids)."""
        self.backend = backend
        stop = tuple(sorted(set(int(s) for s in stop_ids))) if stop_ids is not None else backend.eos_ids
        self.stop_ids = None if stop == backend.eos_ids else stop
        """None: the backend's EOS ids are the request's; else the ids allowed where the output may end."""
        self.num_accepted = 0
        """Generated tokens the grammar has advanced by."""
        self.ended = False
        """A stop id was accepted: nothing may follow."""

    # the library's side
    def _consume(self, token: int) -> bool:
        raise NotImplementedError

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    def accept(self, tokens) -> bool:
        """Advance by landed tokens; False when the grammar refuses one (the request fails: the
        mask never allows a refused token, so only a contradiction with other bans, which
        leaves no token allowed, can land one)."""
        for t in tokens:
            t = self.library_token(int(t))
            if self.ended or not self._consume(t):
                return False
            self.advanced(t)
        return True

    def library_token(self, t: int) -> int:
        """``t`` as the library knows it: its end is the backend's EOS, not the request's stop ids."""
        return self.backend.eos_ids[0] if self.stop_ids is not None and t in self.stop_ids else t

    def advanced(self, t: int) -> None:
        """The library consumed ``t`` (a ``library_token``)."""
        self.num_accepted += 1
        self.ended = t in self.backend.eos_ids

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next position's mask into ``bitmask[row]`` (CPU int32, contiguous)."""
        if self.ended:
            bitmask[row] = -1
            return
        self._fill(bitmask, row)
        self.fix_stop_bits(bitmask, row)

    def fix_stop_bits(self, bitmask: torch.Tensor, row: int) -> None:
        """Where the library allowed its EOS ids, allow the request's own stop ids instead."""
        if self.stop_ids is None:
            return
        end = any(allows(bitmask, row, e) for e in self.backend.eos_ids)
        for e in self.backend.eos_ids:
            set_bit(bitmask, row, e, False)
        for s in self.stop_ids:
            set_bit(bitmask, row, s, end)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row over ``vocab_size`` token ids."""
    return (vocab_size + 31) // 32


def allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def set_bit(bitmask: torch.Tensor, row: int, token: int, on: bool) -> None:
    w = int(bitmask[row, token // 32]) & 0xFFFFFFFF
    w = w | (1 << (token % 32)) if on else w & ~(1 << (token % 32))
    bitmask[row, token // 32] = w - (1 << 32) if w >= 1 << 31 else w
