"""A step launches device work only: nothing in ``compute_step`` makes the host wait for the
device (``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero``...) or uploads host data
(``torch.tensor(list)``, pinning). On a GPU such an op inside a step stalls Python on every
large prefill, and inside a CUDA graph capture it invalidates the capture: the start-up's dry
captures (kernel_prebuild.py) then fall back to building kernels one by one. Checked here on
the CPU, where the same host code runs, for the memory profile's largest step and every eager
warm-up shape, by recording the ops that reach the dispatcher and the host-read methods."""
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_async.config import InferenceConfig
from megatron_async.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron_async.inference.device import DeviceFacade
from megatron_async.inference.memory_profiling import peak_step_shape
from megatron_async.inference.text_generation_controllers.model_runner import ModelRunner
from megatron_async.inference.text_generation_controllers.warmup import eager_shapes
from megatron_async.models import build_default_model

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
              aten.masked_select.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
              aten.unique_consecutive.default, aten.lift_fresh.default, aten._pin_memory.default}
"""Ops that read a tensor's values on the host or turn host data into a tensor."""
MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
"""With a bool index, these count its true entries on the host (a nonzero on CUDA)."""
HOST_METHODS = ("item", "tolist", "numpy", "cpu", "__int__", "__float__", "__index__")
"""Host reads that skip the dispatcher here (a CPU tensor; ``item`` under inference mode)."""


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None) or (
                func in MASK_INDEXING and any(_is_mask(i) for i in args[1])):
            self.seen.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    for name in HOST_METHODS:
        monkeypatch.setattr(torch.Tensor, name, _recording(rec, name, getattr(torch.Tensor, name)))
    return rec


def _recording(rec: _Recorder, name: str, method):
    def call(self, *args, **kwargs):
        rec.seen.append(name)
        return method(self, *args, **kwargs)

    return call


def _probe_runner(max_tokens: int, max_requests: int):
    """The memory profile's runner (two KV blocks, sampler state allocated) on the tiny model."""
    model = build_default_model("tiny", "cpu", torch.float32)
    cfg = InferenceConfig(block_size_tokens=4, max_requests=max_requests, max_tokens=max_tokens, max_sequence_length=64)
    ctx = DynamicInferenceContext(replace(cfg, num_kv_blocks=2).cache_sizing(), model, DeviceFacade("cpu"),
                                  torch.float32, cfg.kernels().batch_invariant)
    ctx.sampling_state.ensure_allocated()
    return ModelRunner(model, ctx, cfg.kernels())


@torch.inference_mode()
def _host_reads(runner, recorder, shape, width: int = 0) -> list[str]:
    ctx = runner.context
    ctx.gpu_view.buffer.copy_(ctx.padding_snapshot(shape.num_rows, shape.num_tokens, width))
    recorder.seen.clear()
    with recorder:
        runner.compute_step(shape)
    return list(recorder.seen)


def test_the_memory_profile_step_reads_nothing_on_the_host(recorder):
    runner = _probe_runner(max_tokens=48, max_requests=4)
    shape = peak_step_shape(runner)
    assert shape.any_penalties and shape.any_log_probs and all(shape.filters) and shape.num_tokens == 48
    assert _host_reads(runner, recorder, shape) == []


def test_no_warmup_shape_reads_anything_on_the_host(recorder):
    runner = _probe_runner(max_tokens=48, max_requests=4)
    shapes = eager_shapes(runner)
    assert len(shapes) > 10
    reads = [((s.num_tokens, s.num_rows, s.any_penalties), _host_reads(runner, recorder, s, w)) for s, w in shapes]
    assert [(key, r) for key, r in reads if r] == []


def test_the_recorder_sees_a_host_read(recorder):
    """The hooks catch what they are for (``.item()``, ``bool``, ``.tolist()``, ``torch.tensor``)."""
    x = torch.ones(3)
    with torch.inference_mode(), recorder:
        x.sum().item(), bool(x[0]), int(x[1]), x.tolist(), torch.tensor([1, 2]), torch.nonzero(x), x[x > 0]
    assert {"item", "aten.is_nonzero.default", "__int__", "tolist", "aten.lift_fresh.default", "aten.nonzero.default",
            "aten.index.Tensor"} <= set(recorder.seen)
