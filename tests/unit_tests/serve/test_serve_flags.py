"""python -m megatron_async.serve flags: the served name, argparse errors."""

import pytest

from megatron_async.cli.flags import inference_config_from_args
from megatron_async.serve.__main__ import build_parser, resolve_launch_ahead, served_name


def test_served_name_is_the_checkpoint_dir_unless_given(tmp_path):
    ckpt = tmp_path / "My-Model-7B"
    ckpt.mkdir()
    p = build_parser()
    assert served_name(p.parse_args(["--model", f"{ckpt}/"])) == "My-Model-7B"
    assert served_name(p.parse_args(["--model", str(ckpt), "--served-model-name", "m"])) == "m"
    args = p.parse_args([])
    args.default_model = "tiny"
    assert served_name(args) == "tiny"


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--port", "x"], ["--max-requests", "0"], ["--seed", "-1"],
                                   ["--max-request-bytes", "0"], ["--gil-switch-interval-ms", "0"],
                                   ["--api-server-count", "-1"], ["--priority-aging", "0"], ["--body-share", "x"]])
def test_bad_flags_are_argparse_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def test_server_flags_parse():
    args = build_parser().parse_args(["--max-request-bytes", "1000", "--gil-switch-interval-ms", "0.5"])
    assert args.max_request_bytes == 1000 and args.gil_switch_interval_ms == 0.5
    args = build_parser().parse_args([])
    assert args.max_request_bytes == 32 * 2**20 and args.gil_switch_interval_ms == 0.5  # DEFAULT_GIL_SWITCH_INTERVAL_MS
    assert args.api_server_count == 1 and build_parser().parse_args(["--api-server-count", "0"]).api_server_count == 0
    assert args.body_share == "auto" and inference_config_from_args(args).priority_aging == 16
    args = build_parser().parse_args(["--priority-aging", "5", "--body-share", "off"])
    assert inference_config_from_args(args).priority_aging == 5 and args.body_share == "off"


@pytest.mark.parametrize("flags, device, want", [
    ([], "cpu", False), (["--launch-ahead"], "cpu", True), (["--serial"], "cuda", False), ([], "cuda", True),
    (["--join", "tcp://127.0.0.1:1"], "cpu", True)])
def test_the_servers_own_engine_on_a_cpu_runs_serial_steps(flags, device, want):
    args = build_parser().parse_args(flags)
    args.device = device
    resolve_launch_ahead(args)
    assert inference_config_from_args(args).async_scheduling is want
