"""Host side of a landed verify row: which of its samples become tokens (pure)."""
from __future__ import annotations


def emitted_tokens(first_sample: int, accepted: int) -> range:
    """Sample indices a row emits, in order: its accepted drafts' positions plus the bonus.
    The host appends them one by one and stops at the first that finishes the request (EOS,
    stop word, length), dropping the rest."""
    return range(first_sample, first_sample + accepted + 1)
