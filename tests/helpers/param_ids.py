"""Test ids for parameters that are large raw payloads."""
from __future__ import annotations


def short_bytes_id(value):
    """A bytes parameter over 40 bytes by its head and size, any other by pytest's own id. A test
    id holding a 200 KB payload is in the environment (PYTEST_CURRENT_TEST) of every process the
    test starts, over Linux's 128 KB limit for one variable (exec fails with E2BIG)."""
    if isinstance(value, bytes) and len(value) > 40:
        return f"{value[:24].decode('ascii', 'replace')}...({len(value)} bytes)"
    return None
