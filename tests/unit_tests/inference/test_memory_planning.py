"""KV pool planning on a GPU (memory_planning.py, memory_profiling.py) with a fake device-memory
reader, and the device-dependent defaults (CUDA graphs on CUDA only; CPU runs unchanged)."""
from __future__ import annotations

import pytest
import torch

from megatron_async import LLM
from megatron_async.config import InferenceConfig
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.memory_planning import GiB, MemoryPlanError, MemoryReading, check_weights_fit, plan_kv_pool
from megatron_async.inference.memory_profiling import profile_memory_plan
from megatron_async.inference.request import SamplingParams
from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner
from megatron_async.models import build_default_model

# Qwen3-30B-A3B in bf16 on an 80 GB H100: 48 layers x 4 KV heads x 128 dims, 16-token blocks
BLOCK_BYTES = 2 * 16 * 4 * 128 * 2 * 48
H100 = dict(total=80 * GiB, utilization=0.9, others=GiB // 2, weights=int(56.9 * GiB), resident=GiB // 10,
            peak_step=int(1.5 * GiB), graph_pools=int(1.5 * GiB), bytes_per_block=BLOCK_BYTES, block_size=16,
            max_sequence_length=4096, max_requests=128)


def test_plan_fills_the_budget_left_after_everything_else():
    plan = plan_kv_pool(**H100)
    left = int(0.9 * 80 * GiB) - (GiB // 2 + int(56.9 * GiB) + GiB // 10 + 2 * int(1.5 * GiB))
    assert plan.num_blocks == left // BLOCK_BYTES
    assert plan.kv_bytes <= left < plan.kv_bytes + BLOCK_BYTES
    assert plan.kv_tokens == (plan.num_blocks - 1) * 16
    assert plan.full_length_requests == (plan.num_blocks - 1) // 256  # 4096 tokens = 256 blocks
    assert 20 < plan.full_length_requests < 128
    line = plan.describe()
    for text in ("weights 56.90 GiB", "peak step 1.50 GiB", "graph pools 1.50 GiB", f"{plan.num_blocks:,} blocks",
                 f"{plan.kv_tokens:,} tokens", f"{plan.full_length_requests} concurrent requests of 4,096 tokens",
                 "gpu_memory_utilization 0.9 of 80.0 GiB"):
        assert text in line, (text, line)


def test_full_length_requests_capped_by_max_requests():
    assert plan_kv_pool(**{**H100, "max_requests": 4}).full_length_requests == 4


def test_model_that_cannot_fit_names_the_numbers():
    with pytest.raises(MemoryPlanError, match=r"model needs 93\.60 GiB .* device has 72\.00 GiB"):
        plan_kv_pool(**{**H100, "weights": 90 * GiB})
    with pytest.raises(MemoryPlanError, match=r"model needs 90\.00 GiB for its weights, device has 79\.00 GiB free"):
        check_weights_fit(90 * GiB, 80 * GiB, 79 * GiB)
    check_weights_fit(57 * GiB, 80 * GiB, 79 * GiB)


def test_utilization_without_room_for_one_request_is_an_error():
    # 0.758 x 80 GiB leaves ~0.14 GiB after the rest; one 4096-token request needs 257 x 1.5 MiB
    with pytest.raises(MemoryPlanError, match=r"gpu_memory_utilization 0.758 leaves 0\.\d\d GiB .* one request of "
                                              r"max_sequence_length 4,096 tokens needs 0\.38 GiB"):
        plan_kv_pool(**{**H100, "utilization": 0.758})


def test_no_attention_layers_get_one_block_per_position():
    plan = plan_kv_pool(**{**H100, "bytes_per_block": 0, "max_requests": 2})
    assert plan.num_blocks == 2 * 256 + 1


class FakeReader:
    """A device of ``total`` bytes whose readings are scripted: the probe step adds ``step``
    bytes above what is allocated when the peak is reset."""

    def __init__(self, total: int, free: int, allocated: int, reserved: int, step: int):
        self.total, self.free, self.allocated, self.reserved, self.step = total, free, allocated, reserved, step
        self.peak_resets = self.releases = 0

    def read(self) -> MemoryReading:
        peak = self.allocated + (self.step if self.peak_resets else 0)
        return MemoryReading(self.total, self.free, self.allocated, self.reserved, peak)

    def reset_peak(self) -> None:
        self.peak_resets += 1

    def release_cached(self) -> None:
        self.releases += 1


@pytest.mark.parametrize("graphs", [False, True])
def test_profile_runs_the_largest_step_and_plans_from_the_readings(monkeypatch, graphs):
    model = build_default_model("tiny", "cpu", torch.float32)
    cfg = InferenceConfig(block_size_tokens=4, max_requests=4, max_tokens=48, max_sequence_length=64, cuda_graphs=graphs)
    steps = []
    real = ModelRunner.compute_step
    monkeypatch.setattr(ModelRunner, "compute_step",
                        lambda self, shape, spec=None: steps.append(shape) or real(self, shape, spec))
    weights = 3 * GiB
    reader = FakeReader(total=16 * GiB, free=10 * GiB, allocated=weights + GiB, reserved=5 * GiB, step=GiB // 4)
    plan = profile_memory_plan(cfg, model, DeviceFacade("cpu"), torch.float32, weights, reader)
    [shape] = steps  # one probe step: every token of max_tokens, every row sampled with every feature
    assert (shape.num_tokens, shape.num_rows) == (48, 4)
    assert shape.any_penalties and shape.any_log_probs and shape.max_top_n > 0 and all(shape.filters)
    assert reader.peak_resets == 1 and reader.releases == 1
    assert plan.probe_build == ""  # no dry pass without CUDA: the step built its kernels as it met them
    spec = model.kv_cache_spec()
    block = 2 * 4 * spec.num_kv_heads * spec.head_dim * 4 * spec.num_layers
    assert plan.bytes_per_block == block
    assert (plan.weights, plan.peak_step, plan.others) == (weights, GiB // 4, 16 * GiB - 10 * GiB - 5 * GiB)
    assert plan.resident == GiB - 2 * block  # the probe's two KV blocks are not resident
    # graphs: one more step's peak, and the float32 logits the decode forward graphs keep (sizes 1, 2, 4)
    assert plan.graph_pools == (GiB // 4 + 7 * model.vocab_size * 4 if graphs else 0)
    assert plan.num_blocks == plan_kv_pool(
        total=16 * GiB, utilization=0.9, others=GiB, weights=weights, resident=plan.resident, peak_step=GiB // 4,
        graph_pools=plan.graph_pools, bytes_per_block=block, block_size=4, max_sequence_length=64,
        max_requests=4).num_blocks


def test_device_defaults_resolve_on_a_copy():
    cfg = InferenceConfig()
    cpu, cuda = cfg.for_device("cpu"), cfg.for_device("cuda")
    assert (cfg.cuda_graphs, cfg.buffer_size_gb) == (None, None)  # the caller's config is not changed
    assert (cpu.cuda_graphs, cpu.buffer_size_gb) == (False, 1.0)
    assert (cuda.cuda_graphs, cuda.buffer_size_gb) == (True, None)
    assert InferenceConfig(cuda_graphs=False).for_device("cuda").cuda_graphs is False  # enforce eager
    assert (cpu.speculative_adaptive, cuda.speculative_adaptive) == (False, True)
    explicit = InferenceConfig(cuda_graphs=True, buffer_size_gb=2.0, speculative_adaptive=False)
    assert explicit.for_device("cpu") is explicit.for_device("cuda") is explicit
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            InferenceConfig(gpu_memory_utilization=bad).validate()


def test_cpu_runs_are_unchanged_by_the_graph_default():
    """CPU: the default config builds the 1 GB pool, no graph runner and no memory plan, and
    gives the tokens of an explicit eager config (graphs asked for on CPU are ignored)."""
    sizes = dict(block_size_tokens=4, max_requests=4, max_tokens=32, max_sequence_length=64)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
    outs = {}
    for name, extra in {"default": {}, "eager": {"cuda_graphs": False}, "graphs": {"cuda_graphs": True}}.items():
        llm = LLM(inference_config=InferenceConfig(**sizes, **extra))
        assert llm.runner.graphs is None and llm.memory_plan is None
        assert llm.config.cuda_graphs is extra.get("cuda_graphs", False)
        spec = llm.model.kv_cache_spec()
        block = 2 * 4 * spec.num_kv_heads * spec.head_dim * 4 * spec.num_layers
        assert llm.context.num_kv_blocks == int(1e9 // block) + 1
        outs[name] = [o.generated_tokens for o in llm.generate(prompts, sp)]
    assert outs["default"] == outs["eager"] == outs["graphs"]
