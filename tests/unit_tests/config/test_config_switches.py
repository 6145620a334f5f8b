"""Each kernel / start-up switch of ``InferenceConfig`` reaches the code that uses it, as an
argument or an attribute of what was built from the config (no environment variable): an engine
built with the switch off hands "off" to its consumer, and where the path is observable on CPU
the consumer then takes the other one."""
from __future__ import annotations

import pytest
import torch

from megatron_async import LLM, InferenceConfig, SamplingParams
from megatron_async.kernels import fused_ops
from megatron_async.kernels.backends import KernelBackends

SMALL = dict(max_requests=4, max_tokens=64, max_sequence_length=128, attention_backend="torch")


def _record(monkeypatch, owner, name: str) -> list:
    """Calls of ``owner.name`` (args, kwargs), the function still run."""
    calls, real = [], getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def _generate(default_model: str = "tiny", **fields) -> LLM:
    llm = LLM(None, "cpu", "float32", InferenceConfig(**SMALL, **fields), default_model=default_model)
    llm.generate([[1, 2, 3, 4]], SamplingParams(num_tokens_to_generate=2, ignore_eos=True))
    return llm


@pytest.mark.parametrize("on", [True, False])
def test_split_linear_reaches_the_output_projections(monkeypatch, on):
    calls = _record(monkeypatch, fused_ops, "split_linear")
    llm = _generate(split_linear=on)
    assert llm.model.kernels.split_linear is on and llm.model.kernels.split_k is on
    assert calls and {args[3] for args, _ in calls} == {on}  # every block's output projection, every step


@pytest.mark.parametrize("on", [True, False])
def test_startup_switches_reach_the_runner_and_the_compile_workers(monkeypatch, on):
    from megatron_async.inference import triton_workers

    calls = _record(monkeypatch, triton_workers, "running")
    llm = _generate(startup_compile_workers=on, startup_kernel_lists=on)
    assert [args[2] for args, _ in calls] == [on]
    assert llm.runner.kernel_lists is on


@pytest.mark.parametrize("grouped_mm, triton_gemm", [(True, True), (False, True), (True, False)])
def test_moe_switches_reach_the_routed_experts(monkeypatch, grouped_mm, triton_gemm):
    from megatron_async.models.layers import moe

    calls = _record(monkeypatch, moe, "fused_experts")
    llm = _generate("tiny-moe", moe_grouped_mm=grouped_mm, moe_triton_grouped_gemm=triton_gemm)
    kernels = llm.model.kernels
    assert (kernels.moe_grouped_mm, kernels.moe_triton_grouped_gemm) == (grouped_mm, triton_gemm)
    assert calls and {args[-2:] for args, _ in calls} == {(grouped_mm, triton_gemm)}  # every MoE layer, every step


def test_split_k_needs_the_fused_kernels_and_the_switch():
    assert KernelBackends().split_k
    assert not KernelBackends(fused=False).split_k and not KernelBackends(split_linear=False).split_k
    x = torch.zeros(4, 8)
    assert fused_ops.split_linear(x, torch.zeros(8, 8), None, enabled=False) is None


@pytest.mark.parametrize("flags, field, value", [
    ([], "split_linear", True),
    (["--no-split-linear"], "split_linear", False),
    ([], "startup_compile_workers", True),
    (["--no-compile-workers"], "startup_compile_workers", False),
    ([], "startup_kernel_lists", False),
    (["--kernel-cache-dir", "kept"], "startup_kernel_lists", True),
    (["--kernel-cache-dir", "kept", "--no-kernel-lists"], "startup_kernel_lists", False),
    (["--kernel-lists"], "startup_kernel_lists", True),
    ([], "moe_grouped_mm", True),
    (["--no-moe-grouped-mm"], "moe_grouped_mm", False),
    ([], "moe_triton_grouped_gemm", True),
    (["--no-moe-triton-grouped-gemm"], "moe_triton_grouped_gemm", False),
    ([], "long_prefill_tiles", True),
    (["--long-prefill-tiles"], "long_prefill_tiles", True),
    (["--no-long-prefill-tiles"], "long_prefill_tiles", False),
    ([], "flashinfer_prefill", True),
    (["--no-flashinfer-prefill"], "flashinfer_prefill", False),
])
def test_command_line_flags_set_the_switches(flags, field, value):
    import argparse

    from megatron_async.cli.flags import add_engine_args, add_model_args, inference_config_from_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(["--max-requests", "4", "--max-tokens", "8", *flags])
    assert getattr(inference_config_from_args(args), field) == value
