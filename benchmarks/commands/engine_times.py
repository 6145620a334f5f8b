"""Engine runs on a GPU whose outputs the gpu tests assert (graphs == eager, speculative == plain,
batch invariance), timed here: step times per mode, tok/s and their ratios, one run per argument.
Tables may carry an equality column for orientation; the assertions are the tests' (pytest -m gpu
tests/functional_tests).

    python -m benchmarks engine-times --help                 # the runs
    python -m benchmarks engine-times hybrid-graphs [--requests 48] [--size small|tiny]
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine_times import NAMES, module  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks engine-times", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    runs = parser.add_subparsers(dest="run", required=True, metavar="RUN")
    for name in NAMES:
        mod = module(name)
        doc = mod.__doc__ or ""
        sub = runs.add_parser(name, help=textwrap.shorten(doc.split("\n\n")[0], 90), description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sub)
    args = parser.parse_args()
    module(args.run).run(args)


if __name__ == "__main__":
    main()
