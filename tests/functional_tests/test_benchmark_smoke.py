"""The benchmark (--smoke on CPU), the profiler script, and the GPU-idle / roofline arithmetic."""
import json
import runpy
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_idle import device_events, device_intervals, idle_report, idle_share, profile_run, union_length
from benchmarks.roofline import (
    decode_floor, kv_bytes_per_token, mean_context_per_output_token, measure_copy_bandwidth, weight_bytes)
from benchmarks.side_by_side import main as benchmark_main
from megatron_async import LLM, InferenceConfig
from megatron_async import SamplingParams
from megatron_async.cli.driver import run_workload
from megatron_async.cli.workload import WorkloadRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("bench")
    results = benchmark_main(["--smoke", "--output-dir", str(out)])
    return {(r.mode, r.workload): r for r in results}, json.loads((out / "benchmark.json").read_text())


def test_smoke_runs_every_mode_and_workload_on_the_same_weights(smoke):
    results, _ = smoke
    modes = {"hf_generate", "hf_generate_static", "hf_generate_batch", "serial", "async", "serial_graphs", "async_graphs"}
    assert set(results) == {(m, w) for m in modes for w in ("greedy", "sampled")}
    for w in ("greedy", "sampled"):
        for m in ("async_graphs", "serial_graphs", "hf_generate_static"):
            assert results[m, w].status == "skipped"  # CPU
        expected = None
        for mode in ("hf_generate", "hf_generate_batch", "serial", "async"):
            r = results[mode, w]
            assert r.status == "ok", (mode, w, r.reason)
            assert r.output_tokens > 0 and r.output_tokens_per_s > 0 and r.settings
            expected = expected or r.output_tokens
            assert r.output_tokens == expected  # every mode produced every requested token
            assert set(r.ratio_to) == {"hf_generate", "hf_generate_batch"}
        # one checkpoint, float32: greedy HF and both engine modes agree token for token; sampled
        # engine modes agree (per-request seeds), HF samples from its own generator (not compared)
        assert results["serial", w].same_tokens_as_serial == results["async", w].same_tokens_as_serial == 1.0
        assert results["hf_generate", w].same_tokens_as_serial == (1.0 if w == "greedy" else None)
        for mode in ("serial", "async"):
            r = results[mode, w]
            assert r.mean_decode_step_ms > 0 and r.decode_floor_ms > 0
            assert r.step_over_floor == pytest.approx(r.mean_decode_step_ms / r.decode_floor_ms)
            assert r.mixed_floor_ms > 0 and r.mixed_over_floor == pytest.approx(r.mean_mixed_step_ms / r.mixed_floor_ms)
            assert r.run_idle_share is None and r.step_times  # CPU: no device timeline
            lat = r.latency_ms
            assert 0 < lat["ttft_p50_ms"] <= lat["ttft_p99_ms"] and 0 < lat["itl_p50_ms"] <= lat["itl_p99_ms"]
            assert r.first_step_ms > 0 and r.max_step_ms >= r.first_step_ms and r.slow_steps >= 0
        assert results["async", w].summary["overlap_ratio"] > 0.5 and results["serial", w].summary["overlap_ratio"] == 0
        # serial drains at every step that leaves work behind; launch-ahead rarely
        s, a = results["serial", w].summary, results["async", w].summary
        assert s["drains"] >= s["steps"] - s["requests"] and a["drains"] < s["drains"] / 2
    greedy = [results["serial", "greedy"].output_tokens_per_s, results["serial", "sampled"].output_tokens_per_s]
    assert all(x > 0 for x in greedy)


def test_smoke_report_json(smoke):
    _, report = smoke
    assert report["copy_bandwidth_GBps"] > 0 and report["mean_context"] > 0 and report["warmup_requests"] == 2
    assert [(m["mode"], m["workload"]) for m in report["modes"]][:3] == [
        ("hf_generate", "greedy"), ("hf_generate_static", "greedy"), ("hf_generate_batch", "greedy")]


def test_mode_subset_and_time_guard(tmp_path, capsys):
    benchmark_main(["--smoke", "--modes", "serial", "--max-minutes", "0", "--output-dir", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert [(m["mode"], m["workload"], m["status"]) for m in report["modes"]] == [
        ("serial", "greedy", "skipped"), ("serial", "sampled", "skipped")]
    assert "time budget" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark_main(["--smoke", "--modes", "nonsense"])
    with pytest.raises(SystemExit):
        benchmark_main(["--smoke", "--repeats", "0"])


def test_repeats_report_the_median_run_and_the_range(tmp_path):
    from benchmarks.bench_report import format_table

    results = benchmark_main(["--smoke", "--modes", "async", "--workloads", "greedy", "--repeats", "3",
                              "--output-dir", str(tmp_path)])
    (r,) = results
    assert r.status == "ok" and len(r.tokens_per_s_runs) == 3
    assert r.output_tokens_per_s == sorted(r.tokens_per_s_runs)[1]  # the median run's own numbers
    lo, hi = min(r.tokens_per_s_runs), max(r.tokens_per_s_runs)
    assert f"({lo:,.0f}-{hi:,.0f})" in format_table(results)
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert report["modes"][0]["tokens_per_s_runs"] == r.tokens_per_s_runs


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


def _launch(t0: float, busy: float, gap_after: float, snap_bytes: int = 64) -> tuple[list[dict], float]:
    """One launch on a fake device timeline: snapshot copy, a kernel, then ``gap_after`` idle."""
    ev = [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t0, "dur": 1.0,
           "args": {"bytes": snap_bytes}},
          {"ph": "X", "cat": "kernel", "name": "k", "ts": t0 + 1.0, "dur": busy - 1.0}]
    return ev, t0 + busy + gap_after


def test_idle_report_splits_launch_windows_and_never_clamps():
    events, t = [], 0.0
    # mixed launch: 10 busy + 30 idle; then three decode launches: 8 busy + 2 idle each
    for busy, gap in [(10.0, 30.0), (8.0, 2.0), (8.0, 2.0), (8.0, 0.0)]:
        ev, t = _launch(t, busy, gap)
        events += ev
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5.0, "dur": 0.5,
                   "args": {"bytes": 8}})  # another copy (other size): busy, but no launch boundary
    rep = idle_report(device_events({"traceEvents": events}, snapshot_bytes=64), [False, True, True, True])
    assert rep.snapshot_copies == rep.launches == 4
    # decode windows: [40, 50), [50, 60), [60, 68): idle 2 + 2 + 0 of 28
    assert rep.decode_idle_share == pytest.approx(4 / 28)
    assert rep.run_idle_share == pytest.approx(34 / 68)
    # a mismatch between copies and launches: the run share stays, the per-launch windows go
    bad = idle_report(device_events({"traceEvents": events}, snapshot_bytes=64), [True] * 3)
    assert bad.decode_idle_share is None and bad.run_idle_share == pytest.approx(34 / 68) and "launches" in bad.note


def test_idle_report_windows_start_at_the_staged_device_copy():
    """With a staging buffer, each launch's H2D copy runs early on a copy stream (inside the launch
    before) and a device-to-device copy of the same size starts the launch: the windows follow those."""
    events, t = [], 0.0
    for busy, gap in [(10.0, 30.0), (8.0, 2.0), (8.0, 0.0)]:
        ev, t = _launch(t, busy, gap)
        ev[0]["name"] = "Memcpy DtoD (Device -> Device)"
        events += ev + [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
                         "ts": ev[0]["ts"] - 4.0 if events else 0.0, "dur": 0.5, "args": {"bytes": 64}}]
    rep = idle_report(device_events({"traceEvents": events}, snapshot_bytes=64), [False, True, True])
    assert rep.snapshot_copies == rep.launches == 3
    # decode windows [40, 50) and [50, 58): idle 2 of 18 (the early H2D copies overlap busy time)
    assert rep.decode_idle_share == pytest.approx(2 / 18)


def test_profile_run_on_cpu_returns_no_report():
    llm = LLM(inference_config=InferenceConfig(num_kv_blocks=64, max_requests=8, max_tokens=64))
    reqs = [WorkloadRequest([1, 2, 3, 4], 5)]
    run, rep = profile_run(llm.engine, lambda: run_workload(llm.engine, reqs, lambda r: SamplingParams(
        top_k=1, num_tokens_to_generate=r.output_len, ignore_eos=True)))
    assert rep is None and run.output_tokens == 5


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


def test_profile_step_script_runs_every_mode(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["profile_step.py", "--device", "cpu", "--steps", "3", "--batch", "2",
                                     "--prompt-len", "4", "--num-kv-blocks", "32", "--output-dir", str(tmp_path)])
    runpy.run_path(str(ROOT / "benchmarks" / "commands" / "profile_step.py"), run_name="__main__")
    report = json.loads((tmp_path / "profile.json").read_text())
    assert set(report) == {"serial", "async"}
    for mode in report:
        assert report[mode]["decode_steps"] == 2 and report[mode]["idle"] is None  # CPU: no device timeline


def test_compile_counter_counts_builds_and_captures_and_restores_the_hook():
    from types import SimpleNamespace

    from benchmarks.compile_counter import CompileCounter

    knobs = pytest.importorskip("triton.knobs")
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw) and None
    graphs = SimpleNamespace(graphs={"a": 1})
    try:
        with CompileCounter(graphs) as cc:
            knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="k1"), key=1)  # what Triton calls on a miss
            graphs.graphs["b"] = 2
        assert (cc.triton_builds, cc.graph_captures, cc.kernels) == (1, 1, ["k1"])
        assert len(seen) == 1  # the hook that was there is still called, and restored afterwards
        assert knobs.runtime.jit_cache_hook is not cc._hook
    finally:
        knobs.runtime.jit_cache_hook = None


def test_roofline_counts_the_ssm_state_in_float32(tmp_path):
    """The engine keeps the SSM state in float32 whatever the model dtype (conv state: model dtype)."""
    from benchmarks.roofline import state_bytes_per_request
    from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

    path = make_tiny_hybrid_checkpoint("NemotronHForCausalLM", tmp_path / "nh")
    llm = LLM(str(path), dtype="bfloat16", inference_config=InferenceConfig(num_kv_blocks=8, max_requests=2))
    mamba = llm.context.mamba
    live = [t[0] for t in mamba.conv_states + mamba.ssm_states]  # one slot's state of every layer
    assert state_bytes_per_request(llm.model, torch.bfloat16) == sum(t.numel() * t.element_size() for t in live)
    assert {t.dtype for t in mamba.ssm_states} == {torch.float32}
