"""python -m benchmarks async-vs-serial on CPU: under KV-pool pressure with chunked prefill, the
launch-ahead engine builds exactly the serial engine's schedules (Scheduler.release_finishing);
without it the first differing launch is found and explained, and logits differ from there."""
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRESSURE = ["--smoke", "--num-requests", "8", "--prompt-len-min", "60", "--prompt-len-max", "200", "--output-len", "24",
            "--num-kv-blocks", "40", "--max-tokens", "64"]


@pytest.fixture(scope="module")
def diagnose():
    return runpy.run_path(str(ROOT / "benchmarks" / "commands" / "async_vs_serial.py"))["main"]


def test_launch_ahead_keeps_the_serial_schedule_under_memory_pressure(diagnose, tmp_path):
    rep = diagnose(PRESSURE + ["--output", str(tmp_path / "d.json")])
    serial = rep["serial_stats"]
    assert serial["paused"] > 0 and serial["evicted"] > 0 and serial["prefill_steps"] > 8  # pressure, chunks
    fixed, old = rep["async"], rep["async_without_release_ahead"]
    assert fixed["stats"]["overlapped_steps"] > 0.9 * fixed["stats"]["steps"]
    assert fixed["first_schedule_difference"] is None
    assert fixed["logit_keys"] > 100 and fixed["logit_keys_differing"] == 0  # bit-identical logits
    assert fixed["requests_equal"] == fixed["requests"] == 8
    # the engine before the fix: a launch scheduled while a finishing request still held blocks
    assert old["first_schedule_difference"] is not None
    assert "last token in flight" in old["schedule_difference_reason"]
    assert old["logit_keys_differing"] > 0
    assert (tmp_path / "d.json").stat().st_size > 0


def test_repeated_steps_are_bit_identical_and_gemm_rows_depend_on_batch(diagnose):
    rep = diagnose(["--smoke", "--no-old-async"])
    kinds = {r["kind"] for r in rep["repeats"]}
    assert kinds == {"mixed", "decode"}
    for r in rep["repeats"]:
        assert r["calls"] > 0 and r["differing"] == {} and r["tokens_equal_engine"], r
    assert rep["async"]["first_schedule_difference"] is None
    assert isinstance(rep["batch_variant"], list)  # printed: which kernels give other bits at other batch sizes
