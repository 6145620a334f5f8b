"""The main job (examples/gpt_dynamic_inference.py and friends) and its shared workload/driver code."""
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.cli.driver import StatsWindow, run_workload
from megatron_async.cli.main_job import main
from megatron_async.cli.progress import ProgressBar
from megatron_async.cli.workload import WorkloadRequest, WorkloadSpec, arrival_steps, file_workload, synthetic_workload

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-requests", "6", "--prompt-len-min", "4", "--prompt-len-max", "12", "--output-len-min", "3",
         "--output-len-max", "9", "--quiet", "--device", "cpu", "--num-kv-blocks", "64"]  # not the 1 GB CPU default


def _greedy(req: WorkloadRequest) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=req.output_len, ignore_eos=True)


def test_arrival_steps_poisson_and_seeded():
    assert arrival_steps(5, 0.0, np.random.default_rng(0)) == [0] * 5
    a = arrival_steps(400, 2.0, np.random.default_rng(1))
    assert a == arrival_steps(400, 2.0, np.random.default_rng(1))
    assert a == sorted(a) and len(a) == 400
    assert 150 <= a[-1] <= 250  # ~200 steps for 400 requests at 2 per step


def test_synthetic_workload_ranges_and_seed():
    spec = WorkloadSpec(50, 3, 7, 2, 4, arrival_rate=1.0, seed=3)
    w = synthetic_workload(spec, vocab_size=11)
    assert w == synthetic_workload(spec, vocab_size=11)
    assert all(3 <= len(r.prompt) <= 7 and 2 <= r.output_len <= 4 for r in w)
    assert all(0 <= t < 11 for r in w for t in r.prompt)
    assert {len(r.prompt) for r in w} == set(range(3, 8))
    with pytest.raises(ValueError):
        WorkloadSpec(1, 5, 4, 1, 1).validate()


def test_run_workload_arrivals_rejections_and_stats_window():
    llm = LLM(inference_config=InferenceConfig(max_sequence_length=64, num_kv_blocks=64, max_requests=8, max_tokens=64))
    warm = [WorkloadRequest([1, 2, 3], 2)]
    run_workload(llm.engine, warm, _greedy)
    window = StatsWindow(llm.engine)
    reqs = synthetic_workload(WorkloadSpec(10, 4, 10, 2, 6, arrival_rate=0.7, seed=0), llm.model.vocab_size)
    reqs.insert(3, WorkloadRequest(list(range(1, 70)), 4))  # longer than max_sequence_length: rejected
    run = run_workload(llm.engine, reqs, _greedy)
    assert not run.timed_out and not llm.engine.has_unfinished_requests()
    assert run.outputs[3].finish_reason == "error" and "max_sequence_length" in run.outputs[3].error
    for req, out in zip(reqs[:3] + reqs[4:], run.outputs[:3] + run.outputs[4:]):
        assert out.prompt_tokens == req.prompt and len(out.generated_tokens) == req.output_len
    stats = window.stats()
    assert stats.finished_requests == 10  # the warm-up request is not counted
    assert run.output_tokens == stats.generated_tokens == sum(r.output_len for i, r in enumerate(reqs) if i != 3)
    assert len(run.steps) == stats.steps and all(s.seconds > 0 for s in run.steps)


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar(4, stream=stream, min_interval_s=0.0)
        bar.update(2, 10)
        bar.close()
    assert "\r[" in tty.getvalue() and "2/4 requests" in tty.getvalue()
    assert pipe.getvalue() == ""
    quiet = Tty()
    ProgressBar(4, enabled=False, stream=quiet).update(1, 1)
    assert quiet.getvalue() == ""


def test_main_job_default_args_on_cpu(tmp_path, capsys):
    out = tmp_path / "out.json"
    summary = main(["--device", "cpu", "--quiet", "--output-path", str(out)])
    printed = capsys.readouterr().out
    for key in ("output tokens/s", "mean decode step", "overlap ratio", "paused / evicted", "peak GPU memory"):
        assert key in printed
    data = json.loads(out.read_text())
    reqs = data["requests"]
    assert summary.requests == len(reqs) == 32 and summary.finished_requests == 32
    assert all(16 <= len(r["prompt_tokens"]) <= 64 and 16 <= len(r["generated_tokens"]) <= 32 for r in reqs)
    assert summary.output_tokens == sum(len(r["generated_tokens"]) for r in reqs) == data["stats"]["generated_tokens"]
    assert all(isinstance(r["generated_text"], str) for r in reqs)  # the tiny model's tokenizer decodes
    assert summary.overlap_ratio > 0.5 and summary.peak_gpu_memory_gb is None
    assert data["summary"]["decode_steps"] == summary.decode_steps > 0


def test_main_job_async_equals_serial_under_arrivals_and_memory_pressure(tmp_path):
    flags = ["--num-requests", "12", "--arrival-rate", "0.8", "--num-kv-blocks", "24", "--block-size", "8",
             "--max-requests", "8", "--temperature", "0.8", "--seed", "5", "--quiet", "--device", "cpu"]
    runs = {}
    for mode in ("async", "serial"):
        path = tmp_path / f"{mode}.json"
        summary = main(flags + ["--output-path", str(path)] + (["--serial"] if mode == "serial" else []))
        runs[mode] = (summary, [r["generated_tokens"] for r in json.loads(path.read_text())["requests"]])
    assert runs["async"][1] == runs["serial"][1]
    assert runs["async"][0].paused + runs["async"][0].evicted > 0  # the small pool really pressed
    assert runs["async"][0].overlap_ratio > 0 and runs["serial"][0].overlap_ratio == 0


def test_main_job_prompt_file_with_tiny_tokenizer(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello world! How are you today?\n\nThe quick brown fox\n")
    out = tmp_path / "out.json"
    summary = main(SMALL + ["--prompt-file", str(prompts), "--return-log-probs", "--output-path", str(out)])
    reqs = json.loads(out.read_text())["requests"]
    assert summary.requests == 2 and [r["prompt_text"] for r in reqs] == ["Hello world! How are you today?", "The quick brown fox"]
    assert all(len(r["generated_log_probs"]) == len(r["generated_tokens"]) for r in reqs)
    assert all(r["generated_text"] for r in reqs)


def test_prompt_file_needs_a_tokenizer(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    with pytest.raises(ValueError, match="tokenizer"):
        file_workload(prompts, None, WorkloadSpec(4, 1, 1, 1, 1))


def test_hybrid_example_runs_a_hybrid_checkpoint(tmp_path):
    from tests.helpers.hf_hybrid_models import make_tiny_hybrid_checkpoint

    ckpt = make_tiny_hybrid_checkpoint("nemotron_h", tmp_path / "hybrid")
    summary = main(SMALL + ["--model", str(ckpt)], require_model=True)
    assert summary.finished_requests == 6 and summary.output_tokens > 0
    with pytest.raises(SystemExit):
        main(SMALL, require_model=True)


def _run(cmd, **env):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_example_script_entry_point():
    proc = _run([sys.executable, "examples/gpt_dynamic_inference.py", *SMALL])
    assert proc.returncode == 0, proc.stderr
    assert "output tokens/s" in proc.stdout and "6/6 finished" in proc.stdout


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_launcher_world_size_one():  # NPROC=2 (TP=2) is tested in test_tensor_parallel.py
    proc = _run(["bash", "examples/run_torchrun.sh", *SMALL])
    assert proc.returncode == 0, proc.stderr
    assert "6/6 finished" in proc.stdout


@pytest.mark.parametrize("command", [["examples/gpt_dynamic_inference.py"], ["-m", "benchmarks", "side-by-side"]])
def test_help_renders(command, monkeypatch, capsys):
    """``python COMMAND --help`` run in this process (runpy, as the interpreter runs a script or
    ``-m``): --help ends in argparse before any engine is built, so no Python of its own to start
    (the script's own process: test_torchrun_launcher_world_size_one)."""
    import runpy

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [command[-1], *command[2:], "--help"])
    with pytest.raises(SystemExit) as done:
        if command[0] == "-m":
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / command[0]), run_name="__main__")
    out = capsys.readouterr()
    assert done.value.code in (0, None), out.err
    assert "--buffer-size-gb" in out.out


def test_wall_clock_poisson_arrivals_and_latency_percentiles():
    from megatron_async.cli.workload import arrival_times

    t = arrival_times(400, 50.0, np.random.default_rng(2))
    assert t[0] == 0.0 and t == sorted(t) and 6.0 <= t[-1] <= 10.0  # ~8 s for 400 requests at 50/s
    spec = WorkloadSpec(4, 3, 5, 3, 3, seed=1, request_rate=20.0)
    reqs = synthetic_workload(spec, vocab_size=64)
    assert reqs[0].arrival_time == 0.0 and reqs[-1].arrival_time > 0
    # the rate leaves the prompts of a seed unchanged (arrival times have their own generator)
    assert [r.prompt for r in synthetic_workload(WorkloadSpec(4, 3, 5, 3, 3, seed=1), 64)] == [r.prompt for r in reqs]
    late = [WorkloadRequest([1, 2, 3], 3), WorkloadRequest([4, 5, 6], 3, arrival_time=0.3)]
    llm = LLM(inference_config=InferenceConfig(num_kv_blocks=32, max_requests=4, max_tokens=32))
    run = run_workload(llm.engine, late, _greedy)
    assert run.wall_time >= 0.3 and run.output_tokens == 6  # the engine idled until the second arrival
    assert len(run.ttft) == 2 and len(run.itl) == 4  # 2 gaps per 3-token request
    lat = run.latency_ms()
    assert lat["ttft_p50_ms"] < 300 and lat["itl_p99_ms"] >= lat["itl_p50_ms"] > 0
    # summary and main job flag
    assert main(SMALL + ["--request-rate", "50"]).ttft_p99_ms is not None


def test_stats_window_rebases_consensus_totals():
    """The engine copies the consensus exchange's running totals into its stats: a window
    reports only the rounds and time since it opened."""
    from types import SimpleNamespace

    from megatron_async.inference.engines.engine_stats import EngineStats

    engine = SimpleNamespace(stats=EngineStats(consensus_rounds=5, consensus_time=1.5))
    window = StatsWindow(engine)
    engine.stats.consensus_rounds, engine.stats.consensus_time = 8, 2.0  # totals since engine start
    st = window.stats()
    assert st.consensus_rounds == 3 and st.consensus_time == pytest.approx(0.5)
