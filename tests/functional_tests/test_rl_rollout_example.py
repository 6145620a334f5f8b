"""examples/rl_rollout_loop.py on the built-in tiny model (CPU, float32): rollouts, a trainer step,
in-place weight updates across a pause("keep"), engine log-probs equal to the trainer's
recomputation with the weights of each token's version. It must fail when the engine's weights
are not the trainer's, or when tokens do not say which version produced them."""
from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megatron_async import LLM
from megatron_async.inference.request import DynamicInferenceRequest

ARGS = ["--iterations", "2", "--num-prompts", "3", "--samples", "2", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def example():
    path = Path(__file__).resolve().parents[2] / "examples" / "rl_rollout_loop.py"
    spec = importlib.util.spec_from_file_location("rl_rollout_loop", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])  # MoE: the trainer's fused experts, renamed per expert
def test_rollout_loop_checks_pass(example, capsys, model):
    assert example.main(ARGS + ["--default-model", model]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["iteration", "requests", "tokens"]
    assert [line.split()[0] for line in lines[1:4]] == ["0", "1", "rest"]
    assert "v0:" in lines[2] and "v1:" in lines[2]  # requests that span the first update
    assert lines[-1].startswith("ok:") and "requests spanned an update" in lines[-1]
    assert max(float(line.split()[-2]) for line in lines[1:4]) <= 2e-5


def test_fails_when_the_engine_gets_other_weights(example, monkeypatch, capsys):
    update = LLM.update_weights

    def noisy(self, weights, *args, **kwargs):
        return update(self, [(n, t.detach() + 1e-3 * torch.randn_like(t)) for n, t in weights], *args, **kwargs)

    monkeypatch.setattr(LLM, "update_weights", noisy)
    assert example.main(ARGS) == 1
    assert "log-probs differ" in capsys.readouterr().out


def test_fails_when_tokens_do_not_record_their_version(example, monkeypatch, capsys):
    monkeypatch.setattr(DynamicInferenceRequest, "weight_versions", lambda self: [0] * len(self.generated_tokens))
    assert example.main(ARGS) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", "0.25"), ("float32", "1e-3")])
def test_rollout_loop_qwen3_0_6b_on_gpu(example, capsys, dtype, tolerance):
    """The built-in Qwen3-0.6B shape on CUDA (graphs, launch-ahead); the table shows the measured
    difference (different kernels on each side: a looser bound than CPU float32's)."""
    args = ["--default-model", "qwen3-0.6b", "--device", "cuda", "--dtype", dtype, "--tolerance", tolerance,
            "--num-prompts", "8", "--samples", "4", "--prompt-len", "64", "--max-new-tokens", "96"]
    gc.collect()  # the other dtype's engine and trainer (graphs hold reference cycles) leave the device
    torch.cuda.empty_cache()
    try:
        code = example.main(args)
    finally:  # and this one's, before the next test file builds its own engine
        gc.collect()
        torch.cuda.empty_cache()
    print(capsys.readouterr().out)
    assert code == 0
