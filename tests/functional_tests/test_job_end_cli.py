"""The main job's ranks end together (2 data-parallel CPU ranks, gloo + ZMQ): when rank 0 ends, the
other rank exits with rank 0's status and one line on stderr, never a traceback, whether rank 0
ends while it still steps or after both finished; a rank 0 killed mid-run still makes it fail
with the lost connection named."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_ranks

JOB_ARGS = ["--num-requests", "6", "--prompt-len-min", "4", "--prompt-len-max", "12", "--output-len-min", "6",
            "--output-len-max", "10", "--block-size", "4", "--num-kv-blocks", "64", "--max-requests", "3",
            "--max-tokens", "16", "--quiet", "--device", "cpu", "--default-model", "tiny-moe",
            "--expert-parallel-size", "2"]


def _job(rank: int, world: int, out_dir: str, extra: list[str], rank_0: str) -> int:
    """``cli_main`` as the example runs it, this rank's stderr in a file. ``rank_0``: "runs" to the
    end, "stops" after its first step (a timed-out run: exit status 1), "dies" there (exit 9)."""
    from megatron_async.cli import driver, main_job

    err = os.open(f"{out_dir}/r{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    if rank == 0 and rank_0 == "stops":
        main_job.run_workload = functools.partial(driver.run_workload, deadline=0.0)  # breaks after a step
    elif rank == 0 and rank_0 == "dies":
        main_job.run_workload = _dies_after_a_step
    sys.argv = ["job", *JOB_ARGS, *extra]
    try:
        return main_job.cli_main("job")
    finally:
        sys.stderr.flush()


def _dies_after_a_step(*args):
    from megatron_async.cli import driver

    driver.run_workload(*args, deadline=0.0)
    os._exit(9)


def _stderr(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"r{rank}.err").read_text()


def test_rank_0_ending_mid_run_ends_the_other_rank_with_its_status(tmp_path):
    assert run_ranks(_job, 2, str(tmp_path), [], "stops", timeout_s=120) == [1, 1]
    err = _stderr(tmp_path, 1)
    assert "Traceback" not in err and "CommunicatorError" not in err
    ended = [line for line in err.splitlines() if "rank 0 ended the job" in line]
    assert len(ended) == 1 and ended[0].startswith("rank 1: rank 0 ended the job (exit status 1) in exchange #"), err


def test_rejected_requests_end_every_rank_with_rank_0s_status(tmp_path):
    """Prompts over --max-sequence-length: rank 0 reports them and exits 1; so does rank 1, saying why."""
    extra = ["--prompt-len-min", "30", "--prompt-len-max", "40", "--max-sequence-length", "32"]
    assert run_ranks(_job, 2, str(tmp_path), extra, "runs", timeout_s=120) == [1, 1]
    assert "rejected: request" in _stderr(tmp_path, 0)
    err = _stderr(tmp_path, 1)
    assert "Traceback" not in err and err.count("rank 1: rank 0 ended the job with exit status 1") == 1


def test_a_clean_run_ends_every_rank_with_0_silently(tmp_path):
    assert run_ranks(_job, 2, str(tmp_path), [], "runs", timeout_s=120) == [0, 0]
    assert "rank 0 ended" not in _stderr(tmp_path, 1)


def test_a_killed_rank_0_is_still_a_lost_connection(tmp_path):
    with pytest.raises(RuntimeError) as failed:
        run_ranks(_job, 2, str(tmp_path), [], "dies", timeout_s=120)
    report = str(failed.value)
    assert "rank 0 failed:\nexited with code 9" in report
    assert "CommunicatorError: rank 1: lost the connection to rank 0" in report
