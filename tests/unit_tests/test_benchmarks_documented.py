"""Every measurement is reachable by a command that docs/PERFORMANCE.md quotes: each subcommand
of ``python -m benchmarks`` appears there as ``python -m benchmarks NAME``."""
from __future__ import annotations

from pathlib import Path

from benchmarks.__main__ import subcommands

ROOT = Path(__file__).resolve().parents[2]


def test_every_subcommand_is_quoted_in_performance_md():
    page = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    missing = [name for name in subcommands() if f"python -m benchmarks {name}" not in page]
    assert not missing, f"subcommands without a command in docs/PERFORMANCE.md: {missing}"
