"""scripts/junit_table.py: the multi-GPU suite's one table counts each file's outcomes and fails on a failure."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.functional_tests.test_multigpu_ep" name="test_a[4-False]" time="12.5">
  <failure message="triton.runtime.errors.OutOfResources: out of resource: shared memory">tb</failure></testcase>
<testcase classname="tests.functional_tests.test_multigpu_ep" name="test_b" time="3.0"/>
<testcase classname="tests.functional_tests.test_multigpu_tp" name="test_c" time="1.0">
  <skipped message="needs 4 GPUs"/></testcase>
</testsuite></testsuites>"""


def test_table_counts_outcomes_per_file_and_fails_on_a_failure(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "junit_table.py"), str(report), "--gpus", "2"],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "| test_multigpu_ep | 1 | 1 | 0 | 16 |" in run.stdout
    assert "| test_multigpu_tp | 0 | 0 | 1 | 1 |" in run.stdout
    assert "FAILED test_multigpu_ep::test_a[4-False]: triton.runtime.errors.OutOfResources" in run.stdout


def test_missing_report_is_a_failure(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "junit_table.py"), str(tmp_path / "none.xml")],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "no report" in run.stdout


def test_several_reports_make_one_table(tmp_path):
    first, second = tmp_path / "a.xml", tmp_path / "b.xml"
    first.write_text(REPORT)
    second.write_text(REPORT.replace("test_multigpu_tp", "test_multigpu_ep"))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "junit_table.py"), str(first), str(second)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "| test_multigpu_ep | 2 | 2 | 1 | 32 |" in run.stdout
    assert "| test_multigpu_tp | 0 | 0 | 1 | 1 |" in run.stdout
