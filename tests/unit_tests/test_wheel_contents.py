"""``pip install .`` installs the engine only: the wheel holds ``megatron_async/`` and its metadata,
and no benchmark, test, script or example code."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_only_the_package(tmp_path):
    # a copy of the checkout: a build/ left in it by an earlier build would add stale files to the wheel
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("megatron_async-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"megatron_async", next(t for t in tops if t.endswith(".dist-info"))}, tops
    assert not [n for n in names if n.startswith(("megatron_async/testing/", "megatron_async/tools/"))]
    assert "megatron_async/cli/main_job.py" in names and "megatron_async/serve/app.py" in names
    measuring = [n for n in names if Path(n).stem.startswith(("bench", "test_", "conftest"))]
    assert not measuring, measuring
