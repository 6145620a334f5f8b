"""One table from a pytest JUnit XML report: a row per test file (passed / failed / skipped, seconds),
then the failures' first lines. Used by scripts/multigpu_validation.sh.

    python scripts/junit_table.py REPORT.xml [REPORT.xml ...] [--gpus N]   # several: one table of them all"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def rows(paths: list[str]) -> tuple[dict[str, dict[str, float]], list[str]]:
    per_file: dict[str, dict[str, float]] = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "s": 0.0})
    failures = []
    cases = [case for path in paths for case in ET.parse(path).getroot().iter("testcase")]
    for case in cases:
        name = case.get("classname", "").rsplit(".", 1)[-1] or "?"
        row = per_file[name]
        row["s"] += float(case.get("time", 0) or 0)
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            row["failed"] += 1
            failures.append(f"{name}::{case.get('name')}: {(bad.get('message') or '').splitlines()[0][:160] if bad.get('message') else ''}")
        elif case.find("skipped") is not None:
            row["skipped"] += 1
        else:
            row["passed"] += 1
    return dict(per_file), failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+")
    p.add_argument("--gpus", default="?")
    args = p.parse_args(argv)
    try:
        per_file, failures = rows(args.reports)
    except (OSError, ET.ParseError) as e:
        print(f"no report ({e}): the run ended before pytest wrote it")
        return 1
    print(f"| test file ({args.gpus} GPUs) | passed | failed | skipped | s |")
    print("|---|---|---|---|---|")
    for name, r in sorted(per_file.items()):
        print(f"| {name} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['s']:.0f} |")
    for line in failures:
        print(f"FAILED {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
