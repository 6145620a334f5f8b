"""The benchmark (--smoke on CPU), the profiler script, and the GPU-idle / roofline arithmetic."""
import json
import runpy
from pathlib import Path

import pytest
import torch

from megatron_async import LLM, InferenceConfig
from megatron_async.tools.benchmark import main as benchmark_main
from megatron_async.tools.gpu_idle import device_intervals, idle_share, profile_decode_steps, union_length
from megatron_async.tools.roofline import (
    decode_floor, kv_bytes_per_token, mean_context_per_output_token, measure_copy_bandwidth, weight_bytes)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("bench")
    results = benchmark_main(["--smoke", "--output-dir", str(out)])
    return {r.mode: r for r in results}, json.loads((out / "benchmark.json").read_text())


def test_smoke_runs_every_mode_on_the_same_weights(smoke):
    results, _ = smoke
    assert set(results) == {"hf_generate", "hf_generate_batch", "serial", "async", "serial_graphs", "async_graphs"}
    assert results["async_graphs"].status == results["serial_graphs"].status == "skipped"  # CPU
    expected = None
    for mode in ("hf_generate", "hf_generate_batch", "serial", "async"):
        r = results[mode]
        assert r.status == "ok", (mode, r.reason)
        assert r.output_tokens > 0 and r.output_tokens_per_s > 0
        expected = expected or r.output_tokens
        assert r.output_tokens == expected  # every mode produced every requested token
        # one checkpoint, float32, greedy: HF and both engine modes agree token for token
        assert r.same_tokens_as_serial == 1.0, mode
        assert set(r.ratio_to) == {"hf_generate", "hf_generate_batch"}
    assert results["hf_generate"].ratio_to["hf_generate"] == pytest.approx(1.0)
    for mode in ("serial", "async"):
        r = results[mode]
        assert r.mean_decode_step_ms > 0 and r.decode_floor_ms > 0
        assert r.step_over_floor == pytest.approx(r.mean_decode_step_ms / r.decode_floor_ms)
        assert r.gpu_idle_share is None and r.step_times  # CPU: no device timeline
    assert results["async"].summary["overlap_ratio"] > 0.5 and results["serial"].summary["overlap_ratio"] == 0


def test_smoke_report_json(smoke):
    _, report = smoke
    assert report["copy_bandwidth_GBps"] > 0 and report["mean_context"] > 0
    assert [m["mode"] for m in report["modes"]] == ["hf_generate", "hf_generate_batch", "serial", "async", "serial_graphs", "async_graphs"]


def test_mode_subset_time_guard_and_main_job_dispatch(tmp_path, capsys):
    from megatron_async.tools.main_job import main as job_main

    assert job_main(["--benchmark", "--smoke", "--modes", "serial", "--max-minutes", "0",
                     "--output-dir", str(tmp_path)]) is None
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert [(m["mode"], m["status"]) for m in report["modes"]] == [("serial", "skipped")]
    assert "time budget" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark_main(["--smoke", "--modes", "nonsense"])


def test_union_and_idle_share():
    assert union_length([]) == 0.0 and idle_share([]) is None
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    # busy 0-3 and 5-6 over a 0-6 span: 2 of 6 idle
    assert idle_share([(5, 6), (0, 2), (1, 3)]) == pytest.approx(2 / 6)
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 10.0, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 20.0, "dur": 5.0},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 100.0},  # host work is not device busy time
        {"ph": "i", "cat": "kernel", "ts": 50.0},
    ]}
    assert device_intervals(trace) == [(10.0, 15.0), (20.0, 25.0)]
    assert idle_share(device_intervals(trace)) == pytest.approx(1 / 3)


def test_roofline_arithmetic():
    # prompt 10, 3 outputs: contexts 10, 11, 12 -> mean 11; prompt 4, 1 output: 4
    assert mean_context_per_output_token([10, 4], [3, 1]) == pytest.approx((10 + 11 + 12 + 4) / 4)
    llm = LLM(inference_config=InferenceConfig(num_kv_blocks=8))
    wb = weight_bytes(llm.model)
    assert wb == sum(p.numel() * 4 for p in llm.model.parameters())  # parameters() yields a tied tensor once
    kv = kv_bytes_per_token(llm.model, torch.float32)
    spec = llm.model.kv_cache_spec()
    assert kv == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    floor = decode_floor(llm.model, torch.float32, batch=4, mean_context=100.0, bandwidth=1e9)
    assert floor.seconds == pytest.approx((wb + 4 * 100 * kv) / 1e9)
    assert measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, iters=2) > 0


def test_profile_decode_window_on_cpu(tmp_path):
    llm = LLM(inference_config=InferenceConfig(num_kv_blocks=64, max_requests=8, max_tokens=64))
    prof = profile_decode_steps(llm.engine, batch=4, prompt_len=6, steps=5, warmup_steps=2,
                                trace_path=tmp_path / "t.json")
    assert (prof.batch, prof.steps, prof.decode_only_steps) == (4, 5, 5)
    assert prof.idle_share is None and not llm.engine.has_unfinished_requests()
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_profile_step_script_writes_traces(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["profile_step.py", "--device", "cpu", "--steps", "3", "--batch", "2",
                                     "--prompt-len", "4", "--warmup-steps", "1", "--num-kv-blocks", "32",
                                     "--output-dir", str(tmp_path)])
    runpy.run_path(str(ROOT / "scripts" / "profile_step.py"), run_name="__main__")
    report = json.loads((tmp_path / "profile.json").read_text())
    assert set(report) == {"serial", "async"}
    for mode in report:
        assert report[mode]["decode_only_steps"] == 3
        assert json.loads((tmp_path / f"trace_{mode}.json").read_text())["traceEvents"]


def test_event_idle_share_arithmetic():
    """Method 2 of gpu_idle: device time summed over timed launches against the window's wall."""
    import time as _time
    from types import SimpleNamespace

    from megatron_async.inference.engines.engine_stats import EngineStats
    from megatron_async.tools.gpu_idle import _event_idle_share

    class FakeEngine:
        def __init__(self):
            self.stats = EngineStats()
            self.time_all_launches = False
            self.context = SimpleNamespace(device=SimpleNamespace(synchronize=lambda: None))

        def step(self):
            _time.sleep(0.004)  # a step period of ~4 ms ...
            if self.time_all_launches:  # ... of which the device was busy 2 ms
                self.stats.timed_steps += 1
                self.stats.timed_device_time += 0.002

    eng = FakeEngine()
    share = _event_idle_share(eng, steps=25)
    assert 0.35 < share < 0.6 and eng.time_all_launches is False
