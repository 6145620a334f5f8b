"""python -m benchmarks: every module of benchmarks/commands/ is a subcommand (listed with its
summary when none is given), and a subcommand runs its module as ``__main__`` with the remaining
arguments."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_every_module_is_a_listed_subcommand():
    out = _run()
    assert out.returncode == 2, out.stderr
    names = sorted(p.stem.replace("_", "-") for p in (ROOT / "benchmarks" / "commands").glob("[!_]*.py"))
    listed = sorted(line.split()[0] for line in out.stderr.split("subcommands:\n")[1].splitlines())
    assert listed == names and len(names) >= 20, listed
    assert {"side-by-side", "ab", "load-test", "profile-step", "host-step"} <= set(listed)


def test_a_subcommand_gets_the_remaining_arguments():
    out = _run("host-step", "--help")
    assert out.returncode == 0, out.stderr
    assert "--rows" in out.stdout and "usage: host_step.py" in out.stdout
    bad = _run("no-such-thing")
    assert bad.returncode == 2 and "host-step" in bad.stderr


def test_kernel_times_and_engine_times_take_every_module():
    """kernel-times / engine-times: one argument per module of benchmarks/kernel_times/ and
    benchmarks/engine_times/, each module importable with its options."""
    import argparse

    from benchmarks import engine_times, kernel_times

    for package in (kernel_times, engine_times):
        modules = sorted(p.stem.replace("_", "-") for p in Path(package.__file__).parent.glob("[!_]*.py"))
        assert sorted(package.NAMES) == modules
        for name in package.NAMES:
            package.module(name).add_arguments(argparse.ArgumentParser())
