"""``--smoke`` gives a benchmark small defaults, and flags given beside it still win."""
import pytest

from benchmarks.commands import dp_routing, tp_scaling


def test_dp_routing_smoke_defaults_yield_to_flags():
    smoke = dp_routing.parse_args(["--smoke"])
    assert (smoke.conversations, smoke.turns, smoke.requests, smoke.window) == (8, 2, 2000, 64)
    given = dp_routing.parse_args(["--smoke", "--conversations", "16", "--requests", "500"])
    assert (given.conversations, given.requests, given.turns) == (16, 500, 2)
    assert dp_routing.parse_args([]).conversations == 64


def test_tp_scaling_smoke_defaults_yield_to_flags():
    smoke = tp_scaling.parse_args(["--smoke"])
    assert (smoke.device, smoke.model, smoke.batches, smoke.output_len) == ("cpu", "tiny", [1, 4], 6)
    given = tp_scaling.parse_args(["--smoke", "--batches", "2", "--output-len", "3"])
    assert (given.batches, given.output_len, given.model) == ([2], 3, "tiny")


def test_disagg_places_each_engine_on_its_gpu_with_the_others_visible(monkeypatch):
    from benchmarks.commands import disagg

    gpu = disagg.parse_args(["--device", "cuda"])
    assert (gpu.requests, gpu.min_prompt, gpu.max_prompt, gpu.output, gpu.max_requests) == (96, 2048, 8192, 256, 64)
    model, flags = disagg.engine_flags(gpu)
    assert "--cuda-graphs" in model and "qwen3-0.6b" in model and "--num-kv-blocks" not in flags
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert [disagg.placement(gpu, i) for i in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "4,5,6"},
                                                           {"CUDA_VISIBLE_DEVICES": "5,4,6"}]
    assert disagg.placement(disagg.parse_args([]), 1) == {} and "--num-kv-blocks" in disagg.engine_flags(
        disagg.parse_args(["--smoke"]))[1]
    shared = disagg.parse_args(["--device", "cuda", "--gpus", "1", "1", "--kv-transfer-backend", "ipc"])
    assert disagg.placement(shared, 0) == disagg.placement(shared, 1) == {"CUDA_VISIBLE_DEVICES": "5,4,6"}
    with pytest.raises(SystemExit):  # (one GPU cannot hold both ends of a NCCL group)
        disagg.parse_args(["--device", "cuda", "--gpus", "0", "0"])
