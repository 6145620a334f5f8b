"""The main job's Megatron-style flags, parse-time checks, exit codes and error messages."""
import json
import sys

import pytest

from megatron_async.cli.main_job import build_parser, cli_main, main
from tests.helpers.chat_templates import save_chat_template
from tests.helpers.hf_models import make_tiny_checkpoint

BASE = ["--device", "cpu", "--quiet", "--top-k", "1", "--num-kv-blocks", "64"]  # not the CPU default's 1 GB pool a run
PROMPTS = ["--prompts", "Hello world! How are you today?", "The quick brown fox"]


def _run(tmp_path, *flags, name="out.json"):
    out = tmp_path / name
    summary = main(BASE + list(flags) + ["--output-path", str(out)])
    return summary, json.loads(out.read_text())["requests"]


def test_text_prompts_honour_termination_id_and_stop_words(tmp_path, capsys):
    _, free = _run(tmp_path, *PROMPTS, "--num-tokens-to-generate", "12", "--ignore-eos", name="free.json")
    assert [len(r["generated_tokens"]) for r in free] == [12, 12]
    tokens = free[0]["generated_tokens"]
    stop_id = tokens[4]
    _, cut = _run(tmp_path, *PROMPTS, "--num-tokens-to-generate", "12", "--termination-id", str(stop_id), name="cut.json")
    first = tokens.index(stop_id)
    assert cut[0]["generated_tokens"] == tokens[: first + 1] and cut[0]["finish_reason"] == "stop"
    assert "prompt: 'Hello world! How are you today?'" in capsys.readouterr().out  # answers are printed

    text = free[1]["generated_text"]
    word = text[len(text) // 2:len(text) // 2 + 3]
    _, stopped = _run(tmp_path, *PROMPTS, "--num-tokens-to-generate", "12", "--stop-words", word, name="stop.json")
    assert stopped[1]["finish_reason"] == "stop" and text.startswith(stopped[1]["generated_text"])
    assert word not in stopped[1]["generated_text"]


def test_text_prompts_without_a_length_run_to_eos_under_the_cap(tmp_path):
    from megatron_async.cli.text_prompts import TEXT_MAX_TOKENS

    _, reqs = _run(tmp_path, "--prompts", "hi there", "--max-sequence-length", "40", "--ignore-eos")
    room = 40 - len(reqs[0]["prompt_tokens"])
    assert room < TEXT_MAX_TOKENS and len(reqs[0]["generated_tokens"]) == room  # not a synthetic 16-32
    _, reqs = _run(tmp_path, "--prompts", "hi there", "--max-sequence-length", "40", "--output-len-max", "5",
                   "--ignore-eos", name="ranged.json")
    assert 1 <= len(reqs[0]["generated_tokens"]) <= 5  # an explicit range still draws


def test_synthetic_workloads_keep_exact_lengths_and_top_n_logprobs(tmp_path):
    summary, reqs = _run(tmp_path, "--num-requests", "4", "--num-tokens-to-generate", "7", "--termination-id", "3",
                         "--top-n-logprobs", "3", "--return-log-probs")
    assert all(len(r["generated_tokens"]) == 7 for r in reqs)  # EOS / termination id ignored
    assert all(len(r["generated_top_n_logprobs"]) == 7 and all(len(d) == 3 for d in r["generated_top_n_logprobs"])
               for r in reqs)
    assert summary.ttft_p50_ms is not None and 0 < summary.ttft_p50_ms <= summary.ttft_p99_ms
    assert summary.tpot_p50_ms is not None and 0 < summary.tpot_p50_ms <= summary.tpot_p99_ms
    assert summary.itl_p50_ms is not None and 0 < summary.itl_p50_ms <= summary.itl_p99_ms


def test_summary_shows_ttft_and_tpot(capsys):
    main(BASE + ["--num-requests", "3", "--num-tokens-to-generate", "5"])
    out = capsys.readouterr().out
    assert "TTFT" in out and "TPOT" in out and "inter-token latency" in out and "p99" in out


def test_startup_profile_from_the_process_start_is_printed_and_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "before"))  # restored after: the flag sets it
    out = tmp_path / "out.json"
    main(BASE + ["--num-requests", "2", "--num-tokens-to-generate", "3", "--kernel-cache-dir", str(tmp_path / "kc"),
                 "--output-path", str(out)])
    text = capsys.readouterr().out
    assert "start-up:" in text and "first token" in text and str(tmp_path / "kc") in text
    startup = json.loads(out.read_text())["startup"]
    assert startup["cache_dir"] == str(tmp_path / "kc")
    assert 0 < startup["entered_s"] <= startup["ready_s"] <= startup["first_token_s"]
    phases = startup["phases"]
    assert {"load", "engine"} <= set(phases) and all(p["seconds"] >= 0 for p in phases.values())
    assert sum(p["seconds"] for p in phases.values()) <= startup["total_seconds"] + 1e-6


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--min-p", "1.5"], "--min-p"),
    (["--presence-penalty", "3"], "--presence-penalty"),
    (["--num-tokens-to-generate", "0"], "--num-tokens-to-generate"),
    (["--num-tokens-to-generate", "2.5"], "--num-tokens-to-generate"),
    (["--max-requests", "0"], "--max-requests"),
    (["--chat"], "--chat"),
    (["--ignore-eos", "--stop-at-eos"], "--stop-at-eos"),
])
def test_bad_flags_are_argparse_errors(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(BASE + flags)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("which", ["main_job", "benchmark"])
def test_help_states_each_default_once(which):
    from benchmarks import side_by_side_args

    text = (build_parser("x") if which == "main_job" else side_by_side_args.build_parser()).format_help()
    assert "(default: None)" not in text and "default: False" not in text
    for block in text.split("\n  -")[1:]:
        assert block.count("default:") <= 1, block
    if which == "main_job":
        assert "--num-tokens-to-generate" in text and "(default: 1.0)" in text  # --temperature


def test_truncated_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(SystemExit) as e:
        main(BASE + ["--model", str(ckpt)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and str(weights) in err and "truncated" in err and "Traceback" not in err
    (ckpt / "config.json").write_text("{oops")
    with pytest.raises(SystemExit):
        main(BASE + ["--model", str(ckpt)])
    assert "config.json is not valid JSON" in capsys.readouterr().err


def test_rejected_requests_print_reasons_and_fail_the_exit_code(monkeypatch, capsys):
    long_prompt = "The quick brown fox jumps over the lazy dog " * 8
    monkeypatch.setattr(sys, "argv", ["job", *BASE, "--prompts", "hi", long_prompt, "--max-sequence-length", "48",
                                      "--num-tokens-to-generate", "4"])
    assert cli_main("job") == 1
    captured = capsys.readouterr()
    assert "1/2 finished (1 rejected)" in captured.out
    assert "rejected: request 1" in captured.err and "max_sequence_length 48" in captured.err
    monkeypatch.setattr(sys, "argv", ["job", *BASE, "--prompts", "hi", "--num-tokens-to-generate", "4"])
    assert cli_main("job") == 0


def test_chat_flag_renders_the_checkpoint_template(tmp_path, capsys):
    from megatron_async.models import load_tokenizer
    from megatron_async.models.chat_template import load_chat_template

    ckpt = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "chat", with_tokenizer=True, vocab_size=512)
    with pytest.raises(SystemExit) as e:
        _run(tmp_path, "--model", str(ckpt), "--prompts", "Hello there", "--chat")
    assert e.value.code == 1 and "has no chat template" in capsys.readouterr().err
    save_chat_template(ckpt)
    _, reqs = _run(tmp_path, "--model", str(ckpt), "--prompts", "Hello there", "--chat", "--num-tokens-to-generate", "3")
    text = load_chat_template(ckpt).render([{"role": "user", "content": "Hello there"}])
    assert reqs[0]["prompt_tokens"] == load_tokenizer(ckpt).encode(text, add_special_tokens=False)


def test_every_text_prompt_runs_unless_num_requests_caps_them(tmp_path):
    prompts = ["--prompts", *[f"prompt number {i}" for i in range(40)], "--num-tokens-to-generate", "2"]
    summary, _ = _run(tmp_path, *prompts)
    assert summary.requests == 40  # more than the CPU default of --num-requests (32)
    summary, _ = _run(tmp_path, *prompts, "--num-requests", "5")
    assert summary.requests == 5


def test_request_timing_percentiles():
    from megatron_async.cli.driver import RequestTiming
    from megatron_async.cli.summary import percentile

    t = RequestTiming(arrival=1.0)
    for n, when in ((0, 1.5), (1, 2.0), (1, 2.5), (2, 3.5)):
        t.record(n, when)
    t.finished = 3.5
    assert t.ttft == 1.0 and t.num_tokens == 4 and t.gaps == [0.5, 1.0, 0.0]
    assert t.tpot == 0.5  # (3.5 - 2.0) / 3
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_penalty_flags_reach_the_engine(tmp_path):
    flags = ("--num-requests", "3", "--num-tokens-to-generate", "12")
    _, plain = _run(tmp_path, *flags, name="plain.json")
    _, penalized = _run(tmp_path, *flags, "--repetition-penalty", "1.8", "--presence-penalty", "1.0",
                        name="pen.json")
    assert [r["prompt_tokens"] for r in plain] == [r["prompt_tokens"] for r in penalized]
    assert [r["generated_tokens"] for r in plain] != [r["generated_tokens"] for r in penalized]


@pytest.mark.parametrize("flags, graphs", [([], None), (["--cuda-graphs"], True), (["--eager"], False)])
def test_graph_and_memory_flags_reach_the_config(flags, graphs):
    """No flag leaves CUDA graphs to the device (on for CUDA); --eager turns them off."""
    from megatron_async.cli import flags as cli

    args = build_parser("t").parse_args(["--device", "cuda", *flags, "--gpu-memory-utilization", "0.8"])
    cli.resolve_device_args(args)
    cfg = cli.inference_config_from_args(args)
    assert cfg.cuda_graphs is graphs and cfg.for_device("cuda").cuda_graphs is (graphs is not False)
    assert cfg.for_device("cpu").cuda_graphs is bool(graphs)
    assert (cfg.gpu_memory_utilization, cfg.buffer_size_gb, cfg.num_kv_blocks) == (0.8, None, None)
    with pytest.raises(SystemExit):
        build_parser("t").parse_args(["--eager", "--cuda-graphs"])


@pytest.mark.parametrize("flags, max_tokens", [([], 256), (["--max-requests", "512"], 512),
                                               (["--max-tokens", "64", "--max-requests", "8"], 64)])
def test_cpu_default_chunk_keeps_streams_moving(flags, max_tokens):
    """On a CPU the main job and the server take 256-token steps (a long prompt's chunks stall
    running streams for at most one such step), never fewer than max_requests, unless given."""
    from megatron_async.cli import flags as cli

    args = build_parser("t").parse_args(["--device", "cpu", *flags])
    cli.resolve_device_args(args)
    assert cli.inference_config_from_args(args).max_tokens == max_tokens
